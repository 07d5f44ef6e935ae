"""Start failures reach the user, with real processes, real ZeroMQ and the real tiny model: a
cache process (L2) that cannot use its cache_dir is reported by `dflashd start` (a warning: the
worker serves from L1) and on `dflashd status`'s cache line; `dflashd start --foreground` (a
service manager's view) exits 2 with the reason when the model fails to load, instead of
staying up in the failed state."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from daemon_fixtures import PROMPTS, tiny_pair  # noqa: F401

from dflash.client import DFlashClient
from dflash.daemon.supervisor import lock_held


@pytest.fixture
def dirs():
    d = Path(tempfile.mkdtemp(prefix="dfs", dir="/tmp"))  # short: ipc paths are capped
    yield ["--runtime-dir", str(d / "run"), "--state-dir", str(d / "state")], d
    shutil.rmtree(d, ignore_errors=True)


def _dflashd(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash.daemon.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **env})


def _nothing_running(d: Path, cache_dir: Path) -> None:
    for lock in (d / "run" / "supervisor.lock", d / "run" / "worker.lock", cache_dir / "l2.lock"):
        assert not lock_held(lock), f"{lock} is still held"


def test_unusable_cache_dir_is_reported_by_start_and_status(tiny_pair, dirs):  # noqa: F811
    flags, d = dirs
    (d / "a-file").write_text("not a directory")
    cache_dir = d / "a-file" / "cache"
    env = {"DFLASH_CACHE_DIR": str(cache_dir)}
    reason = f"cannot use {cache_dir} as the cache directory: Not a directory: {cache_dir}"
    try:
        out = _dflashd("start", "--model", tiny_pair[0], "--draft", tiny_pair[1], "--blas", "none", *flags, **env)
        assert out.returncode == 0, out.stderr
        assert "dflashd started" in out.stdout
        assert out.stderr.splitlines() == [f"warning: the cache process (L2) stopped: {reason}; serving from L1 only"]

        status = _dflashd("status", *flags, **env)
        cache_line = next(line for line in status.stdout.splitlines() if line.split()[:2] == ["cache", "L2"])
        assert "L2 DOWN (serving from L1)" in cache_line and cache_line.endswith(f"; stopped: {reason}")
        info = json.loads(_dflashd("status", "--json", *flags, **env).stdout)
        assert info["cache_error"] == reason and info["worker"]["l2_cache"] == "down"
        with DFlashClient(info["endpoint"], timeout=30) as c:  # the worker serves with L1 only
            assert len(c.generate(PROMPTS[0], max_tokens=4).token_ids) == 4
    finally:
        _dflashd("stop", *flags, **env)
    _nothing_running(d, cache_dir)


def test_foreground_exits_2_when_the_model_fails_to_load(dirs, tmp_path):
    """What systemd runs must fail, not idle in "failed" forever; nothing is left running."""
    flags, d = dirs
    missing = str(tmp_path / "missing")
    out = _dflashd("start", "--foreground", "--model", missing, "--draft", missing, "--blas", "none", *flags,
                   timeout=90)
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]  # after the supervisor's and the worker's log lines
    assert last.startswith("dflashd: the model failed to load: ModelNotFoundError: "), out.stderr
    assert "; exiting with 2 (exit_on_load_failure)" in out.stderr  # the worker's log says it too
    assert "worker exited with 2; not restarting" in out.stderr  # and the supervisor stopped
    _nothing_running(d, d / "state" / "cache")
    assert not (d / "run" / "supervisor.json").exists()
