# session 31, second call: kept rows against copied rows in one process on SmolLM2; the raw-text
# cycle profile at ~1K tokens, default rows and one row
. .devq/common.sh
echo "== arms_ab keep $(date +%T)"
timeout 300 python3 scripts/arms_ab.py --model $M --draft /tmp/stage/files/draft --dtype bfloat16 --baseline \
  --teach --heldout 11 --rounds 2 --max-tokens 256 --warmup 1 --arm copy:keep=0 --arm keep:keep=1 \
  --out "$OUT/arms-ab-keep-h200.json" 2>&1 | tail -n 14
for b in default 1; do
  echo "== cycle profile branches=$b $(date +%T)"
  ( [ $b = 1 ] && export DFLASH_BRANCHES=1; timeout 110 python3 scripts/cycle_profile.py --model $M --draft /tmp/stage/files/draft \
    --dtype bfloat16 --contexts 900,1200,1500 --max-tokens 256 --out "$OUT/cycle-profile-ctx-branches-$b-h200.json" 2>&1 | tail -n 16 )
done
echo "== c2 done $(date +%T)"
