# Session 43, one device call: HEAD's code (staged as head.tar, so the run never sees the
# working tree's unfinished edits) benchmarks the default pair on the goal's chat command at
# first-time lengths (a process per run, two repeats; session 39's s39e.sh), or, with
# JOB=heldout, on the 48 held-out prompts in one process (session 23's command, 8 rows now), or,
# with JOB=t07 (session 53), the chat command sampled at temperature 0.7 at first-time lengths.
# TAG names the result files (default s43; session 53 ran it as TAG=s53 through s53.sh).
set -u
T=${TAG:-s43}
source .device/$N/activate.sh >/dev/null
mkdir -p /tmp/head && [ -f /tmp/head/pyproject.toml ] || tar xf /tmp/stage/files/head.tar -C /tmp/head
cd /tmp/head
OUT=$OUT bash scripts/h200_pair.sh ptxrestore
. benchmark/training/campaign/session26/devq/common.sh
case "${JOB:-chat}" in
  chat) bench chatpp-$T 8 /tmp/stage/files/bundled 560 --chat --process-per-run --repeats 2
        grep -E "^== process|tok/s \|" /tmp/results/chatpp-$T.log | tail -n 4 ;;
  t07)  bench chatpp-t07-$T 8 /tmp/stage/files/bundled 560 --chat --process-per-run --repeats 2 --temperature 0.7
        grep -E "^== process|tok/s \|" /tmp/results/chatpp-t07-$T.log | tail -n 4 ;;
  heldout) bench heldout48-$T 8 /tmp/stage/files/bundled 560 --chat --prompt-file engine/training/heldout_prompts.jsonl --repeats 1 --cooldown 0 --verify-iters 0 ;;
esac
