#!/usr/bin/env bash
# How the default pair's draft was trained and benchmarked on the lent H200 (MLX-CUDA), in steps
# that fit the device tool's 10-minute calls. Run from the repo root after
# `source .device/N/activate.sh` (shared/device/mlx-cuda-prepare.sh with the bf16 SmolLM2 tar).
#   start BUDGET_S  - unpack the target, start training in the background (own session)
#   wait MAX_S      - wait for training to finish (or MAX_S), print progress
#   pack            - copy the draft + reports into $OUT (safetensors split into 15 MB parts)
#   bench [FLAGS]   - dflash benchmark of target + draft into $OUT (FLAGS added, e.g. --chat)
#   ttft            - prefix-cache TTFT (cold / L1 / L2) on a 4K-token prompt into $OUT
#                     (needs EXTRA="pyzmq==27.3.0 diskcache==5.6.3" when staging)
set -uo pipefail
MODEL=/tmp/stage/files/smol-bf16
TRAIN=/tmp/train_out
LOG=/tmp/train_stdout.log
DRAFT=${DRAFT:-$TRAIN}  # bench/ttft: the draft just trained, or e.g. the bundled one staged as a file
ns() {
  mkdir -p /tmp/ns/dflash
  for d in engine cache daemon client launchd; do ln -sfn "$PWD/$d" "/tmp/ns/dflash/$d"; done
  export PYTHONPATH=/tmp/ns:${PYTHONPATH:-} PYTHONUNBUFFERED=1
}
case "$1" in
  start)
    [ -d "$MODEL" ] || tar xf /tmp/stage/files/smol-bf16.tar -C /tmp/stage/files
    ns
    setsid nohup bash -c "bash scripts/train_smollm2_h200.sh $MODEL $TRAIN --time-budget-s $2 --ckpt-every 200 \
      || bash scripts/train_smollm2_h200.sh $MODEL $TRAIN --time-budget-s $2 --no-compile --resume; echo TRAIN_DONE" \
      > "$LOG" 2>&1 < /dev/null &
    sleep 5; tail -3 "$LOG" ;;
  wait)
    end=$((SECONDS + $2))
    while [ $SECONDS -lt $end ] && ! grep -q TRAIN_DONE "$LOG"; do sleep 10; done
    grep -E "^\[(data|eval|train)\]" "$LOG" | tail -25; grep -q TRAIN_DONE "$LOG" && echo "training finished" ;;
  pack)
    ns
    python3 -c "import sys, mlx.core as mx; from dflash.engine.draft import load_draft, save_draft
save_draft(load_draft(sys.argv[1], dtype=mx.bfloat16), sys.argv[2])" "$TRAIN" /tmp/draft_bf16
    (cd "$TRAIN" && tar cf "$OUT/reports.tar" --exclude=data --exclude=checkpoint --exclude=model.safetensors . \
      && split -b 15M /tmp/draft_bf16/model.safetensors "$OUT/draft.safetensors.part_")
    ls -la "$OUT" ;;
  bench)
    ns
    [ -d "$MODEL" ] || tar xf /tmp/stage/files/smol-bf16.tar -C /tmp/stage/files
    python3 -m dflash.engine.benchmark --model "$MODEL" --draft "$DRAFT" --contexts 128,1024 --max-tokens 256 \
      --repeats 3 --warmup 1 --cooldown 2 --label smollm2-135m-dflash-h200 --out "$OUT" "${@:2}" 2>&1 | tail -30 ;;
  ttft)
    ns
    [ -d "$MODEL" ] || tar xf /tmp/stage/files/smol-bf16.tar -C /tmp/stage/files
    python3 -m dflash.cache.bench --model "$MODEL" --draft "$DRAFT" --tokens 4096 --repeats 3 \
      --out "$OUT/prefix_cache_ttft_smollm2_135m_h200.json" 2>&1 | tail -30 ;;
esac
