# Session 54's one device job, at this session's HEAD (head.tar): the prefix cache's time to first
# token on the GPU after session 53's cache changes (snapshot envelopes copied in 4 MB pieces into
# an mmap, the writer's twin client, acknowledged writes paced at 32 MB/s), at 4,096 and 8,192
# prompt tokens; then the whole product (benchmark/results/s43-gpu-jobs/s43b.sh: dflashd +
# dflash-client --compare-plain on the five chat questions with the cache on, `dflash serve` with
# the worker SIGKILLed). Usage: N=<staged call> bash benchmark/results/s54-gpu-jobs/s54.sh
set -u
source .device/$N/activate.sh >/dev/null
rm -rf /tmp/head && mkdir -p /tmp/head && tar xf /tmp/stage/files/head.tar -C /tmp/head
(
cd /tmp/head
OUT=$OUT bash scripts/h200_pair.sh ptxrestore
. benchmark/training/campaign/session26/devq/common.sh >/dev/null
B=/tmp/stage/files/bundled
python3 -c "import mlx.core as mx; print(mx.__version__, mx.default_device())"
for n in 4096 8192; do
  t0=$SECONDS
  timeout 240 python3 -m dflash.cache.bench --model $M --draft $B --tokens $n --repeats 3 --every 1024 \
    --out $OUT/cache-ttft-$n-s54.json > /tmp/cb-$n.log 2>&1
  echo "cache bench $n rc $? in $((SECONDS - t0)) s"; tail -n 4 /tmp/cb-$n.log; cat /tmp/cb-$n.log >> $OUT/cache-bench-s54.log
done
)
bash benchmark/results/s43-gpu-jobs/s43b.sh  # from the carried tree (head.tar has no benchmark/results)
