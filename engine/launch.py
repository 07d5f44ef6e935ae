"""The `dflash` command's entry point: the command line is imported (MLX, mlx-lm: 1-2 s) under a
Ctrl-C guard, so a Ctrl-C right after Enter says "cancelled" (exit 130), not a traceback; and
`sigterm_stops`, which lets long commands take SIGTERM as they take Ctrl-C."""

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
def sigterm_stops() -> Iterator[None]:
    """SIGTERM (`timeout`, `kill`, a service manager) stops the work as Ctrl-C does, so what was
    measured is written (`dflash benchmark`, `dflash eval-draft`). Session 39: `timeout 540`
    ended a 15-process `--process-per-run` benchmark in its last process, and the 14 finished
    ones were lost with it. A second SIGTERM while the result is written is ignored; the old
    handler is back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread can take signals
        return

    def stop(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
