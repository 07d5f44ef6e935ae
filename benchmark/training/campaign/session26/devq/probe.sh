# Session 26, second machine: what rows cost a verify by cache length (SmolLM2-135M bf16, a random Qwen3-8B shape), then the default rows at first-time lengths.
. .devq/common.sh
timeout 150 python3 scripts/rows_cost_probe.py --model $M --dtype bfloat16 --out $OUT/rows-cost-smollm2-135m-s26-h200.json 2>&1 | grep -v Warn
timeout 170 python3 scripts/rows_cost_probe.py --random-target qwen3-8b --dtype bfloat16 --lengths 128,512,1024,2048,4096 --rows 1,2,4,8 --repeats 11 --out $OUT/rows-cost-qwen3-8b-random-s26-h200.json 2>&1 | grep -v Warn
bench s26-firsttime-default "" /tmp/stage/files/draft 150 --contexts 128
