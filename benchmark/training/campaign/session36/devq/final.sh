# After training: the new draft in bf16 on the GPU (the trainer evaluated it with its fp32 target)
. .devq/common.sh > /dev/null 2>&1
timeout 150 python3 -m dflash.engine.cli eval-draft --target $M --draft /tmp/train_out/checkpoint \
  --max-tokens 256 --dtype bfloat16 --out "$OUT/ev_new_bfloat16.json" 2>&1 | grep -v "^\[eval\] [0-9]" | tail -n 4
# the start point (session 35's draft) with the fp32 target, as the trainer measured the new one
timeout 120 python3 -m dflash.engine.cli eval-draft --target /tmp/stage/files/smol-fp32 --draft /tmp/stage/files/draft \
  --max-tokens 256 --dtype float32 --out "$OUT/ev_s35_float32.json" 2>&1 | grep -v "^\[eval\] [0-9]" | tail -n 2
