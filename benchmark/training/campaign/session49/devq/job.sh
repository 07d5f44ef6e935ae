# Session 50's first GPU work (h200_session.sh runs .devq/job.sh once, at the first call, before
# the data phase; session44/devq/run.sh copies it from DEVQ):
# 1. soup47 (staged as draft/) on the held-out set, bf16, 256 tokens, one row (session 39's
#    command): the GPU number session 49 had no device time left for (CPU 2.70; soup41 2.68 on
#    the CPU read 3.47 on an H100).
# 2. Session 49's generation fault (Xid 31 MMU faults, then cublasLt code 13 or "illegal memory
#    access", in the first batch of the data phase at 2,048 and at 1,024 rows; 256 rows ran):
#    scripts/genmem_probe.py (random weights of the target's shape) at 2,048 and 512 rows (60 s each at most),
#    with the kernel log's Xid count after each. Its JSONs say the peak memory where it ran.
. .devq/common.sh > /dev/null 2>&1
mkdir -p /tmp/ev
timeout 130 python3 -m dflash.engine.cli eval-draft --target $M --draft /tmp/stage/files/draft --max-tokens 256 \
  --dtype bfloat16 --rows 1 --out /tmp/ev/heldout-gpu-bf16-256-soup47.json > /tmp/ev/heldout-gpu-soup47.log 2>&1
echo "eval soup47 rc $?"; grep overall /tmp/ev/heldout-gpu-soup47.log
for r in 2048 512; do
  timeout 60 python3 scripts/genmem_probe.py --config /tmp/stage/files/smoltok/config.json --rows $r \
    --out /tmp/ev/genmem_$r.json > /tmp/ev/genmem_$r.log 2>&1
  echo "genmem $r rows rc $? | Xid lines in the kernel log: $(dmesg 2>/dev/null | grep -c Xid)"; tail -n 2 /tmp/ev/genmem_$r.log
done
tar cf $OUT/job.tar -C /tmp ev
