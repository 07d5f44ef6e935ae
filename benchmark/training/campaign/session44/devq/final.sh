# Session 44, after the run: the new draft averaged with its start (session 42's grown draft,
# equal weights: "soup44"; a later session names its soup with SOUP in its env), then the held-out set on this GPU (bf16, 256 tokens, one row: session
# 39's command) for the soup and the new draft, then the start again on this machine (like for
# like; it read 3.52 on session 42's H100). The soup is remade here on the CPU from the two
# (scripts/draft_soup.py is deterministic), so only the new draft's parts come back (pack).
. .devq/common.sh > /dev/null 2>&1
SOUP=${SOUP:-soup44}
S=/tmp/stage/files/draft; mkdir -p /tmp/ev
python3 scripts/draft_soup.py /tmp/$SOUP $S /tmp/train_out/checkpoint 2>&1 | tail -n 1
cp /tmp/$SOUP/soup.json /tmp/ev/
# EVAL_START=0 (env) skips the start when device time is short (it read 3.52 on session 42's H100)
runs="$SOUP:/tmp/$SOUP new:/tmp/train_out/checkpoint"; [ "${EVAL_START:-1}" = 1 ] && runs="$runs start:$S"
for d in $runs; do
  n=${d%%:*}; p=${d#*:}
  timeout 130 python3 -m dflash.engine.cli eval-draft --target $M --draft $p --max-tokens 256 --dtype bfloat16 --rows 1 \
    --out /tmp/ev/heldout-gpu-bf16-256-$n.json > /tmp/ev/heldout-gpu-$n.log 2>&1; echo "eval $n rc $?"; grep overall /tmp/ev/heldout-gpu-$n.log
  tar cf $OUT/evals.tar -C /tmp ev
done
