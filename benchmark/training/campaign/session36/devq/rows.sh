. .devq/common.sh > /dev/null 2>&1
bash scripts/h200_pair.sh ptxrestore
for r in 1 8; do
  timeout 150 python3 -m dflash.engine.cli eval-draft --target $M --draft /tmp/stage/files/bundled \
    --max-tokens 256 --dtype bfloat16 --rows $r --out "$OUT/ev_bundled_bf16_rows$r.json" 2>&1 | grep -E "overall|position|rows|rror" | tail -n 3
done
