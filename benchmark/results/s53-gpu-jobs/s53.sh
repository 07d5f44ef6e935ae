# Session 53, one device call: HEAD's code (staged as head.tar, so the run never sees the
# working tree's unfinished edits) on the goal's chat command at first-time lengths (a process
# per run, two repeats; as session 43's s43.sh), greedy (JOB=chat) or sampled at temperature 0.7
# (JOB=t07: exact sampling, first-time lengths too; session 43 measured it at revisited lengths).
set -u
source .device/$N/activate.sh >/dev/null
mkdir -p /tmp/head && [ -f /tmp/head/pyproject.toml ] || tar xf /tmp/stage/files/head.tar -C /tmp/head
cd /tmp/head
OUT=$OUT bash scripts/h200_pair.sh ptxrestore
. benchmark/training/campaign/session26/devq/common.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
case "${JOB:-chat}" in
  chat) bench chatpp-s53 8 /tmp/stage/files/bundled 560 --chat --process-per-run --repeats 2
        grep -E "^== process|tok/s \|" /tmp/results/chatpp-s53.log | tail -n 4 ;;
  t07)  bench chatpp-t07-s53 8 /tmp/stage/files/bundled 560 --chat --process-per-run --repeats 2 --temperature 0.7
        grep -E "^== process|tok/s \|" /tmp/results/chatpp-t07-s53.log | tail -n 4 ;;
esac
