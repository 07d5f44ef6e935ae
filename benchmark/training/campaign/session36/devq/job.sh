# Session 36's first GPU work: is the CPU's ~0.3 lower tau the fp32 texts? The bundled draft on the
# 48 held-out prompts, 256 tokens, with the target in bf16 and in fp32 (fp32 rebuilt from the GGUF,
# as the CPU's weights), each answer's ids saved to compare the texts.
. .devq/common.sh > /dev/null 2>&1
F=/tmp/stage/files/smol-fp32
[ -d $F ] || python3 scripts/h200_target.py /tmp/stage/files/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/stage/files/smoltok $F --dtype float32
for dt in bfloat16 float32; do
  m=$M; [ $dt = float32 ] && m=$F
  timeout 150 python3 -m dflash.engine.cli eval-draft --target $m --draft /tmp/stage/files/bundled \
    --max-tokens 256 --dtype $dt --out "$OUT/ev_bundled_$dt.json" 2>&1 | grep -v "^\[eval\] [0-9]" | tail -n 4
done
