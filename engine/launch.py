"""The `dflash` command's entry point: the command line is imported (MLX, mlx-lm: 1-2 s) under a
Ctrl-C guard, so a Ctrl-C right after Enter says "cancelled" (exit 130), not a traceback."""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from .cli import main as command
    except KeyboardInterrupt:
        sys.stderr.write("cancelled\n")
        sys.exit(130)
    command()
