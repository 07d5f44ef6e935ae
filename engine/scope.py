"""A re-entrant "inside the target's own forwards" flag.

Row padding (rowpad.py) and the few-query attention (verifyattn.py) change how MLX computes a product or
an attention, and must do so only inside the target's own forwards: mlx-lm running the same model
object (the benchmark's baseline) is left as mlx-lm runs it. Each keeps a Scope; TargetModel
enters them around its forwards.
"""

from __future__ import annotations

import contextlib
from typing import Iterator


class Scope:
    """True while some `with scope():` is open (one thread runs MLX per process)."""

    def __init__(self) -> None:
        self.depth = 0

    def __bool__(self) -> bool:
        return self.depth > 0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
