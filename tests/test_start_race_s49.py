"""`dflashd start` twice at the same instant, and abstract ipc endpoints (session 49), with real
`dflashd start` processes, real daemons on the tiny model, real cache processes and real ZeroMQ
sockets.

Proves: the start checks and the start are one claim. Two `dflashd start` run at once, given one
cache_dir, used to both pass the checks (the first supervisor took `dflashd.lock` only once it
ran); now `dflashd start` locks `<cache_dir>/dflashd.lock` before its checks and hands it to the
supervisor, so exactly one starts and the other is refused at once (exit 2 naming the first, or
exit 1 "already running or starting" for the same daemon started twice), having started nothing
and touched none of the first's sockets. The claim dies with the supervisor (kill -9 included):
no stale lock keeps the folder. An `ipc://@name` endpoint (Linux abstract socket, no file) that
another process serves is refused like a socket file (it was not checked: the worker's bind
failed and it kept crashing).

The races are made certain rather than likely: `slow_supervisors` makes each supervisor process
wait SLOW_S before it runs (a loaded machine), which the old check-then-start lost every time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
import zmq
from daemon_fixtures import ROOT, tiny_pair, two_dirs, wait_locks_gone, wait_until  # noqa: F401

from dflash.client import DFlashClient
from dflash.daemon.cli import ipc_in_use
from dflash.daemon.supervisor import live_pid, lock_held

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux: /proc, abstract sockets")
SLOW_S = 4.0
_SLOW_SITE = f"""
import time
try:
    with open("/proc/self/cmdline", "rb") as f:
        if b"dflash.daemon.supervisor" in f.read():
            time.sleep({SLOW_S})
except OSError:
    pass
"""


@pytest.fixture
def slow_supervisors(tmp_path) -> dict:
    """Env for `dflashd start`: each supervisor it starts sleeps SLOW_S first (a sitecustomize
    on PYTHONPATH), so both starts of a race are past their checks before either supervisor runs."""
    site = tmp_path / "slow-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SLOW_SITE)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}


def _args(d: Path, tiny_pair, *extra: str) -> list[str]:  # noqa: F811
    return [sys.executable, "-m", "dflash.daemon.cli", "start", "--model", tiny_pair[0], "--draft", tiny_pair[1],
            "--blas", "none", "--runtime-dir", str(d / "run"), "--state-dir", str(d / "state"), *extra]


def _start_at_once(*commands: list[str], env: dict) -> list[subprocess.CompletedProcess]:
    """Run the `dflashd start` commands at the same instant; their results, in order."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env={**os.environ, **env}) for c in commands]
    out = []
    for p, c in zip(procs, commands):
        stdout, stderr = p.communicate(timeout=180)
        out.append(subprocess.CompletedProcess(c, p.returncode, stdout, stderr))
    return out


def _stop(d: Path, **env: str) -> None:
    subprocess.run([sys.executable, "-m", "dflash.daemon.cli", "stop", "--runtime-dir", str(d / "run"),
                    "--state-dir", str(d / "state")], capture_output=True, timeout=120, cwd=ROOT,
                   env={**os.environ, **env})


def _l2(endpoint: str) -> str:
    with DFlashClient(endpoint, timeout=10) as c:
        return c.stats()["l2_cache"]


def test_two_starts_at_once_on_one_cache_dir_start_one_daemon(tiny_pair, two_dirs, tmp_path,  # noqa: F811
                                                              slow_supervisors):
    shared = tmp_path / "shared-cache"
    env = {"DFLASH_CACHE_DIR": str(shared), **slow_supervisors}
    try:
        results = _start_at_once(_args(two_dirs[0], tiny_pair), _args(two_dirs[1], tiny_pair), env=env)
        codes = [r.returncode for r in results]
        assert sorted(codes) == [0, 2], [(r.returncode, r.stderr) for r in results]
        won, lost = (0, 1) if codes[0] == 0 else (1, 0)
        w, l_ = two_dirs[won], two_dirs[lost]
        endpoint_w = f"ipc://{w / 'run' / 'worker.sock'}"
        assert results[lost].stdout == ""
        assert results[lost].stderr.strip().splitlines() == [  # at once: no model was loaded for it
            f"Error: cache_dir {shared} is in use by the daemon at {endpoint_w} (runtime_dir {w / 'run'}): two "
            "daemons cannot share one cache folder; set cache_dir (or DFLASH_CACHE_DIR) to another folder, "
            "or stop that daemon"]
        # nothing of the loser was started; the winner has its worker, its L2 and the claim
        assert not lock_held(l_ / "run" / "supervisor.lock")
        assert not (l_ / "run" / "worker.sock").exists() and not (l_ / "run" / "cache.sock").exists()
        assert not (l_ / "state" / "logs" / "dflashd.log").exists()
        assert _l2(endpoint_w) == "up"
        sup = live_pid(w / "run")
        assert sup is not None and lock_held(shared / "dflashd.lock")
        owner = json.loads((shared / "dflashd.lock").read_text())
        assert owner == {"endpoint": endpoint_w, "runtime_dir": str(w / "run"), "supervisor_pid": sup}
        # the claim dies with the supervisor, even by kill -9: no stale lock (the `dflashd start`
        # that took it and the children the supervisor started do not hold it)
        os.kill(sup, signal.SIGKILL)
        wait_locks_gone([shared / "dflashd.lock", shared / "l2.lock"], w / "state" / "logs" / "dflashd.log")
        again = _start_at_once(_args(l_, tiny_pair), env=env)[0]
        assert again.returncode == 0, again.stderr
        assert again.stderr == ""  # no "cache process (L2) stopped" warning
        assert _l2(f"ipc://{l_ / 'run' / 'worker.sock'}") == "up"
    finally:
        for d in two_dirs:
            _stop(d, **env)


def test_one_daemon_started_twice_at_once_starts_once(tiny_pair, two_dirs, slow_supervisors):  # noqa: F811
    """The same settings twice (two terminals, a service manager and a user): one daemon, and the
    other start says it is already running instead of starting a second supervisor that exits 3."""
    d = two_dirs[0]
    try:
        results = _start_at_once(_args(d, tiny_pair), _args(d, tiny_pair), env=slow_supervisors)
        codes = sorted(r.returncode for r in results)
        assert codes == [0, 1], [(r.returncode, r.stderr) for r in results]
        lost = next(r for r in results if r.returncode == 1)
        endpoint = f"ipc://{d / 'run' / 'worker.sock'}"
        assert lost.stderr.startswith(f"Error: dflashd is already running"), lost.stderr
        assert endpoint in lost.stderr and len(lost.stderr.strip().splitlines()) == 1, lost.stderr
        sup = live_pid(d / "run")
        log = (d / "state" / "logs" / "dflashd.log").read_text()
        assert "another supervisor holds" not in log, log  # no second supervisor was started
        with DFlashClient(endpoint, timeout=10) as c:
            st = c.stats()
        assert st["state"] == "ready" and st["l2_cache"] == "up"
        assert json.loads((d / "state" / "cache" / "dflashd.lock").read_text())["supervisor_pid"] == sup
    finally:
        _stop(d)


def test_an_abstract_endpoint_a_daemon_serves_is_refused_as_cache_endpoint(tiny_pair, two_dirs):  # noqa: F811
    """`ipc://@name`: ZeroMQ binds "\\0name" (no file), so the check for a socket file passed it: a
    second daemon given the first's (abstract) worker endpoint as its cache_endpoint started, and
    its cache process failed to bind (address in use), leaving it on L1 only."""
    a, b = two_dirs
    endpoint = f"ipc://@dflash-s49-{uuid.uuid4().hex[:12]}"
    assert ipc_in_use(endpoint) is None  # free
    try:
        first = _start_at_once(_args(a, tiny_pair, "--endpoint", endpoint), env={})[0]
        assert first.returncode == 0, first.stderr
        assert not (ROOT / endpoint[len("ipc://"):]).exists()  # no "@name" file in the working dir
        second = _start_at_once(_args(b, tiny_pair), env={"DFLASH_CACHE_ENDPOINT": endpoint})[0]
        assert second.returncode == 2, (second.stdout, second.stderr)
        assert second.stderr.strip().splitlines() == [
            f"Error: cache_endpoint {endpoint} cannot be used: another process (another daemon?) serves that "
            "socket; binding it again fails (address in use)"]
        assert not lock_held(b / "run" / "supervisor.lock")  # nothing of the second was started
        assert not lock_held(b / "state" / "cache" / "dflashd.lock")
        with DFlashClient(endpoint, timeout=10) as c:
            assert c.stats()["state"] == "ready"  # the first still serves it
    finally:
        _stop(a)
        _stop(b)
    wait_until(lambda: ipc_in_use(endpoint) is None, timeout=30, what="the abstract socket to be free")


def test_ipc_in_use_probes_an_abstract_socket_another_process_binds():
    """The probe itself, on a ZeroMQ socket bound in another process (not a daemon)."""
    endpoint = f"ipc://@dflash-s49-{uuid.uuid4().hex[:12]}"
    server = subprocess.Popen([sys.executable, "-c", (
        "import sys, zmq\n"
        "s = zmq.Context().socket(zmq.ROUTER)\n"
        f"s.bind({endpoint!r})\n"
        "print('bound', flush=True)\n"
        "sys.stdin.read()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "bound"
        assert ipc_in_use(endpoint) == ("another process (another daemon?) serves that socket; binding it again "
                                        "fails (address in use)")
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        with pytest.raises(zmq.ZMQError):  # what the second worker met
            sock.bind(endpoint)
        sock.close(0)
        ctx.term()
        # `dflashd start` given it as the worker endpoint: refused before anything is started
        with tempfile.TemporaryDirectory(prefix="dfr", dir="/tmp") as d:
            out = subprocess.run([sys.executable, "-m", "dflash.daemon.cli", "start", "--model", "/nonexistent",
                                  "--endpoint", endpoint, "--runtime-dir", f"{d}/run", "--state-dir", f"{d}/state"],
                                 capture_output=True, text=True, timeout=120, cwd=ROOT)
            assert out.returncode == 2, out.stderr
            assert out.stderr.strip().splitlines() == [
                f"Error: endpoint {endpoint} cannot be used: another process (another daemon?) serves that socket; "
                "binding it again fails (address in use)"]
            assert not lock_held(Path(d) / "run" / "supervisor.lock")
    finally:
        server.stdin.close()
        server.wait(10)
    assert ipc_in_use(endpoint) is None  # its process gone, the name is free again


def test_an_abstract_cache_endpoint_serves_the_l2(tiny_pair, two_dirs):  # noqa: F811
    """The cache process on `ipc://@name`: it made a folder and chmod-ed a file named after the
    endpoint ("@name" in its working directory), and the chmod of a file that is not there ended
    it (FileNotFoundError at every restart): the daemon served from L1 only."""
    a, _ = two_dirs
    cache_endpoint = f"ipc://@dflash-s49-cache-{uuid.uuid4().hex[:12]}"
    try:
        started = _start_at_once(_args(a, tiny_pair), env={"DFLASH_CACHE_ENDPOINT": cache_endpoint})[0]
        assert started.returncode == 0, started.stderr
        assert "L2" not in started.stderr  # no "cache process (L2) stopped" warning
        assert _l2(f"ipc://{a / 'run' / 'worker.sock'}") == "up"
        assert ipc_in_use(cache_endpoint) is not None  # the cache process serves the abstract socket
        assert not (ROOT / cache_endpoint[len("ipc://"):]).exists()
    finally:
        _stop(a)


def test_an_abstract_name_too_long_for_a_socket_address_is_refused():
    """The address-length check covers `ipc://@name` too (ZeroMQ counts the "@"): a name one byte
    too long was passed by the start checks, and the worker's bind failed at every restart."""
    from dflash.daemon.cli import ipc_problem

    limit = zmq.IPC_PATH_MAX_LEN
    fits, too_long = "ipc://@" + "a" * (limit - 1), "ipc://@" + "a" * limit
    assert ipc_problem(fits) is None
    assert ipc_problem(too_long) == (f"its path is {limit + 1} bytes, more than the {limit} a Unix socket's "
                                     "address holds (choose a shorter runtime_dir or endpoint)")
    ctx = zmq.Context()
    try:
        for endpoint, binds in ((fits, True), (too_long, False)):  # what the check stands for
            sock = ctx.socket(zmq.ROUTER)
            try:
                sock.bind(endpoint)
                assert binds
            except zmq.ZMQError:
                assert not binds
            finally:
                sock.close(0)
    finally:
        ctx.term()
