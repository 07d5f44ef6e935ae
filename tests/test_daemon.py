"""The daemon end to end: real supervisor + worker processes, real ipc sockets, tiny real models."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest
from daemon_fixtures import PROMPTS, running, make_daemon, reference, tiny_pair  # noqa: F401

from dflash.client import AsyncDFlashClient, BadRequestError, BusyError, NotFoundError
from dflash.daemon import paths


@pytest.fixture(scope="module")
def daemon(tiny_pair):  # noqa: F811
    yield from running(tiny_pair, max_queue=3)


@pytest.fixture
def client(daemon):
    with daemon.client(timeout=20) as c:
        yield c


def _wait_idle(client, timeout=20.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not client.jobs():
            return
        time.sleep(0.05)
    raise AssertionError(f"worker still busy: {client.jobs()}")


def test_generate_matches_in_process(client, tiny_pair):  # noqa: F811
    res = client.generate(PROMPTS[0], max_tokens=24)
    text, ids = reference(tiny_pair, PROMPTS[0], 24)
    assert res.token_ids == ids and res.text == text
    assert res.finish_reason in ("length", "stop")
    assert res.stats["generated_tokens"] == len(ids) and res.stats["prompt_tokens"] > 0


def test_stream_deltas_add_up(client):
    with client.stream(PROMPTS[1], max_tokens=20) as s:
        deltas = list(s)
    assert len(deltas) >= 2
    assert "".join(d.text for d in deltas) == s.result.text
    assert [t for d in deltas for t in d.token_ids] == s.result.token_ids


def test_chat_messages_and_token_ids(client, tiny_pair):  # noqa: F811
    msgs = [{"role": "user", "content": PROMPTS[2]}]
    assert client.generate(msgs, max_tokens=12).token_ids == reference(tiny_pair, PROMPTS[2], 12)[1]
    with_sys = client.generate(PROMPTS[2], system="Be brief.", max_tokens=12)
    assert with_sys.token_ids == reference(tiny_pair, PROMPTS[2], 12, system="Be brief.")[1]
    ids = [5, 6, 7, 8, 9, 10]
    assert client.generate(ids, max_tokens=12).token_ids == reference(tiny_pair, ids, 12)[1]
    with pytest.raises(Exception) as e:  # ids outside the vocabulary fail the job, not the worker
        client.generate([10**6], max_tokens=4)
    assert e.value.code == "bad_request"


def test_submit_handle_and_status(client, tiny_pair):  # noqa: F811
    h = client.submit(PROMPTS[3], max_tokens=16)
    res = h.result(timeout=30)
    assert res.token_ids == reference(tiny_pair, PROMPTS[3], 16)[1]
    assert h.status() == "done"
    with pytest.raises(NotFoundError):
        client.job("no-such-job").status()


def test_cancel_mid_stream_frees_worker(client):
    s = client.stream(PROMPTS[4], max_tokens=4000)
    it = iter(s)
    next(it)
    t0 = time.monotonic()
    assert client.cancel(s.job_id)["cancelled"] is True
    rest = list(it)  # the stream ends with a cancelled Done
    assert s.result.finish_reason == "cancelled" and len(s.result.token_ids) < 4000
    nxt = client.generate(PROMPTS[5], max_tokens=8)  # the worker is free again at once
    assert len(nxt.token_ids) > 0 and time.monotonic() - t0 < 10
    assert isinstance(rest, list)


def test_client_going_away_cancels_its_job(client):
    s = client.stream(PROMPTS[6], max_tokens=4000)
    it = iter(s)
    next(it)
    s._sock.close(0)  # vanish without sending cancel, as a killed process would
    s._closed = True
    end = time.monotonic() + 10
    while time.monotonic() < end and client.status(s.job_id).state == "running":
        time.sleep(0.05)
    st = client.status(s.job_id)
    assert st.state == "cancelled", st


def test_busy_priority_and_time_limit(client):
    _wait_idle(client)
    long = client.submit(PROMPTS[7], max_tokens=4000, timeout_s=3.0)
    time.sleep(0.3)
    low = client.submit(PROMPTS[8], max_tokens=4, priority=-5)
    mid = client.submit(PROMPTS[8], max_tokens=4)
    high = client.submit(PROMPTS[8], max_tokens=4, priority=5)
    with pytest.raises(BusyError):  # max_queue=3 waiting: answered at once, nothing queued
        client.submit(PROMPTS[9], max_tokens=4)
    order = [j["job_id"] for j in client.jobs()]
    assert order == [long.job_id, high.job_id, mid.job_id, low.job_id]
    res = long.result(timeout=30)
    assert res.finish_reason == "timeout" and 0 < len(res.token_ids) < 4000
    for h in (low, mid, high):
        assert h.result(timeout=30).token_ids


def test_bad_requests_are_answered(client):
    for kw in ({"max_tokens": 10**9}, {"max_tokens": 0}, {"priority": 10**6}, {"stop": ["x"] * 40}):
        with pytest.raises(BadRequestError):
            client.generate(PROMPTS[0], **kw)
    with pytest.raises(BadRequestError):
        client.generate("   ", max_tokens=4)
    with pytest.raises(BadRequestError):
        client.generate([], max_tokens=4)


def test_async_client(daemon, tiny_pair):  # noqa: F811
    async def go():
        c = AsyncDFlashClient(daemon.endpoint, config=daemon.cfg, timeout=20)
        try:
            results = await asyncio.gather(*(c.generate(p, max_tokens=10) for p in PROMPTS[:3]))
            texts = []
            async for ev in c.stream(PROMPTS[0], max_tokens=10):
                texts.append(ev.text)
            return results, texts
        finally:
            c.close()

    results, texts = asyncio.run(go())
    for p, r in zip(PROMPTS[:3], results):
        assert r.token_ids == reference(tiny_pair, p, 10)[1]
    assert "".join(texts[:-1]) == texts[-1] == results[0].text


def test_cli_prompt_status_jobs(daemon, tiny_pair):  # noqa: F811
    base = [sys.executable, "-m", "dflash.client.cli", "--endpoint", daemon.endpoint]
    out = subprocess.run(base + ["prompt", PROMPTS[0], "--max-tokens", "12", "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)
    assert obj["token_ids"] == reference(tiny_pair, PROMPTS[0], 12)[1] and obj["stats"]["generated_tokens"] == 12
    out = subprocess.run(base + ["prompt", "-m", "12"], input=PROMPTS[0], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.rstrip("\n") == obj["text"]
    out = subprocess.run(base + ["status", "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and json.loads(out.stdout)["state"] == "ready"
    out = subprocess.run(base + ["jobs"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    out = subprocess.run(base + ["prompt", "x", "--max-tokens", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "max_tokens" in out.stderr
    gone = [sys.executable, "-m", "dflash.client.cli", "--endpoint", "ipc:///tmp/dflash-nowhere.sock", "--timeout", "1"]
    out = subprocess.run(gone + ["prompt", "hi"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 3 and "no dflash worker" in out.stderr


def test_socket_and_dirs_private(daemon):
    run_dir = daemon.cfg.runtime_path()
    sock = paths.ipc_path(daemon.endpoint)
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(sock.stat().st_mode) & 0o077 == 0
    assert stat.S_IMODE(daemon.cfg.state_path().stat().st_mode) == 0o700
    if os.getuid() == 0:  # really try as another user: connecting must fail
        probe = (
            "import os, socket, sys\n"
            "os.setgid(65534); os.setuid(65534)\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            f"try:\n    s.connect({str(sock)!r}); print('CONNECTED')\n"
            "except PermissionError: print('DENIED')\n"
        )
        out = subprocess.run(["/usr/bin/python3", "-c", probe], capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() == "DENIED", out.stdout + out.stderr


def test_cli_ctrl_c_cancels_the_job(daemon, client):
    _wait_idle(client)
    before = client.stats()["jobs_cancelled"]
    cmd = [sys.executable, "-m", "dflash.client.cli", "--endpoint", daemon.endpoint, "prompt", PROMPTS[0], "-m", "4000"]
    # SIGINT at its default in the child: a test run started in the background (`... &` in a
    # script) ignores SIGINT, children inherit that, and Python then installs no Ctrl-C handler
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        first = proc.stdout.read(1)  # streaming has begun
        assert proc.poll() is None, (first, proc.stdout.read(), proc.stderr.read())  # 4000 tokens: ~11 s
        proc.send_signal(signal.SIGINT)
        code = proc.wait(20)
        err = proc.stderr.read()
        assert code == 130, (code, first, err, proc.stdout.read()[-300:])
        assert b"cancelled" in err
    finally:
        if proc.poll() is None:
            proc.kill()
    _wait_idle(client, timeout=5)
    assert client.stats()["jobs_cancelled"] == before + 1


def test_cli_prompt_cancelled_by_another_client_exits_6(daemon, client):
    """A `prompt` whose job another client cancels printed the cut text and exited 0, so a script
    took it as the whole answer; now one stderr line says so and the exit code is 6."""
    _wait_idle(client)
    cmd = [sys.executable, "-m", "dflash.client.cli", "--endpoint", daemon.endpoint, "prompt", PROMPTS[0], "-m", "4000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        proc.stdout.read(1)  # streaming has begun
        running = [j for j in client.jobs() if j.get("state") == "running"]
        assert running, client.jobs()
        client.cancel(running[0]["job_id"])
        code = proc.wait(20)
        err = proc.stderr.read().decode()
        assert code == 6 and "was cancelled" in err, (code, err)
    finally:
        if proc.poll() is None:
            proc.kill()
    _wait_idle(client, timeout=5)


def test_a_job_starts_from_what_the_earlier_jobs_window_measured(make_daemon, tiny_pair, monkeypatch):  # noqa: F811
    """The worker keeps one WindowMemory per pair. With the acceptance recalled too (the opt-in
    DFLASH_WINDOW_RECALL_ACCEPTANCE=1; by default only the costs, engine/window.py) its random
    draft (acceptance ~0) is tried at the built-in prior by the first job only; the same
    request again drafts less, same ids."""
    monkeypatch.setenv("DFLASH_WINDOW_RECALL_ACCEPTANCE", "1")  # the worker inherits it
    d = make_daemon()
    with d.client(timeout=30) as c:
        runs = [c.generate(PROMPTS[1], max_tokens=40) for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids == reference(tiny_pair, PROMPTS[1], 40)[1]
    drafted = [r.stats["cycles"] - r.stats["plain_steps"] - r.stats["copy_cycles"] for r in runs]
    assert drafted[1] < drafted[0], [r.stats for r in runs]


def test_the_worker_warms_up_before_its_first_job_and_keeps_nothing_of_it(make_daemon, tiny_pair):  # noqa: F811
    """`warm_up` (on by default): the engine's paths run once after the load, before `ready`, so
    a fresh MLX-CUDA worker's first request does not pay its kernels' first calls. Nothing of it
    is kept: no job, no tokens, no prefix-cache entry, no window memory; the first job's ids are
    the target's as ever. Off, the log says nothing of it."""
    d = make_daemon()
    assert "warmed up in" in d.logs()
    with d.client(timeout=60) as c:
        st = c.stats()
        assert st["jobs_done"] == 0 and st["tokens_generated"] == 0 and st["queued"] == 0
        assert st["cache"]["lookups"] == 0 and st["cache"]["l1"]["entries"] == 0
        assert not (d.cfg.state_path() / "window_memory.json").exists()
        assert c.generate(PROMPTS[1], max_tokens=24).token_ids == reference(tiny_pair, PROMPTS[1], 24)[1]
    cold = make_daemon(warm_up=False)
    assert "warmed up" not in cold.logs() and "warm-up failed" not in d.logs() + cold.logs()


def test_what_the_window_measured_survives_a_worker_restart(make_daemon, tiny_pair, monkeypatch):  # noqa: F811
    """<state_dir>/window_memory.json (daemon/windowstore.py): a new worker of the same pair starts
    from what the last one measured (with the acceptance recalled too, the opt-in, the first job
    after a restart does not explore again)."""
    monkeypatch.setenv("DFLASH_WINDOW_RECALL_ACCEPTANCE", "1")  # the workers inherit it
    d = make_daemon()
    with d.client(timeout=60) as c:
        first = c.generate(PROMPTS[1], max_tokens=40)
        saved = json.loads((d.cfg.state_path() / "window_memory.json").read_text())
        (entry,) = saved["pairs"].values()
        assert entry["greedy"]["p"] is not None and entry["greedy"]["d"] is not None, entry
        pid = c.stats()["pid"]
        os.kill(pid, signal.SIGKILL)
        end = time.monotonic() + 60
        while time.monotonic() < end:  # the supervisor starts a new worker
            try:
                st = c.stats()
                if st["pid"] != pid and st["state"] == "ready":
                    break
            except Exception:  # noqa: BLE001 - the worker is away while it restarts
                pass
            time.sleep(0.1)
        again = c.generate(PROMPTS[1], max_tokens=40)
    assert again.token_ids == first.token_ids == reference(tiny_pair, PROMPTS[1], 40)[1]
    assert "verify window: starting from" in d.logs()  # the new worker read the file
    # the first job of a fresh worker opens at the built-in prior (acceptance 0.8: a wide window);
    # the restarted one knew this draft is rarely accepted and ran plain steps and narrow probes
    verified = [round(r.stats["mean_verify_window"] * r.stats["cycles"]) for r in (first, again)]
    assert verified[1] <= verified[0] - 4, [r.stats for r in (first, again)]
