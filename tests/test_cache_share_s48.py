"""Two daemons on one machine that share a cache folder or a socket (session 48), with real
daemons on the tiny model, real cache processes, real ZeroMQ sockets and real diskcache folders.

Proves: a second `dflashd start` given a cache_dir a running daemon uses is refused (exit 2, one
line naming the folder, the other daemon and the setting to change) instead of starting a daemon
whose cache process exits 3 at once and that serves from L1 only for good; a second daemon that
got that far anyway (both started at once) retries its cache process and takes the folder over
once the first daemon stops, saying meanwhile on `dflashd status` and `dflash-client cache
show` why L2 is down; a second
daemon given a running daemon's cache_endpoint (an ipc:// path: ZeroMQ's second bind silently
takes the socket) is refused and the first daemon keeps its L2; `dflash-client cache show` prints
the cache process's missing_files count in its plain output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_fixtures import PROMPTS, ROOT, make_daemon, tiny_pair, two_dirs, wait_until  # noqa: F401
from test_l2 import blob, key

from dflash.cache.client import CacheClient
from dflash.client import DFlashClient
from dflash.daemon.config import DaemonConfig
from dflash.daemon.supervisor import lock_held, restart_delay


def _dflashd(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash.daemon.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **env}, cwd=ROOT)


def _flags(d: Path, tiny_pair) -> list[str]:  # noqa: F811
    return ["--model", tiny_pair[0], "--draft", tiny_pair[1], "--blas", "none",
            "--runtime-dir", str(d / "run"), "--state-dir", str(d / "state")]


def _dirs(d: Path) -> list[str]:
    return ["--runtime-dir", str(d / "run"), "--state-dir", str(d / "state")]


def _l2(endpoint: str) -> str:
    with DFlashClient(endpoint, timeout=10) as c:
        return c.stats()["l2_cache"]


def test_second_daemon_on_one_cache_dir_is_refused_naming_the_first(tiny_pair, two_dirs, tmp_path):  # noqa: F811
    a, b = two_dirs
    shared = tmp_path / "shared-cache"
    env = {"DFLASH_CACHE_DIR": str(shared)}
    try:
        first = _dflashd("start", *_flags(a, tiny_pair), **env)
        assert first.returncode == 0, first.stderr
        endpoint_a = f"ipc://{a / 'run' / 'worker.sock'}"
        second = _dflashd("start", *_flags(b, tiny_pair), **env)
        assert second.returncode == 2, (second.stdout, second.stderr)
        assert second.stderr.strip().splitlines() == [
            f"Error: cache_dir {shared} is in use by the daemon at {endpoint_a} (runtime_dir {a / 'run'}): two "
            "daemons cannot share one cache folder; set cache_dir (or DFLASH_CACHE_DIR) to another folder, "
            "or stop that daemon"]
        assert not lock_held(b / "run" / "supervisor.lock")  # nothing of the second was started
        assert not (b / "run" / "worker.sock").exists()
        assert _l2(endpoint_a) == "up"  # the first keeps its L2
    finally:
        _dflashd("stop", *_dirs(a), **env)
        _dflashd("stop", *_dirs(b), **env)
    # once the first is stopped, the folder is free for the second
    try:
        again = _dflashd("start", *_flags(b, tiny_pair), **env)
        assert again.returncode == 0, again.stderr
        assert again.stderr == ""  # no "cache process (L2) stopped" warning
        assert _l2(f"ipc://{b / 'run' / 'worker.sock'}") == "up"
    finally:
        _dflashd("stop", *_dirs(b), **env)


def test_second_daemon_that_started_anyway_takes_l2_over_when_the_first_stops(make_daemon, tmp_path):  # noqa: F811
    """Both supervisors started at once (no `dflashd start` check between them): the loser's cache
    process exits 3, is retried with backoff, and serves once the folder is free."""
    shared = str(tmp_path / "shared-cache")
    first = make_daemon(cache_dir=shared)
    second = make_daemon(cache_dir=shared, restart_backoff_max_s=1.0)  # started directly, like a race
    assert _l2(first.endpoint) == "up" and _l2(second.endpoint) == "down"
    run_b = second.cfg.runtime_path()
    reason = f"another cache process holds {shared}; retrying until it is free"

    def cache_error() -> str | None:
        out = _dflashd("status", "--json", "--runtime-dir", str(run_b), "--state-dir", second.cfg.state_dir,
                       DFLASH_CACHE_DIR=shared)
        return json.loads(out.stdout)["cache_error"]

    wait_until(lambda: cache_error() == reason, timeout=30, what="the reason on status")
    status = _dflashd("status", "--runtime-dir", str(run_b), "--state-dir", second.cfg.state_dir,
                      DFLASH_CACHE_DIR=shared)
    line = next(x for x in status.stdout.splitlines() if x.split()[:2] == ["cache", "L2"])
    assert "L2 DOWN (serving from L1)" in line and line.endswith(f"; stopped: {reason}"), status.stdout
    show = subprocess.run([sys.executable, "-m", "dflash.client.cli", "cache", "show"], capture_output=True,
                          text=True, timeout=60, cwd=ROOT, env={**os.environ, "DFLASH_RUNTIME_DIR": str(run_b)})
    assert show.stdout.splitlines()[0].endswith(f"L2 DOWN (serving from L1) at {second.cfg.resolved_cache_endpoint()}"
                                                f"; stopped: {reason}"), show.stdout
    first.stop()
    wait_until(lambda: _l2(second.endpoint) == "up", timeout=30, what="the second daemon's L2")
    with second.client(timeout=30) as c:  # and it stores snapshots there now
        c.generate(PROMPTS[0], max_tokens=4)
    wait_until(lambda: cache_error() is None, timeout=30, what="the stale reason to clear")


def test_second_daemon_on_a_running_cache_endpoint_is_refused(tiny_pair, two_dirs, tmp_path):  # noqa: F811
    """ZeroMQ binds an ipc:// path by replacing the socket file: a second cache process bound to the
    first daemon's cache_endpoint took it silently (the first's worker then reached the second's
    store, or none)."""
    a, b = two_dirs
    cache_ep = f"ipc://{a}/l2.sock"
    try:
        first = _dflashd("start", *_flags(a, tiny_pair), DFLASH_CACHE_ENDPOINT=cache_ep,
                         DFLASH_CACHE_DIR=str(tmp_path / "cache-a"))
        assert first.returncode == 0, first.stderr
        inode = os.stat(f"{a}/l2.sock").st_ino
        second = _dflashd("start", *_flags(b, tiny_pair), DFLASH_CACHE_ENDPOINT=cache_ep,
                          DFLASH_CACHE_DIR=str(tmp_path / "cache-b"))
        assert second.returncode == 2, (second.stdout, second.stderr)
        assert second.stderr.strip().splitlines() == [
            f"Error: cache_endpoint {cache_ep} cannot be used: another process (another daemon?) serves that "
            "socket; binding it would take it from that process"]
        assert not lock_held(b / "run" / "supervisor.lock")
        assert os.stat(f"{a}/l2.sock").st_ino == inode  # the first daemon's socket was left alone
        probe = CacheClient(cache_ep, timeout_s=2.0)
        try:
            assert probe.ping()
        finally:
            probe.close()
        assert _l2(f"ipc://{a / 'run' / 'worker.sock'}") == "up"
        # the worker endpoint too: the first daemon's, given to a second through its own runtime_dir
        # (refused before the new check: `dflashd start` finds a daemon answering there, exit 1)
        third = _dflashd("start", *_flags(b, tiny_pair), "--endpoint", f"ipc://{a / 'run' / 'worker.sock'}",
                         DFLASH_CACHE_DIR=str(tmp_path / "cache-b"))
        assert third.returncode != 0 and not lock_held(b / "run" / "supervisor.lock"), third.stderr
    finally:
        _dflashd("stop", *_dirs(a), DFLASH_CACHE_ENDPOINT=cache_ep)
        _dflashd("stop", *_dirs(b), DFLASH_CACHE_ENDPOINT=cache_ep)


def test_cache_show_prints_missing_files(make_daemon, tmp_path):  # noqa: F811
    """An L2 entry whose value file was deleted outside dflash: `cache show` says so in words."""
    d = make_daemon(cache_dir=str(tmp_path / "cache"))
    l2 = CacheClient(d.cfg.resolved_cache_endpoint(), timeout_s=5.0)
    try:
        assert l2.put(key(7), blob(7, 100_000), wait=True)
        for f in (tmp_path / "cache").rglob("*.val"):
            f.unlink()
        assert l2.get_first([key(7)]) is None
    finally:
        l2.close()
    out = subprocess.run([sys.executable, "-m", "dflash.client.cli", "--endpoint", d.endpoint, "cache", "show"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("cache L2 process"))
    assert line.endswith(", 1 missing files"), line  # unrecorded_reads is 0: left out, as before
    shown = json.loads(subprocess.run([sys.executable, "-m", "dflash.client.cli", "--endpoint", d.endpoint, "cache",
                                       "show", "--json"], capture_output=True, text=True, timeout=60,
                                      cwd=ROOT).stdout)
    assert shown["l2_process"]["missing_files"] == 1


def test_the_restart_backoff_holds_after_thousands_of_fast_failures():
    """A cache process retried until its folder is free (or a full disk) fails fast for hours: the
    backoff doubled without limit and raised OverflowError at the 1,025th restart in a row, which
    stopped the supervisor and with it the healthy worker. It stays at restart_backoff_max_s."""
    cfg = DaemonConfig(restart_backoff_s=0.5, restart_backoff_max_s=30.0)
    assert [restart_delay(cfg, n) for n in (1, 2, 3)] == [0.5, 1.0, 2.0]
    assert restart_delay(cfg, 1_025) == restart_delay(cfg, 100_000) == 30.0
