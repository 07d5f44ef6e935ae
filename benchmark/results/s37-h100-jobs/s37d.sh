# Session 37, call D: the daemon on the GPU. daemon/bench.py (in-process vs through the daemon,
# the same pair and prompts), then the demo's own line (`dflash-client prompt --stats
# --compare-plain`) on the five chat questions through one daemon
. .devq/common.sh > /dev/null 2>&1
bash scripts/h200_pair.sh ptxrestore
B=/tmp/stage/files/bundled
export DFLASH_BRANCHES=8
timeout 240 python3 -m dflash.daemon.bench --model $M --draft $B --out $OUT/daemon-bench-s37.json \
  --max-tokens 256 --repeats 3 > $OUT/daemon-bench-s37.log 2>&1; echo "daemon bench rc $?"; tail -n 30 $OUT/daemon-bench-s37.log
S=/tmp/dstate; R=/tmp/drun; mkdir -p $S $R; chmod 700 $R
timeout 150 python3 -m dflash.daemon.cli start --model $M --draft $B --state-dir $S --runtime-dir $R; echo "start rc $?"
E=ipc://$R/worker.sock
python3 -m dflash.daemon.cli status --runtime-dir $R 2>&1 | head -n 20
while read -r q; do
  timeout 60 python3 -m dflash.client.cli --endpoint $E prompt --stats --compare-plain --max-tokens 256 "$q" > /tmp/one.txt 2>&1
  echo "rc $? | $(tail -n 3 /tmp/one.txt | tr '\n' ' ')"; cat /tmp/one.txt >> $OUT/daemon-demo-s37.txt
done <<'QS'
What are three simple ways to drink more water during the day?
Write a Python function that returns the second largest number in a list.
A recipe needs 3 eggs for 12 cookies. How many eggs do I need for 30 cookies?
Explain how a refrigerator keeps food cold.
Write a short story about a snail who wants to see the ocean.
Write a short story about a robot who learns to paint.
QS
python3 -m dflash.daemon.cli status --runtime-dir $R > $OUT/daemon-status-s37.txt 2>&1
python3 -m dflash.daemon.cli stop --runtime-dir $R; cp -r $S/logs $OUT/ 2>/dev/null; ls $OUT
