"""Supervised children end when their supervisor ends, however it ends (kill -9 included).

Without this, a supervisor killed hard leaves its worker and cache process running unsupervised,
holding their locks, and the next `dflashd start` cannot take over. The supervisor gives each
child the read end of a pipe as stdin and its own pid in $DFLASH_SUPERVISOR_PID; only the
supervisor holds the write end, so when it dies the kernel closes it and the child reads EOF
(Linux and macOS alike). On Linux, PR_SET_PDEATHSIG sends SIGTERM at once as well. An orphan
stops the way SIGTERM stops it (the worker re-queues its running job), and exits hard if that
takes longer than GRACE_S. A child started without a supervisor (a launchd agent, a shell) has
no lifeline.

`python -m dflash.daemon.lifeline MODULE ARGS...` runs MODULE as __main__ under a lifeline: how
the supervisor starts children that know nothing of it (the cache process).
"""

from __future__ import annotations

import ctypes
import logging
import os
import runpy
import signal
import stat
import sys
import threading
import time

ENV = "DFLASH_SUPERVISOR_PID"
GRACE_S = 30.0
_PR_SET_PDEATHSIG = 1
_held = False
log = logging.getLogger("dflash.lifeline")


def hold() -> None:
    """In a supervised child: end this process when the supervisor is gone (idempotent; the
    worker calls it again after a re-exec, which drops threads)."""
    global _held
    sup = os.environ.get(ENV, "")
    if _held or not sup.isdigit() or not _stdin_is_pipe():
        return
    _held = True
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the pipe still works
    threading.Thread(target=_watch, args=(int(sup),), name="dflash-lifeline", daemon=True).start()


def _stdin_is_pipe() -> bool:
    try:
        return stat.S_ISFIFO(os.fstat(0).st_mode)
    except OSError:
        return False


def _watch(sup_pid: int) -> None:
    try:
        while os.read(0, 512):  # the supervisor never writes: only EOF (its death) ends this
            pass
    except OSError:
        pass
    log.warning("supervisor %d is gone; stopping", sup_pid)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    log.error("still running %.0fs after the supervisor died; exiting", GRACE_S)
    os._exit(70)


def run_module(argv: list[str]) -> None:
    """Hold the lifeline, then run argv[0] as `python -m argv[0] argv[1:]` would."""
    sys.argv = list(argv)
    hold()
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    from dflash.daemon.lifeline import run_module as _run  # the package's module: one `_held`

    _run(sys.argv[1:])
