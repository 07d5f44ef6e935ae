# Session 50's final phase: session 44's final.sh (soup50 = the new draft averaged with soup41,
# then the held-out set for soup50 and the new draft; EVAL_START=0), then, last because it may
# fault the GPU on purpose, session 49's generation fault: scripts/genmem_probe.py (random weights
# of the target's shape, no stop token) at 2,048 and 512 rows, with the kernel log's Xid count
# after each (session 49: Xid 31 MMU faults and cublasLt code 13 / illegal memory access in the
# first batch of answers at 2,048 and 1,024 rows on an H100; 256 rows ran). Each probe has 60 s.
[ "${EVALS:-1}" = 1 ] && bash benchmark/training/campaign/session44/devq/final.sh  # EVALS=0: the probe only
. .devq/common.sh > /dev/null 2>&1
mkdir -p /tmp/ev
xids() { if dmesg > /tmp/dmesg.txt 2>&1; then grep -c Xid /tmp/dmesg.txt; else echo "unreadable (dmesg not permitted)"; fi; }
echo "Xid lines in the kernel log before the probe: $(xids)"
# The probe and engine/ from the carried working tree (SRC=<its root>, on run.sh's command line):
# session 50's batch_generate runs each decode step only once the last one has finished
# (mx.synchronize), which on the CPU kept the peak at ~1x the KV where the pipelined loop reached
# 2-3x (tests/test_genmem_s50.py); --no-sync replays the pipelined loop. Pairs at 256 rows (the
# data phase's size: speed and peak, the same token hash expected) first, then 2,048 rows, where
# session 49's data phase faulted, each way. 60 s each at most.
mkdir -p /tmp/ns2/dflash
for d in engine cache daemon client launchd; do ln -sfn "$SRC/$d" "/tmp/ns2/dflash/$d"; done
for arm in 256: 256:--no-sync 2048: 2048:--no-sync; do
  r=${arm%%:*}; f=${arm#*:}; n=$r${f:+-nosync}
  PYTHONPATH=/tmp/ns2:$PYTHONPATH timeout 60 python3 "$SRC/scripts/genmem_probe.py" \
    --config /tmp/stage/files/smoltok/config.json --rows $r --widths 64 $f \
    --out /tmp/ev/genmem_$n.json > /tmp/ev/genmem_$n.log 2>&1
  echo "genmem $n rc $? | Xid lines in the kernel log: $(xids)"; tail -n 2 /tmp/ev/genmem_$n.log
done
tar cf $OUT/evals.tar -C /tmp ev
