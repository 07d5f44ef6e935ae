"""RoPE and RMSNorm on the CPU in fewer kernels, with the same bits as MLX's own.

MLX 0.32's CPU backend has no kernel of its own for `mx.fast.rope` or `mx.fast.rms_norm`: each
call runs the op's composed fallback, ~15 small ops for a RoPE (positions, frequencies, cos,
sin, the rotation), ~6 for an RMSNorm, and on this 2-core CPU every op costs ~10-15 us to
dispatch whatever its size. A decode step of SmolLM2-135M runs 60 RoPEs and 61 RMSNorms: ~13 ms
of a ~52 ms step (matmuls ~28 ms), the same in a 16-token verify. Here:

- RoPE: the cos / sin tables are computed once per forward (every layer rotates the same
  positions) by the fallback's own formula, and each call is one compiled product-sum over
  [x ; x rotated by half] (161 -> 33 us a call, the tables 83 us a forward);
- RMSNorm: the mean of squares, then one compiled kernel for the rest (69 -> 41 us).

Same maths in the same order (a - b*s is a + b*(-s), a sum commutes), so the results equal
MLX's bit for bit (tests/test_cpufast.py checks it over offsets, shapes and dtypes it takes).
Only float32, plain `nn.RoPE` (not traditional; int offsets) and `nn.RMSNorm`; anything else,
and any call outside `active()` (mlx-lm's own decoding of the same model object), goes to
MLX as before; and none of it runs where this MLX's own ops would give other bits (checked once
per process, `agrees_with_mlx`: a later MLX may get CPU kernels of its own). `install` swaps those modules' classes for subclasses (same instance, same
weights), as target.py's capture does. DFLASH_CPU_FAST=0 turns it off.
"""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .accel import env_switch

ENV = "DFLASH_CPU_FAST"

# The tables of the forward in progress, by (rows, offset, dims, base, scale); None: inactive.
_TABLES: dict[tuple, tuple[mx.array, mx.array]] | None = None
# False: installed modules call MLX's ops even inside active() (scripts/arms_ab.py's fast=0 arm)
ON = True


def enabled() -> bool:
    """On a CPU unless DFLASH_CPU_FAST=0 (a GPU has kernels of its own for both ops)."""
    return env_switch(ENV, True) and mx.default_device() == mx.cpu


@contextmanager
def active() -> Iterator[None]:
    """Route installed modules' calls here for one forward (tables shared by its layers)."""
    global _TABLES
    outer = _TABLES
    _TABLES = ({} if outer is None else outer) if ON else None
    try:
        yield
    finally:
        _TABLES = outer


def _rotate(x: mx.array, swapped: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    return x * cos + swapped * sin


def _rms_finish(x: mx.array, mean_sq: mx.array, weight: mx.array, eps: mx.array) -> mx.array:
    return x * mx.rsqrt(mean_sq + eps) * weight


_rotate_compiled = mx.compile(_rotate, shapeless=True)
_rms_finish_compiled = mx.compile(_rms_finish, shapeless=True)


def tables(rows: int, offset: int, dims: int, base: float, scale: float) -> tuple[mx.array, mx.array]:
    """([cos, cos], [-sin, sin]) for positions offset..offset+rows-1, [rows, dims], float32,
    as MLX's RoPE fallback computes them (its base and scale are float32 arguments)."""
    half = dims // 2
    base32, scale32 = float(np.float32(base)), float(np.float32(scale))
    pos = (mx.arange(rows, dtype=mx.float32) + offset) * mx.array(scale32, mx.float32)
    inv = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * mx.array(math.log(base32) / half, mx.float32))
    theta = pos[:, None] * inv
    c, s = mx.cos(theta), mx.sin(theta)
    return mx.concatenate([c, c], axis=-1), mx.concatenate([-s, s], axis=-1)


def rope(x: mx.array, offset: int, dims: int, base: float, scale: float) -> mx.array:
    """Non-traditional RoPE of x [..., rows, features] at positions offset.., the first `dims`
    features rotated, from the forward's shared tables."""
    key = (x.shape[-2], offset, dims, base, scale)
    tab = _TABLES.get(key) if _TABLES is not None else None
    if tab is None:  # the first layer of a forward (outside active(): nothing is shared)
        tab = tables(*key)
        if _TABLES is not None:
            _TABLES[key] = tab
    half = dims // 2
    head = x if x.shape[-1] == dims else x[..., :dims]
    swapped = mx.concatenate([head[..., half:], head[..., :half]], axis=-1)
    out = _rotate_compiled(head, swapped, *tab)
    return out if x.shape[-1] == dims else mx.concatenate([out, x[..., dims:]], axis=-1)


_EPS: dict[float, mx.array] = {}  # each norm's eps as the float32 array the fallback adds


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    if eps not in _EPS:
        _EPS[eps] = mx.array(eps, mx.float32)
    return _rms_finish_compiled(x, mx.mean(mx.square(x), axis=-1, keepdims=True), weight, _EPS[eps])


class FastRoPE(nn.RoPE):
    """nn.RoPE whose float32 calls inside `active()` use the shared tables."""

    def __call__(self, x, offset: int = 0):
        if (_TABLES is None or self.traditional or x.dtype != mx.float32
                or not isinstance(offset, int) or self.dims % 2 or x.ndim < 2):
            return super().__call__(x, offset)
        return rope(x, offset, self.dims, self.base, self.scale)


class FastRMSNorm(nn.RMSNorm):
    """nn.RMSNorm whose float32 calls inside `active()` take 2 kernels instead of ~6."""

    def __call__(self, x):
        if _TABLES is None or x.dtype != mx.float32 or self.weight.dtype != mx.float32:
            return super().__call__(x)
        return rms_norm(x, self.weight, self.eps)


_SWAPS = {nn.RoPE: FastRoPE, nn.RMSNorm: FastRMSNorm}


_AGREES: bool | None = None


def agrees_with_mlx() -> bool:
    """Whether this MLX's own RoPE and RMSNorm give our bits (checked once per process on a few
    shapes): another MLX version may compute them otherwise, and then ours must not run, or a
    plain step would stop equalling mlx-lm's bit for bit."""
    global _AGREES
    if _AGREES is None:
        x = mx.random.normal((1, 3, 5, 64), key=mx.random.key(7)) * 3.0
        w = mx.random.normal((64,), key=mx.random.key(8))
        same = True
        for offset, base, scale in ((0, 10000.0, 1.0), (37, 100000.0, 1.0), (4093, 1e6, 0.5)):
            want = mx.fast.rope(x, 64, traditional=False, base=base, scale=scale, offset=offset)
            same &= mx.array_equal(rope(x, offset, 64, base, scale), want).item()
        same &= mx.array_equal(rms_norm(x, w, 1e-5), mx.fast.rms_norm(x, w, 1e-5)).item()
        _AGREES = bool(same)
        if not _AGREES:
            warnings.warn(f"this MLX ({mx.__version__}) computes RoPE / RMSNorm with other bits than "
                          "engine/cpufast.py: its fast path stays off", RuntimeWarning, stacklevel=3)
    return _AGREES


def install(model: Any) -> int:
    """Swap the class of every plain nn.RoPE / nn.RMSNorm in `model` (their subclasses, which
    compute something else, are left alone); returns how many. Nothing when not enabled() or
    when this MLX's own ops would give other bits (agrees_with_mlx)."""
    if not enabled() or not agrees_with_mlx():
        return 0
    n = 0
    for _, m in model.named_modules():
        swap = _SWAPS.get(type(m))
        if swap is not None:
            m.__class__ = swap
            n += 1
    return n
