# Session 50's generation probe alone (no data, no training: what a short device budget buys),
# staged with only the MLX wheels and the tokenizer's config (mlx-cuda-prepare.sh /tmp/s44/smoltok).
# scripts/genmem_probe.py and engine/ from the carried working tree: session 50's batch_generate
# runs each decode step once the last one has finished (mx.synchronize); --no-sync replays the
# pipelined loop it replaced. 256 rows (the data phase's size) each way for speed, peak and the
# token hash, then 2,048 rows (where session 49's data phase faulted) each way, 60 s each at most.
#   source .device/<last>/activate.sh && bash benchmark/training/campaign/session50/probe.sh
# ARMS="ROWS:FLAGS ..." picks the runs, WIDTH the prompt width (64), RAGGED=1 prompts of a quarter
# of the width up to it (genmem_probe.py --ragged; session 50 ran ARMS="2048:" and "1024:
# 2048:--no-sync" with WIDTH=81 RAGGED=1 after the four default arms: see README.md).
export MLX_CUDA_USE_CUDNN_SDPA=0 PYTHONUNBUFFERED=1
mkdir -p /tmp/ns2/dflash
for d in engine cache daemon client launchd; do ln -sfn "$PWD/$d" "/tmp/ns2/dflash/$d"; done
export PYTHONPATH=/tmp/ns2:$PYTHONPATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
xids() { if dmesg > /tmp/dmesg.txt 2>&1; then grep -c Xid /tmp/dmesg.txt; else echo "unreadable"; fi; }
echo "Xid lines in the kernel log before the probe: $(xids)"
for arm in ${ARMS:-256: 256:--no-sync 2048: 2048:--no-sync}; do
  r=${arm%%:*}; f=${arm#*:}; n=$r${f:+-nosync}
  timeout ${PROBE_S:-60} python3 scripts/genmem_probe.py --config /tmp/stage/files/smoltok/config.json \
    --rows $r --widths ${WIDTH:-64} ${RAGGED:+--ragged} $f --out $OUT/genmem_$n.json > $OUT/genmem_$n.log 2>&1
  echo "genmem $n rc $? | Xid lines: $(xids)"; tail -n 2 $OUT/genmem_$n.log
done
