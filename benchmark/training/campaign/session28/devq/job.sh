# GPU idle before training (first call): what rows cost by length, revisited or not, and where a
# rows cycle's time goes (session 26's open items b and c).
. .devq/common.sh
timeout 90 python3 scripts/rows_cost_probe.py --random-target qwen3-8b --lengths 512,2048,4096 --rows 1,8 \
  --parts --revisit --out "$OUT/rows-cost-qwen3-8b-revisit-h200.json" 2>&1 | tail -n 12
timeout 60 python3 scripts/rows_cost_probe.py --model $M --lengths 128,1024 --parts --revisit \
  --out "$OUT/rows-cost-smol-revisit-h200.json" 2>&1 | tail -n 8
timeout 60 python3 scripts/cycle_profile.py --model $M --draft /tmp/stage/files/draft --dtype bfloat16 \
  --heldout 3 --max-tokens 256 --out "$OUT/cycle-profile-rows-h200.json" 2>&1 | tail -n 12
