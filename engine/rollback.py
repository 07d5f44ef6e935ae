"""Rollback of the target's caches after a verify pass: one small adapter per cache kind.

After the target verified a block of B tokens, only the anchor and the accepted drafts (n_keep
of the B) are committed. Every cache must end up exactly as if only those n_keep tokens had been
fed. How depends on the cache kind:

- KVCache, QuantizedKVCache: lower the offset (trim).
- RotatingKVCache (sliding window): a multi-token update leaves the buffer in temporal order
  with the block at its end, so dropping the rejected tail is a slice. mlx-lm's own `trim`
  refuses (or corrupts the ring) once the window has wrapped; this stays exact.
- PositionedKVCache / PositionedWindowCache (sparse prefill, sparse.py): trim; the window
  cache keeps its keys in temporal order with their true positions, so trim is a slice.
- ArraysCache (Gated DeltaNet): restore from the verify tape (see tape.py), replaying only the
  accepted steps.

A verify of several rows (engine/branches.py) first copies the committed cache into every row
(`tile_rows`), then keeps the winning row (`keep_row`) before the rewind above, each cycle. Only
plain KVCaches take part (`rows_supported`): a ring, a recurrent state or a quantized tuple would
each need their own copy, and the targets that have them verify one row. A cache kept in R rows
between cycles (DFLASH_ROWS_KEEP=1, commit 8ea9c11) was removed after session 31 measured it on
the H200: SmolLM2-135M 2.07x of mlx-lm against 2.18x copying, and on Qwen3-8B it paid only at
lengths past the rows' 256 MiB budget (~230 tokens).
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from .sparse import PositionedWindowCache
from .tape import Tape, gdn_module


class UnsupportedCacheError(ValueError):
    """The target uses a cache kind DFlash cannot roll back."""


def cache_kind(cache: Any) -> str:
    if isinstance(cache, RotatingKVCache):
        return "rotating"
    if isinstance(cache, QuantizedKVCache):
        return "quantized"
    if isinstance(cache, KVCache):
        return "kv"
    if isinstance(cache, ArraysCache):
        return "gdn"
    if isinstance(cache, PositionedWindowCache):
        return "window"
    return type(cache).__name__


SUPPORTED_KINDS = ("kv", "quantized", "rotating", "gdn", "window")


def check_supported(caches: Sequence[Any], layers: Sequence[Any]) -> None:
    """Raise a clear error for a target whose cache kinds we cannot roll back."""
    for i, (layer, c) in enumerate(zip(layers, caches)):
        kind = cache_kind(c)
        if kind not in SUPPORTED_KINDS:
            raise UnsupportedCacheError(
                f"layer {i} uses a {kind} cache; DFlash supports {', '.join(SUPPORTED_KINDS)}"
            )
        if kind == "gdn" and gdn_module(layer) is None:
            raise UnsupportedCacheError(
                f"layer {i} has an ArraysCache but no Gated DeltaNet module "
                "(only GDN recurrent layers can be replayed)"
            )


def plain_step_undoable(caches: Sequence[Any]) -> bool:
    """Whether a one-token verify (a plain step) can be rewound in every cache.

    A rotating (sliding-window) cache writes a single token in place into its ring, over the
    oldest row: that row is gone, so such targets never run plain steps (window >= 2).
    """
    return not any(isinstance(c, RotatingKVCache) for c in caches)


def rows_supported(caches: Sequence[Any]) -> bool:
    """Whether a verify may run several rows over these caches (every one a plain KVCache)."""
    return all(type(c) is KVCache for c in caches)


def tile_rows(caches: Sequence[Any], rows: int) -> None:
    """Give every (one-row) cache `rows` identical rows, lazily, for a verify of that many."""
    for c in caches:
        if c.keys is not None:
            c.keys = mx.repeat(c.keys, rows, axis=0)
            c.values = mx.repeat(c.values, rows, axis=0)


def keep_row(caches: Sequence[Any], row: mx.array) -> None:
    """Keep one row of every cache (`row`: a device index, so nothing waits for the host)."""
    index = row.reshape(1)
    for c in caches:
        c.keys = mx.take(c.keys, index, axis=0)
        c.values = mx.take(c.values, index, axis=0)


def needs_tape(caches: Sequence[Any]) -> bool:
    return any(isinstance(c, ArraysCache) for c in caches)


def rewind(
    caches: Sequence[Any],
    layers: Sequence[Any],
    n_keep: int,
    block_len: int,
    tape: Tape | None,
) -> None:
    """Leave every cache as if only the first n_keep of the block_len verified tokens were fed."""
    n_drop = block_len - n_keep
    if n_drop <= 0:
        return
    for layer, c in zip(layers, caches):
        if isinstance(c, RotatingKVCache):
            _rewind_rotating(c, n_drop)
        elif isinstance(c, (KVCache, QuantizedKVCache, PositionedWindowCache)):
            if c.trim(n_drop) != n_drop:
                raise RuntimeError("KV cache held fewer tokens than the verified block")
        elif isinstance(c, ArraysCache):
            if tape is None:
                raise RuntimeError("a recurrent cache needs a verify tape to roll back")
            conv_state, state = tape.entry_for(gdn_module(layer)).replay(n_keep)
            c[0], c[1] = conv_state, state
        else:  # check_supported() runs before any cycle; this is a programming error
            raise UnsupportedCacheError(f"no rollback for {type(c).__name__}")


def _rewind_rotating(c: RotatingKVCache, n_drop: int) -> None:
    if c.keys is None or c._idx != c.keys.shape[2]:
        # Only a multi-token (concatenating) update precedes a rewind; its layout is temporal.
        raise RuntimeError("rotating cache is not in temporal order after verify")
    keep = c._idx - n_drop
    c.keys = c.keys[..., :keep, :]
    c.values = c.values[..., :keep, :]
    c.offset -= n_drop
    c._idx = keep


KV_BITS = (2, 3, 4, 5, 6, 8)  # what MLX's quantized KV cache takes (7 fails inside MLX)


def kv_bits_problem(bits: int | None) -> str | None:
    """Why `bits` cannot quantize the KV cache (None: it can, or None/0 asks for no quantizing);
    checked before a model or a job runs, not when the first prefill ends."""
    if not bits or bits in KV_BITS:
        return None
    from ..daemon.protocol import shown

    return f"kv_bits must be one of {', '.join(map(str, KV_BITS))}, got {shown(bits)}"


def quantize_kv(caches: list[Any], bits: int | None, group_size: int = 64) -> None:
    """Switch full-attention KV caches to quantized ones (mlx-lm's kv_bits), in place."""
    if not bits:
        return
    for i, c in enumerate(caches):
        if type(c) is KVCache:
            caches[i] = c.to_quantized(group_size=group_size, bits=bits)
