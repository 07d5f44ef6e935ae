# Session 42, after the run: the grown draft on the held-out set on this GPU (bf16, 256 tokens,
# one row: session 39's command; soup41 read 3.47 on session 41's H100, the same texts), then,
# as time allows, the grown draft against soup41 in one process on mlx-lm's own texts (the GPU's
# 8 draft rows; session 39's arms_ab command)
. .devq/common.sh > /dev/null 2>&1
S=/tmp/stage/files/draft; G=/tmp/train_out/checkpoint; mkdir -p /tmp/ev
timeout 130 python3 -m dflash.engine.cli eval-draft --target $M --draft $G --max-tokens 256 --dtype bfloat16 --rows 1 \
  --out /tmp/ev/heldout-gpu-bf16-256-grown.json > /tmp/ev/heldout-gpu-grown.log 2>&1; echo "eval grown rc $?"
grep overall /tmp/ev/heldout-gpu-grown.log
tar cf $OUT/evals.tar -C /tmp ev
timeout 300 python3 scripts/arms_ab.py --model $M --draft $S --dtype bfloat16 --baseline --teach --heldout 11 --rounds 2 \
  --max-tokens 256 --arm soup41:rows=8 --arm grown:draft=$G,rows=8 --out /tmp/ev/arms-ab-grown-s42-gpu.json > /tmp/ev/arms-ab-grown-s42-gpu.log 2>&1
echo "arms rc $?"; tail -n 12 /tmp/ev/arms-ab-grown-s42-gpu.log
tar cf $OUT/evals.tar -C /tmp ev
