# Session 40, after the run: the new draft averaged with soup B (equal weights), then the held-out
# set on this GPU (bf16, 256 tokens, one row: session 39's command) for the soup and the new draft
. .devq/common.sh > /dev/null 2>&1
B=/tmp/stage/files/draft; mkdir -p /tmp/ev
python3 scripts/draft_soup.py /tmp/soupB_new $B /tmp/train_out/checkpoint 2>&1 | tail -n 1
cp /tmp/soupB_new/soup.json /tmp/ev/
for d in soupB_new:/tmp/soupB_new new:/tmp/train_out/checkpoint; do
  n=${d%%:*}; p=${d#*:}
  timeout 100 python3 -m dflash.engine.cli eval-draft --target $M --draft $p --max-tokens 256 --dtype bfloat16 --rows 1 \
    --out /tmp/ev/heldout-gpu-bf16-256-$n.json > /tmp/ev/heldout-gpu-$n.log 2>&1; echo "eval $n rc $?"; grep overall /tmp/ev/heldout-gpu-$n.log
  tar cf $OUT/evals.tar -C /tmp ev
done
