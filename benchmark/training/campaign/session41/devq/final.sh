# Session 41, after the run: the new draft averaged with its start (session 40's soup, equal
# weights), then the held-out set on this GPU (bf16, 256 tokens, one row: session 39's command)
# for that soup, the new draft, and the start again on this machine (like for like)
. .devq/common.sh > /dev/null 2>&1
S=/tmp/stage/files/draft; mkdir -p /tmp/ev
python3 scripts/draft_soup.py /tmp/soup41 $S /tmp/train_out/checkpoint 2>&1 | tail -n 1
cp /tmp/soup41/soup.json /tmp/ev/
for d in soup41:/tmp/soup41 new:/tmp/train_out/checkpoint start:$S; do
  n=${d%%:*}; p=${d#*:}
  timeout 110 python3 -m dflash.engine.cli eval-draft --target $M --draft $p --max-tokens 256 --dtype bfloat16 --rows 1 \
    --out /tmp/ev/heldout-gpu-bf16-256-$n.json > /tmp/ev/heldout-gpu-$n.log 2>&1; echo "eval $n rc $?"; grep overall /tmp/ev/heldout-gpu-$n.log
  tar cf $OUT/evals.tar -C /tmp ev
done
