# After training (GPU free): the new draft against the bundled one in one process on mlx-lm's own
# texts (the ship rule's H200 half), cut to what the session's device time left.
. .devq/common.sh
timeout 200 python3 scripts/arms_ab.py --model $M --draft /tmp/stage/files/bundled --dtype bfloat16 --baseline \
  --teach --heldout 11 --rounds 1 --max-tokens 256 --warmup 1 --arm bundled \
  --arm new:draft=/tmp/train_out/checkpoint \
  --out "$OUT/arms-ab-h200-draft.json" 2>&1 | tail -n 14
