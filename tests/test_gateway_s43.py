"""The gateway while the worker restarts (session 43): a request sent during the supervisor's
restart backoff waits for the worker and is served (docs/gateway.md, "When the daemon fails"),
/health answers 503 "restarting" meanwhile, and a daemon that is gone is still answered 503 at
once. Real daemon (supervisor + worker) and real `dflash serve --attach` processes, tiny model."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from daemon_fixtures import make_daemon, tiny_pair, wait_until  # noqa: F401
from test_gateway import KEY, MSGS, Gateway, _error

from dflash.daemon import supervisor

CHAT = "/v1/chat/completions"
BACKOFF_S = 4.0  # well over the control client's 2 s, which was the whole wait before


def _worker_entry(d) -> dict:
    return supervisor.read_state(d.cfg.runtime_path()).get("children", {}).get("worker", {})


def test_a_request_during_the_restart_backoff_is_served(make_daemon):  # noqa: F811
    d = make_daemon(restart_backoff_s=BACKOFF_S)
    run_dir = d.cfg.runtime_path()
    with Gateway(d, "--api-key", KEY) as g:
        assert supervisor.worker_state(run_dir, d.endpoint) == "running"
        assert supervisor.worker_state(run_dir, "tcp://127.0.0.1:1") == "gone"  # another daemon's endpoint
        status, _, body = g.http("GET", "/health", key=None)
        assert status == 200, body
        pid = d.worker_pid()
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: _worker_entry(d).get("pid") is None, 10, "the supervisor to reap the worker")
        assert supervisor.worker_state(run_dir, d.endpoint) == "restarting"
        # No request went through the gateway yet, so its model check asks the daemon, finds no
        # worker, and (before) answered 503 unavailable after 2 s, well inside the backoff.
        with ThreadPoolExecutor(1) as pool:
            chat = pool.submit(g.http, "POST", CHAT, {"messages": MSGS, "max_tokens": 4})
            status, _, body = g.http("GET", "/health", key=None)  # meanwhile a probe is told, not kept waiting
            assert status == 503, body
            assert b'"worker": "restarting"' in body, body
            status, _, body = chat.result()
        assert status == 200, body
        assert d.worker_pid() != pid  # served by the restarted worker
        assert _worker_entry(d)["restarts"] == 1
        status, _, body = g.http("GET", "/health", key=None)
        assert status == 200, body
    assert "restarting it: waiting" in (d.dir / next(p.name for p in d.dir.glob("gateway-*.log"))).read_text()


def stop_whole_daemon(d) -> None:
    """SIGTERM to the daemon's process group: stopped, not restarting (the supervisor goes too),
    and its supervisor.json then reads "gone"."""
    os.killpg(d.proc.pid, signal.SIGTERM)
    try:
        d.proc.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the daemon did not stop in 60 s; its log:\n{d.logs()[-3000:]}")
    assert supervisor.worker_state(d.cfg.runtime_path(), d.endpoint) == "gone"


def test_a_daemon_that_is_gone_is_answered_at_once(make_daemon):  # noqa: F811
    d = make_daemon(restart_backoff_s=BACKOFF_S)
    with Gateway(d, "--api-key", KEY) as g:
        stop_whole_daemon(d)
        for method, path, body in (("POST", CHAT, {"messages": MSGS, "max_tokens": 4}), ("GET", "/v1/models", None),
                                   ("GET", "/health", None)):
            start = time.monotonic()
            status, _, raw = g.http(method, path, body)
            took = time.monotonic() - start
            assert status == 503, raw
            if path == "/health":
                assert b'"worker": "unavailable"' in raw, raw
            else:
                assert _error(status, raw)["code"] == "unavailable"
            assert took < 10, f"{path} took {took:.1f}s to say the daemon is gone"  # not the 30 s restart wait
