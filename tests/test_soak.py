"""What a daemon left running for weeks must not accumulate (scripts/soak.py, docs/daemon.md).

After bursts of mixed requests, cancels included and clients that vanish mid-stream, the
worker's own tables (`stats` `tables`) return to their idle sizes, its thread and descriptor
counts to where they were, and every finished job has exactly one kept result. Counts only:
nothing here asserts on time, and on memory only what the worker reports it gave back when idle.
"""

from __future__ import annotations

import os
import subprocess
import sys

import msgpack
import numpy as np
import pytest
import zmq

from daemon_fixtures import make_daemon, tiny_pair, wait_until  # noqa: F401
import re

from helpers import load_script

from dflash.client.client import make_submit
from dflash.daemon import codec
from dflash.daemon.compute import IDLE_RELEASE_S
from dflash.daemon.queue import Job, JobQueue

IDLE_ZERO = ("watchers", "held", "waiting", "queue_jobs", "queue_heap", "events", "tasks", "store_jobs")


@pytest.fixture(scope="module")
def soak():
    return load_script("soak")


def _job(i: int) -> Job:
    return Job(job_id=f"j{i}", seq=i, request={"text": "p", "max_tokens": 4})


def _idle(c) -> dict:
    st = c.stats()
    return st["tables"] if st["queued"] == 0 and st["running"] is None else {}


def _wait_idle(c, what: str) -> dict:
    """The tables once every idle-zero one is 0 (a vanished client is noticed at a heartbeat)."""
    wait_until(lambda: (t := _idle(c)) and all(t[k] == 0 for k in IDLE_ZERO), timeout=60, what=what)
    return c.stats()


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _raw(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def _recv(sock: zmq.Socket) -> dict:
    assert sock.poll(30_000), "no reply"
    return msgpack.unpackb(sock.recv(), raw=False)


def _send_submit(sock: zmq.Socket, prompt: str, max_tokens: int) -> None:
    sub = make_submit(prompt, max_tokens=max_tokens)
    sub.rid = 1
    sock.send(codec.encode(sub))


# ------------------------------------------------------------------------------ units
def test_cancelled_heap_entries_do_not_pile_up_behind_a_running_job():
    q = JobQueue(max_len=4)
    q.push(_job(0))
    assert q.pop(timeout=0).job_id == "j0"  # runs (and keeps running) while clients come and go
    for i in range(1, 1001):
        q.push(_job(i))
        q.cancel(f"j{i}")
        assert q.sizes()["heap"] <= 2 * q.sizes()["jobs"] + 65
    q.push(_job(2000))
    q.cancel("j2000")
    q.push(_job(2001))
    assert q.sizes() == {"jobs": 2, "heap": len(q._heap)} and q.queued_count() == 1
    nxt = q.pop(timeout=0)  # the compaction kept the live one, in order
    assert nxt is None or nxt.job_id == "j2001"


def test_snapshot_arrays_own_their_memory():
    """A snapshot copies the prefix out of the cache: a view would keep the cache's whole
    256-token buffer alive in L1, many times the bytes L1's budget counts."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from dflash.engine.prefix import take

    kv = KVCache()
    kv.update_and_fetch(mx.ones((1, 2, 10, 8)), mx.ones((1, 2, 10, 8)))
    snap = take([kv], object(), mx.zeros((1, 10, 5)), 10)
    st = snap.target[0]
    assert st["keys"].shape == (1, 2, 10, 8) and kv.keys.shape[2] > 10  # the cache preallocates
    for arr, live in ((st["keys"], kv.keys), (st["values"], kv.values)):
        assert not np.shares_memory(np.asarray(arr), np.asarray(live))


def test_verdict_tells_growth_from_a_step(soak):
    def series(values):
        return [{"requests": 100 * i, "procs": {"worker": {"fds": v, "threads": 5, "rss_kb": 1000}},
                 "tables": {"watchers": 0}, "cache": {}, "l1": {}, "files": {}} for i, v in enumerate(values)]

    assert soak.verdict(series([30, 34, 34, 34, 34, 34, 34, 34]), warmup=100)["leak_free"]
    assert soak.verdict(series([30, 30, 30, 30, 37, 37, 37, 37]), warmup=100)["leak_free"]  # one step
    v = soak.verdict(series([30, 31, 32, 33, 34, 35, 36, 37]), warmup=100)
    assert v["grows"] == ["worker.fds"] and v["metrics"]["worker.fds"]["per_100_requests"] == pytest.approx(1.0)


# ------------------------------------------------------------------------------ a real daemon
def test_tables_return_to_idle_after_cancels_and_vanished_clients(make_daemon):  # noqa: F811
    d = make_daemon(heartbeat_s=0.2)
    with d.client(timeout=30) as c:
        # a snapshot over 64 KiB starts the L2 writer thread and pyzmq's zero-copy sender thread
        c.generate("warm up " * 60, max_tokens=4)
        base = _wait_idle(c, "idle after the warm-up")
        pid = base["pid"]
        fds0 = _fds(pid)
        threads0 = base["tables"]["threads"]

        long = c.submit("a long detached job that keeps the queue busy", max_tokens=4000)
        wait_until(lambda: c.stats()["running"] == long.job_id, what="the long job running")
        # streamed jobs behind it whose clients go away while they are queued: a closed socket,
        # a Stream closed after its accepted, and a client process killed outright
        for _ in range(3):
            sock = _raw(d.endpoint)
            _send_submit(sock, "gone while queued", 64)
            assert _recv(sock)["type"] == "accepted"
            sock.close(0)
        for i in range(100):  # detached jobs queued and cancelled while the long one runs
            c.submit(f"cancelled while queued {i}", max_tokens=8).cancel()
        t = c.stats()["tables"]
        assert t["queue_heap"] <= 2 * t["queue_jobs"] + 64  # cancelled entries are compacted away
        c.cancel(long.job_id)

        # running jobs whose clients vanish mid-stream, and streams cancelled by the client
        for i in range(3):
            s = c.stream(f"cancelled mid-stream {i}", max_tokens=400)
            next(iter(s))
            s.close()
        proc = subprocess.Popen([sys.executable, "-m", "dflash.client.cli", "--endpoint", d.endpoint, "prompt",
                                 "--max-tokens", "400", "killed mid-stream"], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)
        assert proc.stdout.read(1)  # it is streaming
        proc.kill()
        proc.wait()
        proc.stdout.close()
        sock = _raw(d.endpoint)
        _send_submit(sock, "socket closed mid-stream", 400)
        while _recv(sock)["type"] != "delta":
            pass
        sock.close(0)

        # malformed frames, control calls and a cache clear on the way
        for frame in (b"\xc1", msgpack.packb([1]), msgpack.packb({"v": 3, "op": "nope", "rid": 2})):
            sock = _raw(d.endpoint)
            sock.send(frame)
            assert _recv(sock)["type"] == "error"
            sock.close(0)
        assert c.clear_cache(timeout=30)["l2_up"]
        c.generate("one more after it all", max_tokens=4)

        st = _wait_idle(c, "every table back to idle")
        t = st["tables"]
        assert st["held"] == 0 and st["clients_gone"] >= 5
        wait_until(lambda: c.stats()["tables"]["threads"] == threads0, what="the worker's threads back")
        wait_until(lambda: _fds(pid) <= fds0, what="the worker's descriptors back")
        # every finished job keeps exactly one result (for result_retention_s), and nothing else
        finished = st["jobs_done"] + st["jobs_failed"] + st["jobs_cancelled"]
        assert t["store_results"] == finished and t["store_rows"] == finished + 1  # + the seq counter


def test_soak_mix_leaves_the_tables_idle(make_daemon, soak):  # noqa: F811
    """The soak script's own mix, from three threads at once: the tables end idle."""
    d = make_daemon(heartbeat_s=0.2, l1_cache_entries=4)
    load = soak.Load(d, seed=3, max_tokens=12,
                     kinds=[k for k in soak.MIX if k != "process_killed"])  # covered above
    with d.client(timeout=30) as c:
        soak.run_batch(load, 60, threads=3)
        assert not load.errors, load.errors
        assert sum(load.outcomes.values()) == 60
        st = _wait_idle(c, "every table back to idle")
        finished = st["jobs_done"] + st["jobs_failed"] + st["jobs_cancelled"]
        assert st["tables"]["store_results"] == finished
        assert st["cache"]["l1"]["entries"] <= 4


def _glibc() -> bool:
    try:
        return sys.platform.startswith("linux") and (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError):
        return False


def _idle_releases(d) -> list[tuple[float, bool]]:
    """(MiB given back, whether malloc_trim ran) for each idle release the worker logged."""
    return [(float(m.group(1)), bool(m.group(2))) for m in
            re.finditer(r"idle: gave ([0-9.]+) MiB back to the OS \(MLX's cached buffers(, malloc_trim)?\)", d.logs())]


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="the worker measures its RSS in /proc")
def test_an_idle_worker_gives_its_free_heap_back(make_daemon):  # noqa: F811
    """Once idle IDLE_RELEASE_S, the worker returns MLX's cached buffers and (glibc) the free pages
    of malloc's arenas, which otherwise stay resident and crept ~0.2 MiB per 100 soak requests;
    it does so again after each busy spell, and the next jobs answer exactly as before."""
    d = make_daemon(heartbeat_s=0.2)
    prompts = [f"Question {i}: " + "tell me about the tide and the sea. " * (4 + 3 * i) for i in range(8)]
    with d.client(timeout=30) as c:
        first = [c.generate(p, max_tokens=16, cache="bypass").text for p in prompts]
        _wait_idle(c, "idle after the first burst")
        wait_until(lambda: _idle_releases(d), timeout=IDLE_RELEASE_S + 30, what="the first idle release")
        again = [c.generate(p, max_tokens=16, cache="bypass").text for p in prompts]
        _wait_idle(c, "idle after the second burst")
        wait_until(lambda: len(_idle_releases(d)) >= 2, timeout=IDLE_RELEASE_S + 30, what="a second idle release")
    assert again == first  # greedy: the trimmed heap changed nothing
    for mib, trimmed in _idle_releases(d)[:2]:
        assert mib >= 1.0  # logged at INFO only from 1 MiB on
        assert trimmed == _glibc()
