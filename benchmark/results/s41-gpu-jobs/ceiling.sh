# Session 41: the README's "engine ceiling" and "acceptance 0" rows again with today's engine (last
# measured in session 10, before the verify-attention kernel, fused products, draft rows and the
# window's wide rule): a random-weight Qwen3-8B shape, 5-layer random draft, first-time lengths,
# the same commands as session 10 (repeats 7), each mode in its own process:
#   oracle: every draft accepted (the ceiling);  acc0: the random draft, "auto";  plain: window 1
set -u
mkdir -p /tmp/ns/dflash /tmp/r
for d in engine cache daemon client launchd; do ln -sfn "$PWD/$d" "/tmp/ns/dflash/$d"; done
export PYTHONPATH=/tmp/ns:$PWD/scripts:${PYTHONPATH:-} PYTHONUNBUFFERED=1
bash scripts/h200_pair.sh ptxrestore
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
run() {  # run NAME TIMEOUT FLAGS...: one dflash benchmark, its JSON and log into $OUT
  local name=$1 t=$2; shift 2
  timeout "$t" python3 -m dflash.engine.cli benchmark --random-target qwen3-8b --draft-layers 5 \
    --contexts 1024,8192 --max-tokens 257 --repeats 7 --cooldown 1 --label "$name" --out "/tmp/r/$name" "$@" \
    > "$OUT/$name.log" 2>&1
  echo "$name rc $?"; tail -n 5 "$OUT/$name.log"
  for f in /tmp/r/$name/*.json; do [ -f "$f" ] && cp "$f" "$OUT/$name.json"; done
}
run random-qwen3-8b-oracle-s41 200 --oracle
run random-qwen3-8b-auto-acc0-s41 170
run random-qwen3-8b-plain-s41 170 --verify-window 1
