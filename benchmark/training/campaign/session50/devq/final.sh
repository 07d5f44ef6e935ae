# Session 50's final phase: session 44's final.sh (soup50 = the new draft averaged with soup41,
# then the held-out set for soup50 and the new draft; EVAL_START=0), then, last because it may
# fault the GPU on purpose, session 49's generation fault: scripts/genmem_probe.py (random weights
# of the target's shape, no stop token) at 2,048 and 512 rows, with the kernel log's Xid count
# after each (session 49: Xid 31 MMU faults and cublasLt code 13 / illegal memory access in the
# first batch of answers at 2,048 and 1,024 rows on an H100; 256 rows ran). Each probe has 60 s.
bash benchmark/training/campaign/session44/devq/final.sh
. .devq/common.sh > /dev/null 2>&1
mkdir -p /tmp/ev
xids() { if dmesg > /tmp/dmesg.txt 2>&1; then grep -c Xid /tmp/dmesg.txt; else echo "unreadable (dmesg not permitted)"; fi; }
echo "Xid lines in the kernel log before the probe: $(xids)"
# 2,048 rows with the whole-length KV cache (the suspect, 570031a), then with the old 256-slot
# growth it replaced (--old-growth), then 512 rows
for arm in 2048: 2048:--old-growth 512:; do
  r=${arm%%:*}; f=${arm#*:}; n=$r${f:+-old}
  timeout 60 python3 scripts/genmem_probe.py --config /tmp/stage/files/smoltok/config.json --rows $r $f \
    --out /tmp/ev/genmem_$n.json > /tmp/ev/genmem_$n.log 2>&1
  echo "genmem $n rc $? | Xid lines in the kernel log: $(xids)"; tail -n 2 /tmp/ev/genmem_$n.log
done
tar cf $OUT/evals.tar -C /tmp ev
