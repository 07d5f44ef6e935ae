"""The supervisor: keeps the worker and the cache process (L2, when `cache` is on) running.

It spawns the worker as `python -m dflash.daemon.worker --config-json ...` and the cache process
as `python -m dflash.cache.l2 --dir ... --endpoint ...`, restarts one that dies with exponential
backoff (reset once a child has stayed up for a minute), and stops when the worker exits 0 (a
requested shutdown) or a child reports a configuration error (2, 3: restarting won't help; a
cache process that cannot start leaves the worker serving with L1 only).
SIGTERM/SIGINT only set a flag; the loop forwards SIGTERM to the children and waits for them.
`dflashd start` runs this detached; `dflashd start --foreground` (launchd/systemd) attached.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from . import paths
from .config import DaemonConfig

log = logging.getLogger("dflash.supervisor")
FATAL_CODES = (2, 3)  # bad config, another worker running
STABLE_S = 60.0


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
    extra_env: dict = field(default_factory=dict)
    args: list[str] = field(default_factory=list)


class Supervisor:
    def __init__(self, cfg: DaemonConfig):
        self.cfg = cfg
        self.stop = threading.Event()
        self.children = [Child("worker", "dflash.daemon.worker", args=["--config-json", cfg.to_json()])]
        if cfg.cache:  # started alongside; the worker serves L1-only whenever it is down
            self.children.append(Child("cache", "dflash.cache.l2", args=cfg.cache_args(),
                                       extra_env={"DFLASH_CACHE_LOG": "INFO"}))
        self.run_dir = paths.private_dir(cfg.runtime_path())

    def _spawn(self, child: Child) -> None:
        env = dict(os.environ, DFLASH_WORKER_RESTARTS=str(child.restarts), **child.extra_env)
        cmd = [sys.executable, "-m", child.module, *child.args]
        child.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
        child.started_at = time.monotonic()
        log.info("started %s pid %d (restart %d)", child.name, child.proc.pid, child.restarts)
        self._write_state()

    def _write_state(self) -> None:
        state = {
            "supervisor_pid": os.getpid(),
            "children": {
                c.name: {"pid": c.proc.pid if c.proc else None, "restarts": c.restarts, "last_rc": c.last_rc}
                for c in self.children
            },
        }
        tmp = self.run_dir / "supervisor.json.tmp"
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.run_dir / "supervisor.json")

    def _reap(self, child: Child) -> None:
        rc = child.proc.poll() if child.proc else None
        if child.proc is None or rc is None:
            return
        child.last_rc, child.proc = rc, None
        if rc in FATAL_CODES or (rc == 0 and child.name == "worker"):
            log.info("%s exited with %d; not restarting", child.name, rc)
            child.done = True
            if child.name == "worker":
                self.stop.set()  # a requested shutdown (or a fatal config) ends the daemon
            return
        uptime = time.monotonic() - child.started_at
        child.failures_in_row = 1 if uptime > STABLE_S else child.failures_in_row + 1
        delay = min(self.cfg.restart_backoff_s * 2 ** (child.failures_in_row - 1), self.cfg.restart_backoff_max_s)
        child.restarts += 1
        child.next_start = time.monotonic() + delay
        log.warning("%s died (rc %d) after %.1fs; restarting in %.1fs", child.name, rc, uptime, delay)
        self._write_state()

    def run(self) -> int:
        (self.run_dir / "supervisor.pid").write_text(str(os.getpid()))
        try:
            while not self.stop.is_set():
                for child in self.children:
                    self._reap(child)
                    if not child.done and child.proc is None and time.monotonic() >= child.next_start:
                        self._spawn(child)
                self.stop.wait(0.1)
        finally:
            self._stop_children()
            for name in ("supervisor.pid", "supervisor.json"):
                (self.run_dir / name).unlink(missing_ok=True)
        worker = self.children[0]
        return worker.last_rc if worker.last_rc in FATAL_CODES else 0

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dflash.daemon.supervisor")
    ap.add_argument("--config-json", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s supervisor[%(process)d] %(levelname)s %(message)s")
    sup = Supervisor(DaemonConfig.from_json(args.config_json))
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: sup.stop.set())
    return sup.run()


if __name__ == "__main__":
    sys.exit(main())
