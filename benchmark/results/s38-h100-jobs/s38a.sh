# Session 38, call A: the worker's warm-up on a fresh GPU daemon (its first request), then the
# daemon against in-process decoding, interleaved, with the window memory's new default (costs only)
. .devq/common.sh > /dev/null 2>&1
bash scripts/h200_pair.sh ptxrestore
B=/tmp/stage/files/bundled
export DFLASH_BRANCHES=8
S=/tmp/dstate; R=/tmp/drun; mkdir -p $S $R; chmod 700 $R
t0=$(date +%s.%N)
timeout 150 python3 -m dflash.daemon.cli start --model $M --draft $B --state-dir $S --runtime-dir $R; echo "start rc $? in $(python3 -c "print(round($(date +%s.%N)-$t0,1))") s"
E=ipc://$R/worker.sock
python3 -m dflash.daemon.cli status --runtime-dir $R 2>&1 | head -n 20
while read -r q; do
  timeout 60 python3 -m dflash.client.cli --endpoint $E prompt --stats --compare-plain --max-tokens 256 "$q" > /tmp/one.txt 2>&1
  echo "rc $? | $(tail -n 3 /tmp/one.txt | tr '\n' ' ')"; cat /tmp/one.txt >> $OUT/daemon-demo-s38.txt
done <<'QS'
What are three simple ways to drink more water during the day?
Write a Python function that returns the second largest number in a list.
A recipe needs 3 eggs for 12 cookies. How many eggs do I need for 30 cookies?
Explain how a refrigerator keeps food cold.
Write a short story about a snail who wants to see the ocean.
Write a short story about a robot who learns to paint.
QS
python3 -m dflash.daemon.cli status --runtime-dir $R > $OUT/daemon-status-s38.txt 2>&1
python3 -m dflash.daemon.cli stop --runtime-dir $R; cp -r $S/logs $OUT/ 2>/dev/null
timeout 330 python3 -m dflash.daemon.bench --model $M --draft $B --out $OUT/daemon-bench-interleaved-s38.json \
  --max-tokens 256 --repeats 3 --variants inproc,daemon,inproc,daemon > $OUT/daemon-bench-interleaved-s38.log 2>&1
echo "bench rc $?"; grep -E '^(inproc|thread|daemon|daemon-nocache):' $OUT/daemon-bench-interleaved-s38.log; tail -n 8 $OUT/daemon-bench-interleaved-s38.log
ls $OUT
