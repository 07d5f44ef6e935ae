"""One-row matmuls as two-row ones, where the backend does two rows faster than one.

MLX's CPU backend sends every fp32 matmul to cblas_sgemm. With MKL on this project's 2-core
x86-64 VM (AMD EPYC), a one-row product is slower than a two-row one: SmolLM2's 49152x576 LM head
takes 8.9 ms for one row and 6.2 ms for two; a decode step of the whole model (one token at a
300-token cache) 51.6 ms against 44-47 ms with every Linear's one-row input doubled and the
second row dropped, logits bit for bit the same. A plain decode step is all one-row products,
so this is ~10% of every plain step (and of the draft's LM head in a one-token probe).

`pad_single_rows(model)` swaps the class of the model's nn.Linear and nn.Embedding instances for
subclasses that do this, but only inside `active()`: the target's own forwards enter it; the same
model object run by mlx-lm (the benchmark's baseline) is left exactly as mlx-lm runs it. Whether
it pays is measured once per process on the model's largest weight (`pays`); GPUs never pad.
DFLASH_PAD_ROWS=1 / 0 forces it on / off.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn

ENV = "DFLASH_PAD_ROWS"
_active = 0  # > 0 inside active(): the target's own forwards (one thread runs MLX per process)
_CLASSES: dict[type, type] = {}
_measured: dict[tuple, bool] = {}


def _double(x: mx.array) -> mx.array:
    return mx.concatenate([x, x], axis=-2)


def _padded_class(cls: type) -> type:
    """A subclass of nn.Linear / nn.Embedding whose product (__call__ / as_linear) computes a
    one-row input as two rows."""
    if cls not in _CLASSES:
        name = "as_linear" if issubclass(cls, nn.Embedding) else "__call__"
        product = getattr(cls, name)

        def padded(self, x):
            if _active and x.ndim >= 2 and x.shape[-2] == 1:
                return product(self, _double(x))[..., :1, :]
            return product(self, x)

        _CLASSES[cls] = type(f"RowPadded{cls.__name__}", (cls,), {name: padded})
    return _CLASSES[cls]


@contextlib.contextmanager
def active() -> Iterator[None]:
    """Pad one-row products of swapped modules while inside (re-entrant)."""
    global _active
    _active += 1
    try:
        yield
    finally:
        _active -= 1


def _eligible(model: nn.Module) -> list[nn.Module]:
    """The model's plain fp32 Linear / Embedding modules (quantized and half ones never reach BLAS)."""
    return [m for _, m in model.named_modules()
            if type(m) in (nn.Linear, nn.Embedding) and m.weight.dtype == mx.float32]


def pad_single_rows(model: nn.Module) -> int:
    """Swap the classes of `model`'s eligible modules; return how many."""
    mods = _eligible(model)
    for m in mods:
        m.__class__ = _padded_class(type(m))
    return len(mods)


def pays(model: nn.Module, reps: int = 7) -> bool:
    """Whether two-row products beat one-row ones here: DFLASH_PAD_ROWS if set, never on a GPU,
    else timed once per process and weight shape on the model's largest fp32 weight."""
    forced = os.environ.get(ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    if mx.default_device() != mx.cpu:
        return False
    weights = [m.weight for m in _eligible(model)]
    if not weights:
        return False
    w = max(weights, key=lambda a: a.size)
    key = tuple(w.shape)
    if key not in _measured:
        x = mx.random.normal((1, 1, w.shape[-1]), key=mx.random.key(0))
        one = lambda: x @ w.T  # noqa: E731
        two = lambda: (_double(x) @ w.T)[..., :1, :]  # noqa: E731
        mx.eval(one(), two())
        t1, t2 = [], []
        for _ in range(reps):  # alternate, so a drifting machine skews neither side
            for f, ts in ((one, t1), (two, t2)):
                t = time.perf_counter()
                mx.eval(f())
                ts.append(time.perf_counter() - t)
        _measured[key] = statistics.median(t2) < 0.9 * statistics.median(t1)
    return _measured[key]

