"""`dflashd start` twice at the same instant with `cache = false`, with real `dflashd start`
processes, a real daemon on the tiny model and real ZeroMQ sockets.

Proves: the start claim holds with the cache off. The claim was `<cache_dir>/dflashd.lock`, and
with no cache there was none: two starts of the same daemon both passed the checks (with an
ipc:// endpoint the loser could then take the winner's socket) and each started a supervisor,
the second of which exited 3 on `supervisor.lock` ("dflashd exited with 3"). Now
`dflashd start` locks `<runtime_dir>/start.lock` before its checks and hands it to the
supervisor, so exactly one starts and the other is refused at once (exit 1, "already running
or starting", naming the lock and its holder), having started nothing; the claim dies with the
supervisor (kill -9 included), so a later start is not refused by a stale lock.

The race is made certain as in test_start_race_s49: each supervisor waits SLOW_S before it runs.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest
from daemon_fixtures import tiny_pair, two_dirs, wait_locks_gone  # noqa: F401
from test_start_race_s49 import _args, _start_at_once, _stop, slow_supervisors  # noqa: F401

from dflash.client import DFlashClient
from dflash.daemon.supervisor import live_pid, lock_held

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux: /proc")
NO_CACHE = {"DFLASH_CACHE": "false"}


def test_one_daemon_without_cache_started_twice_at_once_starts_once(tiny_pair, two_dirs,  # noqa: F811
                                                                    slow_supervisors):
    d = two_dirs[0]
    env = {**NO_CACHE, **slow_supervisors}
    run, lock = d / "run", d / "run" / "start.lock"
    endpoint = f"ipc://{run / 'worker.sock'}"
    try:
        results = _start_at_once(_args(d, tiny_pair), _args(d, tiny_pair), env=env)
        codes = sorted(r.returncode for r in results)
        assert codes == [0, 1], [(r.returncode, r.stderr) for r in results]
        won = next(r for r in results if r.returncode == 0)
        lost = next(r for r in results if r.returncode == 1)
        sup = live_pid(run)
        assert sup is not None and f"(supervisor {sup}," in won.stdout, won.stdout
        # refused at the claim, while the winner's `dflashd start` or supervisor held it
        assert lost.stdout == ""
        lines = lost.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            f"Error: dflashd is already running or starting at {endpoint} (pid "), lost.stderr
        assert lines[0].endswith(f" holds {lock})"), lost.stderr
        log = (d / "state" / "logs" / "dflashd.log").read_text()
        assert "another supervisor holds" not in log, log  # no second supervisor was started
        assert log.count("started worker pid") == 1, log  # and the winner's worker was not stopped
        with DFlashClient(endpoint, timeout=10) as c:
            st = c.stats()
        assert st["state"] == "ready" and st["l2_cache"] == "off"
        assert not (d / "state" / "cache").exists()  # the cache stayed off: no cache_dir claim
        assert lock_held(lock)
        assert json.loads(lock.read_text()) == {"endpoint": endpoint, "runtime_dir": str(run), "supervisor_pid": sup}
        # the claim dies with the supervisor, even by kill -9 (its worker dies by its lifeline)
        os.kill(sup, signal.SIGKILL)
        wait_locks_gone([lock, run / "worker.lock"], d / "state" / "logs" / "dflashd.log")
        again = _start_at_once(_args(d, tiny_pair), env=NO_CACHE)[0]
        assert again.returncode == 0, again.stderr
        assert live_pid(run) not in (None, sup) and lock_held(lock)
    finally:
        _stop(d, **NO_CACHE)
