# Session 38, call B: the window memory on the GPU, in one process: a fresh window every run,
# costs carried across runs (the new default, as the daemon does), everything carried (the old way)
. .devq/common.sh > /dev/null 2>&1
bash scripts/h200_pair.sh ptxrestore
B=/tmp/stage/files/bundled
export DFLASH_BRANCHES=8
timeout 540 python3 scripts/arms_ab.py --model $M --draft $B --dtype bfloat16 --baseline --heldout 7 --rounds 2 \
  --max-tokens 256 --tolerate-id-diffs --arm fresh --arm costs:mem=1 --arm all:mem=1,recall=1 \
  --out $OUT/arms-ab-mem-s38-gpu.json > $OUT/arms-ab-mem-s38-gpu.log 2>&1
echo "rc $?"; tail -n 25 $OUT/arms-ab-mem-s38-gpu.log
