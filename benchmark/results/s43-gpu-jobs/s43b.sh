# Session 43, call B: the whole product on the GPU at the session's final code (head.tar of that
# HEAD): dflashd + dflash-client on the five chat questions (--compare-plain), then `dflash serve`
# in front of it: one chat, the worker SIGKILLed, a chat sent during the restart backoff (4 s)
# that must wait for the new worker and be answered 200 (this session's gateway change)
set -u
source .device/$N/activate.sh >/dev/null
rm -rf /tmp/head && mkdir -p /tmp/head && tar xf /tmp/stage/files/head.tar -C /tmp/head
cd /tmp/head
OUT=$OUT bash scripts/h200_pair.sh ptxrestore
. benchmark/training/campaign/session26/devq/common.sh >/dev/null
B=/tmp/stage/files/bundled S=/tmp/dstate R=/tmp/drun
mkdir -p $S $R; chmod 700 $R
t0=$SECONDS
timeout 150 python3 -m dflash.daemon.cli start --model $M --draft $B --state-dir $S --runtime-dir $R; echo "start rc $? in $((SECONDS - t0)) s"
E=ipc://$R/worker.sock
while read -r q; do
  timeout 60 python3 -m dflash.client.cli --endpoint $E prompt --stats --compare-plain --max-tokens 256 "$q" > /tmp/one.txt 2>&1
  echo "rc $? | $(tail -n 3 /tmp/one.txt | tr '\n' ' ')"; cat /tmp/one.txt >> $OUT/daemon-demo-s43.txt
done <<'QS'
What are three simple ways to drink more water during the day?
Write a Python function that returns the second largest number in a list.
A recipe needs 3 eggs for 12 cookies. How many eggs do I need for 30 cookies?
Explain how a refrigerator keeps food cold.
Write a short story about a snail who wants to see the ocean.
QS
python3 -m dflash.daemon.cli status --runtime-dir $R > $OUT/daemon-status-s43.txt 2>&1; head -n 12 $OUT/daemon-status-s43.txt
python3 -m dflash.daemon.cli stop --runtime-dir $R; echo "stop rc $?"
DFLASH_RESTART_BACKOFF_S=4 python3 -m dflash.engine.cli serve --model $M --draft $B --state-dir $S --runtime-dir $R --port 8123 > /tmp/serve.log 2>&1 &
SP=$!
python3 - > $OUT/gateway-restart-s43.txt 2>&1 <<'PY'
import json, subprocess, time, urllib.request, urllib.error
U = "http://127.0.0.1:8123"
def get(path, body=None, timeout=90):
    req = urllib.request.Request(U + path, data=json.dumps(body).encode() if body else None,
                                 headers={"content-type": "application/json"})
    t = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), time.monotonic() - t
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), time.monotonic() - t
for _ in range(180):
    try:
        if get("/health", timeout=5)[0] == 200: break
    except Exception: pass
    time.sleep(1)
chat = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 64}
code, body, dt = get("/v1/chat/completions", chat)
print("chat", code, f"{dt:.2f}s", json.dumps(body)[:400])
subprocess.run(["pkill", "-9", "-f", "dflash.daemon.worker"])
time.sleep(1.0)
print("health after kill", get("/health", timeout=10)[:2])
code, body, dt = get("/v1/chat/completions", chat)
print("chat during restart", code, f"{dt:.2f}s", json.dumps(body)[:400])
PY
cat $OUT/gateway-restart-s43.txt
kill -INT $SP; wait $SP; echo "serve rc $?"; tail -n 25 /tmp/serve.log > $OUT/serve-s43.log
