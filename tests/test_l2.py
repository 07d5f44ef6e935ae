"""The cache process: real process, real ipc socket, real diskcache directory.

Proves: it never imports MLX; put/get/delete/positions over the wire; entries survive a restart;
corrupt and truncated entries are dropped, never served; the byte budget holds with LRU culling;
kill -9 in the middle of a large write loses no other entry; a full disk fails writes softly;
bad frames do not stop it; the client answers misses quickly while it is down and reconnects.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from dflash.cache import snapshot
from dflash.cache.client import CacheClient
from dflash.cache.l2 import start_cache_process
from dflash.cache.positions import PositionStore


class CacheProc:
    """A cache process on a short ipc path, restartable on the same directory."""

    def __init__(self, directory: Path, size_limit: int = 1 << 30, **popen_kwargs):
        self.sock_dir = tempfile.mkdtemp(prefix="dfc", dir="/tmp")  # ipc paths must be short
        self.endpoint = f"ipc://{self.sock_dir}/l2.sock"
        self.directory = directory
        self.size_limit = size_limit
        self.popen_kwargs = popen_kwargs
        self.proc: subprocess.Popen | None = None

    def start(self) -> "CacheProc":
        self.proc = start_cache_process(
            self.directory, self.endpoint, self.size_limit, **self.popen_kwargs
        )
        probe = self.client(retry_after_s=0.0)
        deadline = time.monotonic() + 20
        while not probe.ping():
            assert self.proc.poll() is None, "cache process exited at start-up"
            assert time.monotonic() < deadline, "cache process did not answer"
            time.sleep(0.05)
        probe.close()
        return self

    def client(self, **kwargs) -> CacheClient:
        kwargs.setdefault("retry_after_s", 0.05)
        return CacheClient(self.endpoint, **kwargs)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.sock_dir, ignore_errors=True)


@pytest.fixture
def cache_proc(tmp_path):
    procs: list[CacheProc] = []

    def make(**kwargs) -> CacheProc:
        p = CacheProc(tmp_path / f"l2-{len(procs)}", **kwargs)
        procs.append(p)
        return p.start()

    yield make
    for p in procs:
        p.cleanup()


def blob(seed: int, size: int) -> bytes:
    """A valid snapshot envelope of about `size` bytes, bound to key(seed)."""
    return snapshot.encode({"n_tokens": seed, "pad": bytes([seed % 256]) * size}, key(seed))


def key(i: int) -> str:
    return f"snap:{i:040x}"


def test_cache_process_never_imports_mlx():
    code = "import sys, dflash.cache.l2, dflash.cache.tiers; print('mlx' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_roundtrip_positions_and_restart(cache_proc):
    proc = cache_proc()
    c = proc.client()
    assert c.put(key(1), blob(1, 100), wait=True)
    assert c.put(key(2), blob(2, 100_000), wait=True)  # stored as a file by diskcache
    assert c.get_first([key(9), key(2), key(1)]) == (key(2), blob(2, 100_000))
    assert c.get_first([key(9)]) is None
    pos = PositionStore(c)
    assert pos.put("doc-a", [0, 1, 2, 50, 51]) and pos.put("doc-b", [7])
    assert pos.get("doc-a") == [0, 1, 2, 50, 51]
    assert pos.list() == ["doc-a", "doc-b"]
    assert pos.delete("doc-b") and not pos.delete("doc-b") and pos.get("doc-b") is None
    assert not c.put(key(3), b"not a snapshot", wait=True)  # refused, never stored
    c.close()

    proc.stop()
    proc.start()
    c = proc.client()
    assert c.get_first([key(1)]) == (key(1), blob(1, 100))
    assert c.get_first([key(2)]) == (key(2), blob(2, 100_000))
    assert PositionStore(c).get("doc-a") == [0, 1, 2, 50, 51]
    assert c.stats()["entries"] == 2
    c.close()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_entries_are_dropped(cache_proc, damage):
    proc = cache_proc()
    c = proc.client()
    for i in range(3):
        assert c.put(key(i), blob(i, 60_000), wait=True)
    files = sorted((proc.directory / "snapshots").rglob("*.val"), key=os.path.getmtime)
    assert len(files) == 3
    victim = files[1]  # the second write: key(1)
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
    else:
        data = data[: len(data) - 1000]
    victim.write_bytes(bytes(data))

    assert c.get_first([key(1)]) is None  # detected, not served
    assert c.stats()["corrupt_dropped"] == 1
    assert c.stats()["entries"] == 2  # and deleted
    assert c.get_first([key(1), key(0)]) == (key(0), blob(0, 60_000))  # falls to the next key
    assert c.get_first([key(2)]) == (key(2), blob(2, 60_000))
    c.close()


def test_byte_budget_lru(cache_proc):
    limit = 2_000_000
    proc = cache_proc(size_limit=limit)
    c = proc.client()
    for i in range(30):
        assert c.put(key(i), blob(i, 150_000), wait=True)
        if i >= 5:
            assert c.get_first([key(0)]) is not None  # key 0 stays the most recently used
        st = c.stats()
        assert st["bytes"] <= limit + 200_000, st  # at most one entry over, culled next write
    st = c.stats()
    assert st["evictions"] > 0 and st["entries"] < 30
    assert c.get_first([key(0)]) is not None  # recently used: kept
    assert c.get_first([key(1)]) is None  # least recently used: culled
    assert c.get_first([key(29)]) is not None
    c.close()


def test_kill9_mid_write_loses_no_other_entry(cache_proc):
    proc = cache_proc()
    c = proc.client()
    for i in range(20):
        assert c.put(key(i), blob(i, 50_000 if i % 2 else 1_000), wait=True)
    snaps = proc.directory / "snapshots"
    before = set(snaps.rglob("*.val"))
    big = blob(99, 48 << 20)
    assert c.put(key(99), big)  # write-behind: no reply awaited
    deadline = time.monotonic() + 10
    while not (set(snaps.rglob("*.val")) - before) and time.monotonic() < deadline:
        time.sleep(0.001)
    proc.kill9()  # as soon as the big file appears (or the write is done)
    c.close()

    proc.start()
    c = proc.client()
    for i in range(20):
        assert c.get_first([key(i)]) == (key(i), blob(i, 50_000 if i % 2 else 1_000)), i
    got = c.get_first([key(99)])
    assert got is None or got[1] == big  # never half of it
    c.close()


def test_full_disk_fails_writes_softly(cache_proc):
    def small_files():  # the child sees "file too large" (EFBIG) past 1 MiB, like a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    proc = cache_proc(preexec_fn=small_files)
    c = proc.client()
    assert c.put(key(1), blob(1, 1_000), wait=True)
    assert not c.put(key(2), blob(2, 3 << 20), wait=True)  # refused, process lives on
    assert proc.proc.poll() is None
    assert c.stats()["write_errors"] == 1
    assert c.get_first([key(1)]) == (key(1), blob(1, 1_000))
    assert c.get_first([key(2)]) is None
    assert c.put(key(3), blob(3, 2_000), wait=True)
    c.close()


def test_bad_frames_get_error_replies(cache_proc):
    proc = cache_proc()
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(proc.endpoint)
    try:
        for frames in (
            [b"\xc1garbage"],
            [msgpack.packb([1, 2])],
            [msgpack.packb({"op": "nope", "id": 1})],
            [msgpack.packb({"op": "get", "keys": "x", "id": 2})],
            [msgpack.packb({"op": "pos_put", "name": "a", "positions": [-1], "id": 3})],
        ):
            s.send_multipart(frames)
            assert s.poll(5000), "no reply"
            reply = msgpack.unpackb(s.recv_multipart()[0])
            assert reply["ok"] is False and reply["code"] == "bad_request"
    finally:
        s.close(0)
        ctx.term()
    c = proc.client()
    assert c.ping() and c.stats()["bad_requests"] == 5
    c.close()


def test_client_misses_fast_while_down_then_reconnects(cache_proc):
    proc = cache_proc()
    c = proc.client(timeout_s=1.0, retry_after_s=0.2)
    assert c.put(key(1), blob(1, 1_000), wait=True)
    proc.kill9()
    t = time.monotonic()
    for _ in range(20):
        assert c.get_first([key(1)]) is None
        assert not c.put(key(2), blob(2, 1_000))
    assert time.monotonic() - t < 2.0  # no call blocked for long
    proc.start()
    deadline = time.monotonic() + 10
    while c.get_first([key(1)]) is None:
        assert time.monotonic() < deadline, "client did not reconnect"
        time.sleep(0.05)
    c.close()
