# Session 39, call E (an H200): call C again with two repeats of each question (call C's three
# needed ~37 s a process on this machine and its 540 s ran out in the 15th, before the JSON)
. .devq/common.sh >/dev/null 2>&1; source .device/8/activate.sh >/dev/null
bench chatpp-s39-h200-r2 8 /tmp/stage/files/bundled 560 --chat --process-per-run --repeats 2
grep -E "^== process|tok/s \|" /tmp/results/chatpp-s39-h200-r2.log | tail -n 4
