unset DFLASH_VERIFY_ATTN DFLASH_BRANCHES
export MLX_CUDA_USE_CUDNN_SDPA=0 PYTHONUNBUFFERED=1
mkdir -p /tmp/ns/dflash /tmp/results
for d in engine cache daemon client launchd; do ln -sfn "$PWD/$d" "/tmp/ns/dflash/$d"; done
export PYTHONPATH=/tmp/ns:$PWD/scripts:${PYTHONPATH:-}
M=/tmp/stage/files/smol-bf16
[ -d $M ] || python3 scripts/h200_target.py /tmp/stage/files/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/stage/files/smoltok $M
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
bench() {  # bench NAME ROWS DRAFT TIMEOUT ARGS...: one dflash benchmark, its JSON and log into $OUT
  local name=$1 rows=$2 draft=$3 t=$4; shift 4
  DFLASH_BRANCHES=$rows timeout $t python3 -m dflash.engine.cli benchmark --model $M --draft $draft \
    --dtype bfloat16 --max-tokens 256 --repeats 3 --cooldown 1 --label $name --out /tmp/results/$name "$@" \
    > /tmp/results/$name.log 2>&1
  echo "$name rc $?"; tail -n 9 /tmp/results/$name.log
  for f in /tmp/results/$name/*.json; do [ -f "$f" ] && cp "$f" "$OUT/$name.json"; done; cp /tmp/results/$name.log "$OUT/"
}
