"""The `dflash` command's entry point: the command line is imported (MLX, mlx-lm: 1-2 s) under a
Ctrl-C guard, so a Ctrl-C right after Enter says "cancelled" (exit 130), not a traceback; and
`stops_once`, which lets long commands take SIGTERM as they take Ctrl-C, once."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator


def main() -> None:
    try:
        from .cli import main as command
    except KeyboardInterrupt:
        sys.stderr.write("cancelled\n")
        sys.exit(130)
    command()


@contextlib.contextmanager
def stops_once() -> Iterator[None]:
    """Ctrl-C or SIGTERM (`timeout`, `kill`, a service manager) stops the work with a
    KeyboardInterrupt, once, so what was measured is written (`dflash benchmark`, `dflash
    eval-draft`, train-draft's evaluation). Session 39: `timeout 540` ended a 15-process
    `--process-per-run` benchmark in its last process, and the 14 finished ones were lost with
    it; session 42: a double Ctrl-C (the second ~5 ms after the first) wrote nothing. A second
    signal while the result is written is ignored; a SIGINT the process was started ignoring (a
    background job) stays ignored; the old handlers are back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread can take signals
        return
    sigs = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is not signal.SIG_IGN]

    def stop(signum: int, frame: object) -> None:
        for s in sigs:
            signal.signal(s, signal.SIG_IGN)
        raise KeyboardInterrupt

    old = {s: signal.signal(s, stop) for s in sigs}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
