"""The supervisor: keeps the worker and the cache process (L2, when `cache` is on) running.

It spawns the worker as `python -m dflash.daemon.worker --config-json ...` and the cache process
as `python -m dflash.cache.l2 --dir ... --endpoint ...`, restarts one that dies with exponential
backoff (reset once a child has stayed up for a minute), and stops when the worker exits 0 (a
requested shutdown) or a child reports a configuration error (2, 3: restarting won't help; a
cache process that cannot start leaves the worker serving with L1 only). One exception: a cache
process that exits 3 (another cache process holds its cache_dir) is started again with the same
backoff (up to restart_backoff_max_s), so it takes the folder over once the other one stops;
until then its reason, with "retrying", is what `dflashd status` shows.
While it runs with `cache` on, the supervisor also holds `dflashd.lock` in the cache_dir, which
names its endpoint and runtime_dir (`claim_owner`): a second daemon given the same cache_dir
is refused at `dflashd start` with that name instead of serving without its L2. `dflashd start`
takes that lock itself before its checks and hands it over (`--claim-fd`), so of two
daemons started at the same instant only one can pass them (`claim_daemon`). With `cache` off
the claim is `start.lock` in the runtime_dir instead (`claim_file`): the same daemon started
twice at once is refused just the same, before either start touches the other's sockets.
A child that exits on an error it can name (a bad config, an unusable cache_dir, a model that
failed to load under `exit_on_load_failure`) logs it and writes it, one line, to the file named
in $DFLASH_EXIT_REASON_FILE (`<runtime dir>/<child>.exit-reason`, `write_exit_reason`); the
supervisor keeps it as the child's `last_error` in supervisor.json, for `dflashd start` and
`dflashd status` to show, until a later start of that child has stayed up SETTLED_S.
SIGTERM/SIGINT only set a flag; the loop forwards SIGTERM to the children and waits for them.
`dflashd start` runs this detached; `dflashd start --foreground` (launchd/systemd) attached.

Children run under a lifeline (`python -m dflash.daemon.lifeline MODULE ARGS`, lifeline.py): they
stop when the supervisor dies, even by kill -9.
The supervisor holds `supervisor.lock` in the runtime dir for its whole life, so its state files
(`supervisor.pid`, `supervisor.json`) count only while that lock is held: files left by a dead
supervisor are stale, whatever process now has its pid (`live_pid`, `stop_orphans`).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from . import lifeline, paths
from .config import DaemonConfig

log = logging.getLogger("dflash.supervisor")
FATAL_CODES = (2, 3)  # bad config, another worker (or supervisor) running (a Child's retry_codes excepted)
STABLE_S = 60.0
SETTLED_S = 5.0  # a child up this long got past its start-up checks: its predecessor's reason is stale
REASON_ENV = "DFLASH_EXIT_REASON_FILE"
LOCK, PID_FILE, STATE_FILE = "supervisor.lock", "supervisor.pid", "supervisor.json"
CACHE_OWNER = "dflashd.lock"  # in the cache_dir: held by the supervisor whose cache process uses it
START_OWNER = "start.lock"  # in the runtime_dir: the claim of a daemon with the cache off (claim_file)
RETRYING = "retrying until it is free"


@dataclass
class Child:
    name: str
    module: str
    proc: subprocess.Popen | None = None
    restarts: int = 0
    failures_in_row: int = 0
    started_at: float = 0.0
    next_start: float = 0.0
    done: bool = False
    last_rc: int | None = None
    last_error: str | None = None  # the reason the last run gave for exiting (write_exit_reason)
    extra_env: dict = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    lock: Path | None = None  # the file the child holds locked while it runs
    retry_codes: tuple = ()  # exit codes in FATAL_CODES this child is restarted after anyway


def _children(cfg: DaemonConfig) -> list[Child]:
    children = [Child("worker", "dflash.daemon.worker", args=["--config-json", cfg.to_json()],
                      lock=cfg.runtime_path() / "worker.lock")]
    if cfg.cache:  # started alongside; the worker serves L1-only whenever it is down
        children.append(Child("cache", "dflash.cache.l2", args=cfg.cache_args(), extra_env={"DFLASH_CACHE_LOG": "INFO"},
                              lock=cfg.cache_path() / "l2.lock", retry_codes=(3,)))
    return children


class Supervisor:
    def __init__(self, cfg: DaemonConfig, claim: IO[str] | None = None):
        self.cfg = cfg
        self.claim = claim  # claim_file(cfg) as `dflashd start` claimed it (None: claim it here)
        self.stop = threading.Event()
        self.children = _children(cfg)
        self.run_dir = paths.private_dir(cfg.runtime_path())
        self._lifeline = -1  # read end of the pipe each child gets as stdin (lifeline.py)

    def _spawn(self, child: Child) -> None:
        reason = reason_path(self.run_dir, child.name)
        reason.unlink(missing_ok=True)  # whatever is there after this run is this run's
        env = dict(os.environ, DFLASH_WORKER_RESTARTS=str(child.restarts), **child.extra_env,
                   **{lifeline.ENV: str(os.getpid()), REASON_ENV: str(reason)})
        cmd = [sys.executable, "-m", "dflash.daemon.lifeline", child.module, *child.args]
        child.proc = subprocess.Popen(cmd, env=env, stdin=self._lifeline)
        child.started_at = time.monotonic()
        log.info("started %s pid %d (restart %d)", child.name, child.proc.pid, child.restarts)
        self._write_state()

    def _write_state(self) -> None:
        state = {
            "supervisor_pid": os.getpid(),
            "endpoint": self.cfg.resolved_endpoint(),  # which daemon this is (worker_state)
            "children": {
                c.name: {"pid": c.proc.pid if c.proc else None, "restarts": c.restarts, "last_rc": c.last_rc,
                         "last_error": c.last_error, "done": c.done}
                for c in self.children
            },
        }
        tmp = self.run_dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.run_dir / STATE_FILE)

    def _reap(self, child: Child) -> None:
        rc = child.proc.poll() if child.proc else None
        if child.proc is None or rc is None:
            return
        child.last_rc, child.proc = rc, None
        child.last_error = read_exit_reason(reason_path(self.run_dir, child.name))  # the child logged it
        if rc in child.retry_codes:  # e.g. another cache process holds the cache_dir: wait it out
            child.last_error = f"{child.last_error or f'exited with {rc}'}; {RETRYING}"
        elif rc in FATAL_CODES or (rc == 0 and child.name == "worker"):
            log.info("%s exited with %d; not restarting", child.name, rc)
            child.done = True
            self._write_state()
            if child.name == "worker":
                self.stop.set()  # a requested shutdown (or a fatal config) ends the daemon
            return
        uptime = time.monotonic() - child.started_at
        child.failures_in_row = 1 if uptime > STABLE_S else child.failures_in_row + 1
        delay = restart_delay(self.cfg, child.failures_in_row)
        child.restarts += 1
        child.next_start = time.monotonic() + delay
        log.warning("%s died (rc %d) after %.1fs; restarting in %.1fs", child.name, rc, uptime, delay)
        self._write_state()

    def _settle(self, child: Child) -> None:
        """Forget the reason a child's last run gave once its new run has stayed up."""
        if child.last_error and child.proc is not None and time.monotonic() - child.started_at >= SETTLED_S:
            child.last_error = None
            self._write_state()

    def run(self) -> int:
        lock = _take_lock(self.run_dir / LOCK)
        if lock is None:
            log.error("another supervisor holds %s", self.run_dir / LOCK)
            return 3
        (self.run_dir / PID_FILE).write_text(str(os.getpid()))
        owner = self._own_claim()
        self._write_state()  # replaces any state a dead supervisor left
        # Only this process holds the write end (not inherited): its death closes the pipe.
        self._lifeline, keep = os.pipe()
        try:
            while not self.stop.is_set():
                for child in self.children:
                    self._reap(child)
                    self._settle(child)
                    if not child.done and child.proc is None and time.monotonic() >= child.next_start:
                        self._spawn(child)
                self.stop.wait(0.1)
        finally:
            self._stop_children()
            for name in (PID_FILE, STATE_FILE):
                (self.run_dir / name).unlink(missing_ok=True)
            os.close(keep)
            os.close(self._lifeline)
            if owner is not None:
                owner.close()
            lock.close()
        worker = self.children[0]
        return worker.last_rc if worker.last_rc in FATAL_CODES else 0

    def _own_claim(self) -> IO[str] | None:
        """claim_file(cfg), held with this daemon's name in it (None: a folder that cannot be made
        (the cache process reports why), or another daemon's supervisor holds the cache_dir: its
        cache process is then the one that waits)."""
        try:
            return claim_daemon(self.cfg, self.claim)
        except OSError:
            return None

    def _stop_children(self, grace_s: float = 20.0) -> None:
        live = [c for c in self.children if c.proc is not None and c.proc.poll() is None]
        for c in live:
            c.proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + grace_s
        for c in live:
            try:
                c.proc.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs; killing it", c.name, grace_s)
                c.proc.kill()
                c.proc.wait()
            c.last_rc = c.proc.returncode


def claim_file(cfg: DaemonConfig) -> Path:
    """The lock a daemon's supervisor holds for its whole life, taken by `dflashd start` before its
    checks: `dflashd.lock` in the cache_dir (it also keeps a second daemon off that folder), or,
    with the cache off, `start.lock` in the runtime_dir (there was no claim then, and two starts
    of the same daemon at once both passed the checks)."""
    return cfg.cache_path() / CACHE_OWNER if cfg.cache else cfg.runtime_path() / START_OWNER


def claim_daemon(cfg: DaemonConfig, held: IO[str] | None = None, wait_s: float = 0.5) -> IO[str] | None:
    """Lock claim_file(cfg) (exclusive) and write this daemon's name into it: the open file, to
    keep for the daemon's whole life (the kernel drops the lock when its last holder dies: no
    stale claims), or None when another process holds it. `held` is a claim taken earlier (by
    `dflashd start`, inherited): it is ours already and gets this process's pid. Retries for
    `wait_s`: a `lock_held` probe (`dflashd status`, a start) holds it for an instant. Raises
    OSError for a folder or file that cannot be made."""
    if held is None:
        path = claim_file(cfg)
        if cfg.cache:
            path.parent.mkdir(parents=True, exist_ok=True)
        else:  # the runtime_dir, made private as the supervisor makes it (its parents too)
            paths.private_dir(path.parent)
        held = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o600), "r+")
    end = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a no-op on an inherited claim
            break
        except OSError:
            if time.monotonic() >= end:
                held.close()  # nothing written: the holder's name stays as it wrote it
                return None
            time.sleep(0.05)
    held.seek(0)
    held.truncate(0)
    held.write(json.dumps({"endpoint": cfg.resolved_endpoint(), "runtime_dir": str(cfg.runtime_path()),
                           "supervisor_pid": os.getpid()}))
    held.flush()
    return held


def reason_path(run_dir: Path, name: str) -> Path:
    """Where the child `name` leaves the reason it exited for (see the module docstring)."""
    return run_dir / f"{name}.exit-reason"


def write_exit_reason(reason: str) -> None:
    """In a supervised child about to exit on an error a restart won't fix (or must wait out):
    leave the reason, one line, for the supervisor to record and the user to see."""
    path = os.environ.get(REASON_ENV)
    if not path:
        return  # not started by a supervisor (a launchd agent, a shell): the log has it
    try:
        Path(path).write_text(" ".join(reason.split()) + "\n")
    except OSError:
        pass


def read_exit_reason(path: Path, since: float = 0.0) -> str | None:
    """The reason left in `path` (None when there is none, or it was written before `since`)."""
    try:
        if path.stat().st_mtime < since:
            return None
        return path.read_text(errors="replace").strip() or None
    except OSError:
        return None


def _take_lock(path: Path, wait_s: float = 2.0):
    """The open, exclusively locked file, or None when another process holds it (waits a little:
    a `dflashd status` may be probing it at this very moment)."""
    f = open(path, "w")
    end = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return f
        except OSError:
            if time.monotonic() >= end:
                f.close()
                return None
            time.sleep(0.05)


def restart_delay(cfg: DaemonConfig, failures_in_row: int) -> float:
    """Seconds before a child's next start: restart_backoff_s doubled per failure in a row, up to
    restart_backoff_max_s. The doublings are capped: a child that keeps failing fast (a cache
    process waiting for its folder, a full disk) reached 2 ** 1024 after ~1,000 restarts, an
    OverflowError that stopped the whole daemon."""
    doublings = min(max(failures_in_row - 1, 0), 60)
    return min(cfg.restart_backoff_s * 2 ** doublings, cfg.restart_backoff_max_s)


def lock_held(path: Path) -> bool:
    """Whether some process holds `path` locked (the lock dies with its holder, unlike pid files)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)  # also drops the probe's own lock


def claim_owner(path: Path) -> dict | None:
    """The daemon whose supervisor holds the claim `path` (claim_daemon: {"endpoint", "runtime_dir",
    "supervisor_pid"}; {} when one holds it but its name cannot be read), None when none does."""
    if not lock_held(path):
        return None
    try:
        owner = json.loads(path.read_text())
        return owner if isinstance(owner, dict) else {}
    except (OSError, ValueError):
        return {}


def live_pid(run_dir: Path) -> int | None:
    """The running supervisor's pid; None when none runs (its pid file, if any, is stale)."""
    if not lock_held(run_dir / LOCK):
        return None
    try:
        return int((run_dir / PID_FILE).read_text())
    except (OSError, ValueError):
        return None


def read_state(run_dir: Path) -> dict:
    """supervisor.json as written (by a live or a dead supervisor; compare supervisor_pid)."""
    try:
        state = json.loads((run_dir / STATE_FILE).read_text())
        return state if isinstance(state, dict) else {}
    except (OSError, ValueError):
        return {}


def child_state(run_dir: Path, sup_pid: int | None, name: str, endpoint: str | None = None) -> dict:
    """The supervisor `sup_pid`'s entry for its child `name` in supervisor.json ({}: none, the
    file is a dead predecessor's, or it serves another `endpoint` than the one given)."""
    state = read_state(run_dir)
    children = state.get("children") if isinstance(state.get("children"), dict) else {}
    if not sup_pid or state.get("supervisor_pid") != sup_pid:
        return {}
    if endpoint is not None and state.get("endpoint") != endpoint:
        return {}
    child = children.get(name)
    return child if isinstance(child, dict) else {}


def child_error(run_dir: Path, sup_pid: int | None, name: str, endpoint: str | None = None) -> str | None:
    """The reason the supervisor `sup_pid`'s child `name` gave when it last exited (None: none,
    or no such supervisor running): what `dflashd status`, and `dflash-client cache show` on the
    daemon's machine, add to an "L2 DOWN" line."""
    error = child_state(run_dir, sup_pid, name, endpoint).get("last_error")
    return error if isinstance(error, str) and error else None


def worker_state(run_dir: Path, endpoint: str) -> str:
    """What the live supervisor in `run_dir` says of the worker serving `endpoint`: "running" (a
    worker process runs: it may be loading, or just died and is not reaped yet), "restarting" (none
    runs now; the supervisor starts one when its backoff ends), or "gone" (no live supervisor for
    that endpoint, or one that will not start the worker again). A client that got no answer waits
    for a worker that is "running" or "restarting" and gives up on one that is "gone"."""
    sup_pid = live_pid(run_dir)
    state = read_state(run_dir)
    worker = state.get("children", {}).get("worker") if isinstance(state.get("children"), dict) else None
    if sup_pid is None or state.get("supervisor_pid") != sup_pid or state.get("endpoint") != endpoint \
            or not isinstance(worker, dict) or worker.get("done"):
        return "gone"
    return "restarting" if worker.get("pid") is None else "running"


def stop_orphans(cfg: DaemonConfig, grace_s: float = 20.0) -> list[str]:
    """When no supervisor runs: stop the children a dead one left running (listed in its stale
    state, still holding their locks, still running our module), remove its stale files, and
    say what was stopped. A child without a lifeline (an older version's) is what this finds."""
    run_dir = cfg.runtime_path()
    if live_pid(run_dir) is not None:
        return []
    pids = {name: c.get("pid") for name, c in read_state(run_dir).get("children", {}).items() if isinstance(c, dict)}
    found = [(c, pids[c.name]) for c in _children(cfg) if isinstance(pids.get(c.name), int) and c.lock is not None
             and lock_held(c.lock) and c.module in _command_line(pids[c.name])]
    for _, pid in found:
        _signal(pid, signal.SIGTERM)
    end = time.monotonic() + grace_s
    while any(lock_held(c.lock) for c, _ in found) and time.monotonic() < end:
        time.sleep(0.1)
    killed = [(c, pid) for c, pid in found if lock_held(c.lock)]
    for _, pid in killed:
        _signal(pid, signal.SIGKILL)
    # a killed process lets go of its locks and sockets only as it dies: `dflashd start` checks
    # them next (a socket or cache_dir still held would be refused as another daemon's)
    end = time.monotonic() + 5.0
    while any(lock_held(c.lock) for c, _ in killed) and time.monotonic() < end:
        time.sleep(0.05)
    for name in (PID_FILE, STATE_FILE):
        (run_dir / name).unlink(missing_ok=True)
    return [f"{c.name} pid {pid}" for c, pid in found]


def _command_line(pid: int) -> str:
    """The command line of a process ("" when it is gone), to check a pid is still ours."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        pass
    try:  # macOS: no /proc
        out = subprocess.run(["ps", "-o", "command=", "-p", str(pid)], capture_output=True, text=True, timeout=5)
        return out.stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def run_attached(cfg: DaemonConfig, claim: IO[str] | None = None) -> tuple[int, str | None]:
    """Run a supervisor in this process until it stops: its exit code and, when a fatal exit of
    the worker ended it, the worker's reason (`dflashd start --foreground` prints it).
    `claim`: claim_file(cfg) as `dflashd start` claimed it (claim_daemon)."""
    paths.private_umask()  # its files, and (inherited) its children's
    logging.basicConfig(level=logging.INFO, format="%(asctime)s supervisor[%(process)d] %(levelname)s %(message)s")
    sup = Supervisor(cfg, claim)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: sup.stop.set())
    rc = sup.run()
    return rc, sup.children[0].last_error if rc else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dflash.daemon.supervisor")
    ap.add_argument("--config-json", required=True)
    ap.add_argument("--claim-fd", type=int, default=None,
                    help="an inherited fd of the daemon's claim (claim_file), taken by `dflashd start`")
    args = ap.parse_args(argv)
    claim = None
    if args.claim_fd is not None:
        os.set_inheritable(args.claim_fd, False)  # the supervisor's alone, not its children's
        claim = os.fdopen(args.claim_fd, "r+")
    return run_attached(DaemonConfig.from_json(args.config_json), claim)[0]


if __name__ == "__main__":
    sys.exit(main())
