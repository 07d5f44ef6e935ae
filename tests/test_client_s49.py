"""Client hardening, session 49: what a daily user of DFlashClient / AsyncDFlashClient hits when
the endpoint is not the daemon they think (real daemons on tiny models, real ZeroMQ sockets).

A client whose handshake the peer refused (a CURVE daemon and a client without its keys, or
another ZeroMQ service on the port) used to block forever in its second send, past every
timeout: ZeroMQ drops such a connection for good, and a DEALER with no connection blocks in
send(). The calls run in a child process here, so a hang fails the test instead of the run.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import zmq
import zmq.auth
from daemon_fixtures import ROOT, Daemon, tiny_pair  # noqa: F401

from dflash.client import DFlashClient, WorkerUnavailableError

# Every call the child makes: sync and async, a request/answer op and a stream.
CHILD = textwrap.dedent("""
    import asyncio, json, sys, time
    from dflash.client import AsyncDFlashClient, DFlashClient, DFlashError
    from dflash.daemon.config import DaemonConfig
    endpoint, cfg = sys.argv[1], DaemonConfig(**json.loads(sys.argv[2]))
    kw = dict(config=cfg, timeout=4, retry_interval=float(sys.argv[3]))

    def run(name, call):
        t = time.monotonic()
        try:
            call()
            out = {"error": None}
        except DFlashError as e:
            out = {"error": type(e).__name__, "text": str(e)}
        print(json.dumps({"call": name, "s": time.monotonic() - t, **out}), flush=True)

    with DFlashClient(endpoint, **kw) as c:
        run("stats", c.stats)
        run("generate", lambda: c.generate("hi", max_tokens=3))
        run("stream", lambda: list(c.stream("hi", max_tokens=3)))

    async def main():
        async with AsyncDFlashClient(endpoint, **kw) as a:
            loop = asyncio.get_running_loop()
            for name, make in (("async stats", a.stats), ("async generate", lambda: a.generate("hi", max_tokens=3))):
                t = time.monotonic()
                try:
                    await make()
                    out = {"error": None}
                except DFlashError as e:
                    out = {"error": type(e).__name__, "text": str(e)}
                print(json.dumps({"call": name, "s": time.monotonic() - t, **out}), flush=True)
    asyncio.run(main())
""")
CALLS = ["stats", "generate", "stream", "async stats", "async generate"]


def child_calls(endpoint: str, cfg: dict, limit_s: float = 30.0, retry_interval: float = 0.5) -> list[dict]:
    """Run CHILD against `endpoint`; its one JSON line per call. A child still running after
    `limit_s` (a call that hung) fails the test, naming the calls that did end."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, endpoint, json.dumps(cfg), str(retry_interval)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"a client call hung past {limit_s}s (its timeout was 4s); ended: {out!r}")
    assert proc.returncode == 0, err
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["call"] for r in rows] == CALLS, out
    return rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_refused(rows: list[dict], endpoint: str) -> None:
    """Each call ended within its timeout as WorkerUnavailableError: ZeroMQ takes the peer's
    refusal now as a refused handshake (the connection dropped for good, where the old client
    hung; said so at the next re-send), now as a lost connection (re-tried: no answer in time)."""
    for r in rows:
        assert r["error"] == "WorkerUnavailableError", r
        assert r["s"] < 4.5, r
        assert endpoint in r["text"], r
        if "no dflash worker answered" not in r["text"]:
            assert "refused this client's ZeroMQ handshake" in r["text"] and "CURVE" in r["text"], r


@pytest.fixture(scope="module")
def curve_daemon(tiny_pair, tmp_path_factory):  # noqa: F811
    """A real daemon on a tcp loopback port with CURVE on, as docs/daemon.md sets one up."""
    keys = tmp_path_factory.mktemp("keys")
    public, secret = zmq.auth.create_certificates(str(keys), "server")
    d = Daemon(*tiny_pair, endpoint=f"tcp://127.0.0.1:{free_port()}",
               curve_server_secret=secret, curve_server_public=public)
    try:
        yield d.start()
    finally:
        d.stop()


def test_a_client_without_the_curve_keys_is_told_at_once_not_left_hanging(curve_daemon):
    with curve_daemon.client(timeout=10) as c:  # with the keys: served
        assert c.generate("hi", max_tokens=3).finish_reason == "length"
    for _ in range(3):
        assert_refused(child_calls(curve_daemon.endpoint, {}), curve_daemon.endpoint)
    with curve_daemon.client(timeout=10) as c:  # and the daemon serves on
        assert c.stats()["state"] == "ready"


@pytest.mark.parametrize("kind", ["PUB", "PAIR", "REQ"])
def test_another_zeromq_service_on_the_endpoint_is_named_not_waited_on_forever(kind):
    ctx = zmq.Context()
    try:
        other = ctx.socket(getattr(zmq, kind))
        other.setsockopt(zmq.LINGER, 0)
        endpoint = f"tcp://127.0.0.1:{other.bind_to_random_port('tcp://127.0.0.1')}"
        assert_refused(child_calls(endpoint, {}), endpoint)
    finally:
        ctx.destroy(0)


def test_no_daemon_at_all_still_waits_the_timeout_and_says_so(tmp_path):
    """Not a refusal: nothing to talk to yet (the daemon may be starting), so the client waits
    its whole timeout and names `dflashd start`, as before."""
    endpoint = f"ipc://{tmp_path}/none.sock"
    with DFlashClient(endpoint, timeout=1.5, retry_interval=0.3) as c:
        t = time.monotonic()
        with pytest.raises(WorkerUnavailableError, match="is `dflashd start` running"):
            c.stats()
        assert 1.4 < time.monotonic() - t < 4
    assert os.listdir(tmp_path) == []


def test_a_quick_retry_interval_with_no_daemon_ends_at_its_timeout(tmp_path):
    """retry_interval=0.001 re-sends every millisecond: past ZeroMQ's 1000 queued frames (the
    daemon down or restarting) the old client's send blocked for good; now it waits its timeout."""
    endpoint = f"ipc://{tmp_path}/none.sock"
    for r in child_calls(endpoint, {}, retry_interval=0.001):
        assert r["error"] == "WorkerUnavailableError" and "no dflash worker answered" in r["text"], r
        assert 3.9 < r["s"] < 4.5, r
