# Next session's first GPU work, before the data phase starts (h200_session.sh runs .devq/job.sh
# first): the data generation's peak memory at 2,048 rows x 512 new tokens, with session 34's fix
# and with the 256-slot growth it replaced (scripts/genmem_probe.py; random weights, no stop).
. .devq/common.sh > /dev/null 2>&1
for m in "" --old-growth; do
  timeout 100 python3 scripts/genmem_probe.py --config /tmp/stage/files/smoltok/config.json $m \
    --out "$OUT/genmem${m:+_old}.json" 2>&1 | tail -n 3
done
