# Session 32, last device minutes: fresh answers for the next session (no training). Derive up to
# DERIVE prompts, answer for GEN_S seconds, stop the generator (the cache resumes where it stopped:
# drop_torn_tail), bring the cache home as xz parts.
set -uo pipefail
export MLX_CUDA_USE_CUDNN_SDPA=0 PYTHONUNBUFFERED=1 NGPU=1
FLAGS="--gen-batch-size 2048 --num-prompts 0 --exclude-prompts /tmp/train_out/data/derived_prompts.s3-5.jsonl --sampled-responses 0.5"
DERIVE=327817 bash scripts/h200_pair.sh data - $FLAGS
t0=$SECONDS
while [ $((SECONDS - t0)) -lt ${GEN_S:-220} ] && ! grep -q TRAIN_DONE /tmp/train_stdout.log; do sleep 5; done
grep -E '^\[data\]' /tmp/train_stdout.log | tail -n 4
pkill -f train_dist.py; sleep 4
wc -l /tmp/train_out/data/*.jsonl
time timeout 120 bash scripts/h200_pair.sh packdata
