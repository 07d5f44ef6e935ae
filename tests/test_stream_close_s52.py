"""Closing or dropping a sync Stream (session 52): a stream whose worker or daemon is gone returns
at once, and one dropped mid-job on a live daemon still cancels its job. Real daemons, sockets
and tiny models; no mocks.

Dropping a stream with a `break` out of its loop is covered by test_library_walkthrough's
test_breaking_out_of_a_stream_cancels_its_job_at_once; the drop test here keeps the stream's
socket open, so the job can end cancelled only by the Cancel that __del__ sends."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import time
from typing import Iterator

import pytest
from daemon_fixtures import PROMPTS, make_daemon, running, tiny_pair, wait_until  # noqa: F401

from dflash.client import WorkerGoneError

LONG = 8000  # tokens: far more than any of these tests lets the tiny model make


@pytest.fixture(scope="module")
def daemon(tiny_pair):  # noqa: F811
    yield from running(tiny_pair)


@contextlib.contextmanager
def _collector_off() -> Iterator[None]:
    """No garbage collection inside: a stream's __del__ runs at its `del`, not earlier or later."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_a_stream_dropped_mid_job_sends_its_cancel(daemon):
    """The job of a stream dropped unclosed ends cancelled, by the stream's own Cancel: its socket
    (the job's connection) is kept open here, so the worker cannot take a connection gone for it."""
    with daemon.client(timeout=10) as c:
        s = c.stream(PROMPTS[0], max_tokens=LONG)
        next(s)
        job_id, watcher = s.job_id, s._sock
        s._sock = None  # __del__ leaves it open: the job's deltas still have somewhere to go
        before = c.stats()["clients_gone"]
        try:
            with _collector_off():
                t0 = time.monotonic()
                del s  # the last reference: its __del__ runs here
                took = time.monotonic() - t0
            wait_until(lambda: c.status(job_id).state == "cancelled", 10, "the dropped stream's job to be cancelled")
            assert took < 1.0, took
            assert c.stats()["clients_gone"] == before  # cancelled by the Cancel, not by a connection gone
        finally:
            watcher.close(0)


def test_a_stream_that_saw_its_worker_gone_closes_at_once_and_keeps_its_job(daemon):
    """After WorkerGoneError the job is kept for the restarted worker: closing or dropping the
    stream sends no Cancel (which would drop that job) and waits for nothing."""
    with daemon.client(timeout=60, heartbeat_timeout=1.0) as c:
        s = c.stream(PROMPTS[1], max_tokens=LONG)
        next(s)
        os.kill(c.stats()["pid"], signal.SIGKILL)
        with pytest.raises(WorkerGoneError) as e:
            for _ in s:
                pass
        with _collector_off():
            t0 = time.monotonic()
            s.close()
            del s
            took = time.monotonic() - t0
        assert took < 0.1, took
        daemon.wait_ready()
        rows = {r["job_id"]: r for r in c.jobs()}
        assert rows.get(e.value.job_id, {}).get("state") in ("held", "queued", "running"), rows
        c.cancel(e.value.job_id)


def test_a_stream_dropped_after_its_daemon_died_returns_at_once(make_daemon):  # noqa: F811
    """A stream dropped mid-job after the whole daemon died (no answer ever comes, and the stream
    has not read the silence yet) blocked its caller for the Cancel's whole 2 s timeout."""
    d = make_daemon()
    c = d.client(timeout=10)
    s = c.stream(PROMPTS[2], max_tokens=LONG)
    next(s)
    os.killpg(d.proc.pid, signal.SIGKILL)
    d.proc.wait(10)
    with _collector_off():
        t0 = time.monotonic()
        del s  # the last reference: its __del__ runs here
        took = time.monotonic() - t0
    c.close()
    assert took < 1.0, f"dropping the stream blocked for {took:.2f}s"
