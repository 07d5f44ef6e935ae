# After training (GPU free): the new draft against the bundled one in one process on mlx-lm's own
# texts (the ship rule's H200 half; the CPU half runs here after the weights come back).
. .devq/common.sh
timeout 380 python3 scripts/arms_ab.py --model $M --draft /tmp/stage/files/draft --dtype bfloat16 --baseline \
  --teach --heldout 11 --rounds 2 --max-tokens 256 --warmup 1 --arm bundled \
  --arm new:draft=/tmp/train_out/checkpoint --out "$OUT/arms-ab-h200-draft.json" 2>&1 | tail -n 12
