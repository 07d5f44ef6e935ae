"""Clearing the prefix cache (`cache_clear`, DFlashClient.clear_cache, `dflash-client cache clear`):
real supervisor, worker and cache process, real ipc sockets and diskcache, a tiny real model.
Both tiers are emptied, position lists kept, output unchanged, and a clear while a job decodes
neither changes that job's tokens nor leaves its snapshots behind (its queued L2 writes too)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import msgpack
import pytest
import zmq
from daemon_fixtures import PROMPTS, ROOT, make_daemon, reference, running, tiny_pair, wait_until  # noqa: F401

from dflash.client import (
    AsyncDFlashClient,
    BadRequestError,
    CacheUnavailableError,
    DFlashClient,
    WorkerGoneError,
    WorkerUnavailableError,
)
from dflash.client.client import older_worker
from dflash.daemon import codec
from dflash.daemon import protocol as P

LONG = PROMPTS[3] + " " + " ".join(PROMPTS[4:8])  # several snapshot boundaries (every 16 tokens)


@pytest.fixture(scope="module")
def daemon(tiny_pair):  # noqa: F811
    yield from running(tiny_pair, cache_every=16)


@pytest.fixture
def client(daemon):
    with daemon.client(timeout=30) as c:
        yield c


def _cli(endpoint: str, *args: str, timeout: str = "30") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash.client.cli", "--endpoint", endpoint, "--timeout", timeout,
                           *args], capture_output=True, text=True, timeout=90, cwd=ROOT)


def _answer(endpoint: str, msg: dict) -> tuple[dict, int]:
    """A raw request's answer (as a foreign client sees it) and the heartbeats that came first."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    beats = 0
    try:
        sock.connect(endpoint)
        sock.send(msgpack.packb(msg))
        while sock.poll(10_000):
            reply = msgpack.unpackb(sock.recv())
            if reply["type"] != "heartbeat":
                return reply, beats
            beats += 1
        raise AssertionError("no answer")
    finally:
        sock.close(0)
        ctx.term()


def _tiers(client: DFlashClient) -> tuple[int, int, int, int]:
    """(L1 entries, L1 bytes, L2 entries, L2 bytes) from the worker's stats."""
    c = client.stats()["cache"]
    return c["l1"]["entries"], c["l1"]["bytes"], c["l2"]["entries"], c["l2"]["bytes"]


def _empty(client: DFlashClient) -> bool:
    """Whether both tiers hold no snapshot (an empty L2 store still has its sqlite pages)."""
    l1_entries, l1_bytes, l2_entries, _ = _tiers(client)
    return (l1_entries, l1_bytes, l2_entries) == (0, 0, 0)


def _fill(client: DFlashClient, prompt: str, max_tokens: int = 12) -> list[int]:
    """Run `prompt` twice (the second restores it whole) and wait until L2 holds its snapshots."""
    cold = client.generate(prompt, max_tokens=max_tokens)
    warm = client.generate(prompt, max_tokens=max_tokens)
    assert warm.token_ids == cold.token_ids and warm.stats["cached_prompt_tokens"] == warm.stats["prompt_tokens"]
    wait_until(lambda: _tiers(client)[2] >= 2, what="write-through to L2")
    return cold.token_ids


def test_clear_empties_both_tiers_keeps_position_lists_and_output(client, tiny_pair):  # noqa: F811
    client.put_positions("keep-me", [0, 1, 2, 5])
    _, ref = reference(tiny_pair, LONG, 12)
    assert _fill(client, LONG) == ref
    l1_entries, l1_bytes, l2_entries, l2_bytes = _tiers(client)
    assert l1_entries >= 2 and l1_bytes > 0 and l2_bytes > 0

    got = client.clear_cache()
    assert got["l1"] == {"entries": l1_entries, "bytes": l1_bytes}
    assert got["l2"]["entries"] == l2_entries and got["l2_up"] is True and got["position_lists"] >= 1
    assert _tiers(client) == (0, 0, 0, l2_bytes - got["l2"]["bytes"])  # an empty store's sqlite pages
    assert client.get_positions("keep-me") == [0, 1, 2, 5] and client.stats()["cache"]["position_lists"] >= 1

    again = client.generate(LONG, max_tokens=12)  # lossless, and computed from scratch
    assert again.token_ids == ref and again.stats["cached_prompt_tokens"] == 0
    hit = client.generate(LONG, max_tokens=12)  # the cache works on after a clear
    assert hit.token_ids == ref and hit.stats["cached_prompt_tokens"] == hit.stats["prompt_tokens"]

    empty = client.clear_cache()
    assert client.clear_cache() == {**empty, "l1": {"entries": 0, "bytes": 0}, "l2": {"entries": 0, "bytes": 0}}


def test_clear_while_a_job_decodes(daemon, client, tiny_pair):  # noqa: F811
    prompt = PROMPTS[1] + " " + PROMPTS[2]
    _, ref = reference(tiny_pair, prompt, 200)
    answers: list[dict] = []
    with daemon.client(timeout=30) as other, client.stream(prompt, max_tokens=200) as stream:
        ids = list(next(stream).token_ids)  # decoding has begun: the prefill's snapshots are taken
        clearer = threading.Thread(target=lambda: answers.append(other.clear_cache()))
        clearer.start()
        for delta in stream:
            ids += delta.token_ids
        clearer.join(60)
    assert ids == stream.result.token_ids == ref  # the running job is untouched
    assert answers and answers[0]["l2_up"] and answers[0]["l1"]["entries"] >= 1
    # this job's snapshots, its queued writes to L2 included, went with the clear
    assert _empty(client)
    after = client.generate(prompt, max_tokens=200)
    assert after.token_ids == ref and after.stats["cached_prompt_tokens"] == 0


def test_the_async_client_and_the_wire(daemon, client):
    client.generate(PROMPTS[0], max_tokens=4)

    async def go() -> dict:
        async with AsyncDFlashClient(daemon.endpoint, config=daemon.cfg, timeout=30) as a:
            return await a.clear_cache()

    got = asyncio.run(go())
    assert got["l1"]["entries"] >= 1 and got["l2_up"] and _tiers(client)[0] == 0
    reply, _ = _answer(daemon.endpoint, {"v": P.VERSION, "op": "cache_clear", "rid": 41})  # heartbeats may come first
    assert (reply["v"], reply["type"], reply["rid"]) == (P.VERSION, "info", 41)
    assert set(reply["data"]) == {"l1", "l2", "l2_up", "position_lists"}
    bad, beats = _answer(daemon.endpoint, {"v": P.VERSION, "op": "cache_clear", "rid": 42, "tier": "l1"})
    assert (bad["type"], bad["code"], bad["rid"], beats) == ("error", P.BAD_REQUEST, 42, 0)


def test_cli_cache_show_and_clear(daemon, client):
    client.put_positions("cli-keep", [3, 4])
    client.generate(PROMPTS[5], max_tokens=4)
    shown = _cli(daemon.endpoint, "cache")
    assert shown.returncode == 0, shown.stderr
    for words in ("cache L1", "cache L2", "cache snapshots", "cache L2 budget", "position lists",
                  "cache dropped", "cache L1 vs L2", "lost from both tiers"):
        assert words in shown.stdout, shown.stdout
    labels = [line[:18] for line in shown.stdout.splitlines()]
    assert [line[:18] for line in _cli(daemon.endpoint, "cache", "show").stdout.splitlines()] == labels
    as_json = _cli(daemon.endpoint, "cache", "show", "--json")
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["enabled"] is True, as_json.stderr

    cleared = _cli(daemon.endpoint, "cache", "clear")
    assert cleared.returncode == 0 and not cleared.stderr, cleared.stderr
    lines = cleared.stdout.splitlines()
    assert [line.split()[0:2] for line in lines] == [["cleared", "L1"], ["cleared", "L2"], ["position", "lists"]]
    assert "0 entries" not in lines[0] and lines[2].endswith("kept"), cleared.stdout
    assert _empty(client) and client.get_positions("cli-keep") == [3, 4]
    again = _cli(daemon.endpoint, "cache", "clear", "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["l1"] == {"entries": 0, "bytes": 0}


def test_no_daemon_is_a_clear_error():
    endpoint = f"ipc://{tempfile.mkdtemp(prefix='dfx', dir='/tmp')}/none.sock"
    for args in (("cache", "clear"), ("cache",)):
        out = _cli(endpoint, *args, timeout="0.5")
        assert out.returncode == 3 and not out.stdout, (out.returncode, out.stdout)
        assert out.stderr.count("\n") == 1 and "no dflash worker answered" in out.stderr, out.stderr
    with DFlashClient(endpoint, timeout=0.5) as c, pytest.raises(WorkerUnavailableError):
        c.clear_cache()
    # an older daemon has no such op: said in words, not as a bare unknown op
    old = older_worker(BadRequestError(P.UNKNOWN_OP, "unknown op 'cache_clear'"), "cache_clear")
    assert isinstance(old, BadRequestError) and "older than this client" in old.message


def test_cache_process_down_clears_l1_and_says_l2_was_not(daemon, client):
    client.generate(PROMPTS[6], max_tokens=4)
    wait_until(lambda: _tiers(client)[2] >= 1, what="write-through to L2")
    pid = json.loads((daemon.dir / "run" / "supervisor.json").read_text())["children"]["cache"]["pid"]
    os.kill(pid, signal.SIGSTOP)  # hung: it answers nothing
    try:
        got = client.clear_cache()
        assert got["l2_up"] is False and got["l1"]["entries"] >= 1 and got["l2"] == {"entries": 0, "bytes": 0}
        out = _cli(daemon.endpoint, "cache", "clear")
        assert out.returncode == 1 and "cleared L1" in out.stdout and "cleared L2" not in out.stdout
        assert out.stderr.count("\n") == 1 and "not cleared" in out.stderr, out.stderr
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: client.clear_cache()["l2_up"], timeout=20, what="the cache process back")
    assert _empty(client)


def test_a_daemon_without_cache_refuses(make_daemon):  # noqa: F811
    d = make_daemon(cache=False)
    with d.client(timeout=10) as c, pytest.raises(CacheUnavailableError, match="nothing to clear"):
        c.clear_cache()
    out = _cli(d.endpoint, "cache", "clear")
    assert out.returncode == 1 and "cache = false" in out.stderr and out.stderr.count("\n") == 1
    shown = _cli(d.endpoint, "cache")
    assert shown.returncode == 0 and shown.stdout.split() == ["cache", "off"]


def _beating_worker(endpoint: str, beats: int, answer: bool, resent: list[bool]) -> threading.Thread:
    """A stand-in worker: takes one cache_clear, sends `beats` heartbeats 0.1 s apart (longer
    than the client's timeout and retry interval), notes whether the client re-sent, answers."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)

    def serve() -> None:
        try:
            ident, frame = router.recv_multipart()
            rid = codec.decode_request(frame).rid
            for _ in range(beats):
                router.send_multipart([ident, codec.encode(P.Heartbeat(rid=rid))])
                time.sleep(0.1)
            resent.append(bool(router.poll(0)))
            if answer:
                router.send_multipart([ident, codec.encode(P.Info(rid=rid, data={"l2_up": True}))])
                router.poll(500)
        finally:
            router.close(0)

    thread = threading.Thread(target=serve)
    thread.start()
    return thread


def test_the_client_waits_while_heartbeats_come_and_not_longer():
    home = tempfile.mkdtemp(prefix="dfb", dir="/tmp")
    resent: list[bool] = []
    served = _beating_worker(f"ipc://{home}/a.sock", 8, True, resent)
    with DFlashClient(f"ipc://{home}/a.sock", timeout=0.3, retry_interval=0.2, heartbeat_timeout=2.0) as c:
        assert c.clear_cache() == {"l2_up": True}
    served.join(10)
    assert resent == [False]  # heartbeats stopped the re-sends
    served = _beating_worker(f"ipc://{home}/b.sock", 2, False, resent)
    with DFlashClient(f"ipc://{home}/b.sock", timeout=0.3, retry_interval=0.2, heartbeat_timeout=0.5) as c:
        with pytest.raises(WorkerGoneError, match="stopped answering"):
            c.clear_cache()  # heartbeats, then silence: the worker died mid-clear
    served.join(10)
