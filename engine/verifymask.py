"""How the target's multi-token forwards mask attention: MLX's causal path, or an explicit array.

A verify is one forward of up to 16 tokens over the whole cache; mlx-lm hands MLX's fused
attention the string mask "causal". On one H200 (MLX 0.32.4 CUDA, cuDNN attention off, Qwen3-8B
layer shape, bf16; docs/benchmark.md) that path costs 0.32 ms a layer for 16 queries over 1K keys
while the same attention with an explicit boolean mask costs 0.17 ms; over 8K keys the explicit
mask is the slower one (0.71 against 0.57 ms). Timed one synced call at a time, not yet inside a
whole verify, so this is a switch to measure, off by default:

    DFLASH_VERIFY_MASK=causal      (default) as mlx-lm does
    DFLASH_VERIFY_MASK=array       an explicit boolean mask for every multi-token forward
    DFLASH_VERIFY_MASK=array:4096  the same up to 4,096 keys, the causal path beyond

It acts only inside `active()`, which the target's own forwards enter (engine/target.py), so
mlx-lm running the same model (the benchmark's baseline) is untouched. The mask is the same
causal mask either way; only the kernel MLX picks changes.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx

from .scope import Scope

ENV = "DFLASH_VERIFY_MASK"
active = Scope()  # the target's own forwards are inside (TargetModel enters it)
_real_sdpa = None  # mx.fast.scaled_dot_product_attention, once configure() has wrapped it
_limit = 0  # max_keys() as of the last configure(): read once per model load, not per attention call


def max_keys() -> int:
    """0: never an array (the default); else the largest key count that gets one."""
    value = os.environ.get(ENV, "causal").strip() or "causal"
    if value == "causal":
        return 0
    if value == "array":
        return 1 << 62
    if value.startswith("array:") and value[6:].isdigit() and int(value[6:]) > 0:
        return int(value[6:])
    raise ValueError(f"{ENV}={value!r}: expected causal, array or array:N (N keys, N > 0)")


def causal_array(queries: int, keys: int) -> mx.array:
    """[queries, keys] boolean: query i (at position keys - queries + i) sees keys <= its own."""
    return mx.arange(keys)[None, :] <= mx.arange(keys - queries, keys)[:, None]


def _sdpa(q: mx.array, k: mx.array, v: mx.array, *args: Any, **kwargs: Any) -> mx.array:
    mask = kwargs.get("mask")
    if active and isinstance(mask, str) and mask == "causal" and q.shape[-2] > 1:
        if k.shape[-2] <= _limit:
            kwargs["mask"] = causal_array(q.shape[-2], k.shape[-2])
    return _real_sdpa(q, k, v, *args, **kwargs)


def configure() -> None:
    """Read the setting (a bad value raises here, at load) and, the first time it asks for arrays,
    wrap mx.fast.scaled_dot_product_attention (mlx-lm's models look it up at every call); outside
    `active()`, or with the limit back at 0, the wrapper only passes through."""
    global _real_sdpa, _limit
    _limit = max_keys()
    if _limit and _real_sdpa is None:
        _real_sdpa = mx.fast.scaled_dot_product_attention
        mx.fast.scaled_dot_product_attention = _sdpa
