# session 31, first full call: (a) kept rows on the 8B shape, both cache modes; (b) sampled rows
# end to end at 0.7, off then on
. .devq/common.sh
for keep in 0 1; do
  echo "== rows keep=$keep $(date +%T)"
  DFLASH_ROWS_KEEP=$keep timeout 110 python3 scripts/rows_cost_probe.py --random-target qwen3-8b --lengths 512,2048,4096 \
    --rows 1,8 --parts --out "$OUT/rows-cost-qwen3-8b-keep$keep-h200.json" 2>&1 | tail -n 14
done
for s in 0 1; do
  echo "== sampled rows=$s $(date +%T)"
  DFLASH_SAMPLED_ROWS=$s bench s31-t07-sampledrows$s "" /tmp/stage/files/draft 150 --chat --repeats 2 --temperature 0.7
done
echo "== c1 done $(date +%T)"
