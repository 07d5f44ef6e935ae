# Session 39, call C (an H200): the goal's chat questions at first-time cache lengths, a process per
# repeat of each question (--process-per-run), then the compiled kernels for later sessions
. .devq/common.sh > /dev/null 2>&1
bash scripts/h200_pair.sh ptxrestore
B=/tmp/stage/files/bundled
bench chatpp-s39-h200 8 $B 540 --chat --process-per-run
grep -E "^== process|tok/s \|" /tmp/results/chatpp-s39-h200.log | tail -n 6
bash scripts/h200_pair.sh ptxpack
