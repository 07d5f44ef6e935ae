"""8 client processes x 10 jobs at once: every job answered once, none lost or duplicated, each
output identical to the same prompt run alone."""

from __future__ import annotations

import json
import subprocess
import sys

from daemon_fixtures import PROMPTS, make_daemon, reference, tiny_pair  # noqa: F401

CLIENT = r"""
import json, sys
from dflash.client import DFlashClient
endpoint, which, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prompts = json.loads(sys.argv[4])
c = DFlashClient(endpoint, timeout=120)
order = [(which + k) % len(prompts) for k in range(len(prompts))]
for n, i in enumerate(order):
    if n % 3 == 2:  # mix the three ways of getting a result
        r = c.submit(prompts[i], max_tokens=max_tokens).result(timeout=120)
    elif n % 3 == 1:
        s = c.stream(prompts[i], max_tokens=max_tokens)
        text = "".join(d.text for d in s)
        r = s.result
        assert text == r.text
    else:
        r = c.generate(prompts[i], max_tokens=max_tokens)
    print(json.dumps({"prompt": i, "job_id": r.job_id, "ids": r.token_ids, "text": r.text}), flush=True)
"""


def test_eight_processes_ten_jobs_each(make_daemon, tiny_pair):  # noqa: F811
    d = make_daemon(max_queue=128)
    max_tokens = 6
    with d.client(timeout=30) as c:
        alone = [c.generate(p, max_tokens=max_tokens) for p in PROMPTS]
        before = c.stats()["jobs_done"]
    for p, r in zip(PROMPTS, alone):  # the daemon alone == the engine in this process
        assert r.token_ids == reference(tiny_pair, p, max_tokens)[1]

    procs = [
        subprocess.Popen([sys.executable, "-c", CLIENT, d.endpoint, str(k), str(max_tokens), json.dumps(PROMPTS)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for k in range(8)
    ]
    rows = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        rows += [json.loads(line) for line in out.splitlines()]

    assert len(rows) == 80
    assert len({r["job_id"] for r in rows}) == 80  # none duplicated
    for r in rows:
        assert r["ids"] == alone[r["prompt"]].token_ids and r["text"] == alone[r["prompt"]].text
    with d.client() as c:
        st = c.stats()
    assert st["jobs_done"] - before == 80 and st["jobs_failed"] == 0 and st["queued"] == 0
