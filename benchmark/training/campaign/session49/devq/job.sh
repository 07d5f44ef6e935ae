# Session 50's first GPU work (h200_session.sh runs .devq/job.sh once, at the first call, before
# the data phase; session44/devq/run.sh copies it from DEVQ):
# 1. soup47 (staged as draft/) on the held-out set, bf16, 256 tokens, one row (session 39's
#    command): the GPU number session 49 had no device time left for (CPU 2.70; soup41 2.68 on
#    the CPU read 3.47 on an H100).
#    The generation-fault probe runs last, in final.sh (it may fault the GPU on purpose).
. .devq/common.sh > /dev/null 2>&1
mkdir -p /tmp/ev
timeout 130 python3 -m dflash.engine.cli eval-draft --target $M --draft /tmp/stage/files/draft --max-tokens 256 \
  --dtype bfloat16 --rows 1 --out /tmp/ev/heldout-gpu-bf16-256-soup47.json > /tmp/ev/heldout-gpu-soup47.log 2>&1
echo "eval soup47 rc $?"; grep overall /tmp/ev/heldout-gpu-soup47.log
tar cf $OUT/job.tar -C /tmp ev
