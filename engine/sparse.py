"""Positional sparse prefill: prefill a selected subset of a long prompt at its true positions.

The caller passes the selected token ids and their original positions (strictly increasing).
The selection is split into contiguous runs; before each run every attention cache jumps to the
run's first true position, so RoPE sees original positions while the KV storage stays compact.
A contiguous run is therefore computed exactly as dense prefill computes it. Gated DeltaNet
layers simply run over the compacted sequence. Sliding-window layers keep the positions of their
keys and build the window mask from them. Decoding continues after the last original position.

Scattered selections work but shred local structure, and draft acceptance collapses: select
contiguous chunks (`select_chunks`), and see `scatter_warning`.
"""

from __future__ import annotations

import bisect
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache, create_attention_mask


class PositionedKVCache(KVCache):
    """A KV cache whose `offset` is the next token's true position, not its storage index."""

    def __init__(self) -> None:
        super().__init__()
        self.stored = 0

    def jump(self, position: int) -> None:
        if position < self.offset:
            raise ValueError(f"cannot move back from position {self.offset} to {position}")
        self.offset = position

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        n, prev = keys.shape[2], self.stored
        if self.keys is None or prev + n > self.keys.shape[2]:
            size = (prev + n + self.step - 1) // self.step * self.step
            new_k = mx.zeros((*keys.shape[:2], size, keys.shape[3]), keys.dtype)
            new_v = mx.zeros((*values.shape[:2], size, values.shape[3]), values.dtype)
            if self.keys is not None:
                new_k[..., :prev, :] = self.keys[..., :prev, :]
                new_v[..., :prev, :] = self.values[..., :prev, :]
            self.keys, self.values = new_k, new_v
        self.keys[..., prev : prev + n, :] = keys
        self.values[..., prev : prev + n, :] = values
        self.stored += n
        self.offset += n
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        return self.keys[..., : self.stored, :], self.values[..., : self.stored, :]

    def size(self) -> int:
        return self.stored

    def trim(self, n: int) -> int:
        n = min(self.stored, n)
        self.stored -= n
        self.offset -= n
        return n

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False, **_: Any):
        return create_attention_mask(N, self.stored, return_array, window_size)

    @property
    def state(self):
        k, v = self.keys_and_values() if self.keys is not None else (None, None)
        return k, v

    @state.setter
    def state(self, v):
        self.keys, self.values = v
        self.stored = 0 if v[0] is None else v[0].shape[2]

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class PositionedWindowCache:
    """Sliding-window KV that remembers each key's true position; the mask comes from them."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.positions: list[int] = []
        self.offset = 0

    def jump(self, position: int) -> None:
        if position < self.offset:
            raise ValueError(f"cannot move back from position {self.offset} to {position}")
        self.offset = position

    def _first_kept(self) -> int:
        """Keys at or before (first query - window) are outside every query's window."""
        return bisect.bisect_right(self.positions, self.offset - self.window)

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False, **_: Any):
        w = window_size or self.window
        kept = self.positions[self._first_kept() :]
        if N == 1 and not return_array and all(p > self.offset - w for p in kept):
            return None
        q = mx.arange(self.offset, self.offset + N)[:, None]
        k = mx.array(kept + list(range(self.offset, self.offset + N)))[None]
        return (k <= q) & (k > q - w)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        n, first = keys.shape[2], self._first_kept()
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = mx.concatenate([self.keys[..., first:, :], keys], axis=2)
            self.values = mx.concatenate([self.values[..., first:, :], values], axis=2)
        self.positions = self.positions[first:] + list(range(self.offset, self.offset + n))
        self.offset += n
        return self.keys, self.values

    def trim(self, n: int) -> int:
        n = min(n, len(self.positions))
        keep = len(self.positions) - n
        self.keys, self.values = self.keys[..., :keep, :], self.values[..., :keep, :]
        self.positions = self.positions[:keep]
        self.offset -= n
        return n

    def is_trimmable(self) -> bool:
        return True

    @property
    def state(self):
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def positioned(caches: list[Any]) -> list[Any]:
    """Replace fresh attention caches with position-aware ones (other kinds pass through)."""
    out = []
    for c in caches:
        if isinstance(c, RotatingKVCache):
            if c.keep:
                raise ValueError("sparse prefill does not support rotating caches with keep > 0")
            out.append(PositionedWindowCache(c.max_size))
        elif type(c) is KVCache:
            out.append(PositionedKVCache())
        else:
            out.append(c)
    return out


def jump(caches: Sequence[Any], position: int) -> None:
    """Move every position-aware cache to `position` (the start of the next run)."""
    for c in caches:
        if hasattr(c, "jump"):
            c.jump(position)


def validate(ids: Sequence[int], positions: Sequence[int]) -> None:
    """Refuse inconsistent selections with a clear message."""
    if len(ids) != len(positions):
        raise ValueError(
            f"prompt_tokens_override has {len(ids)} tokens but prompt_token_positions has "
            f"{len(positions)}: they must have the same length"
        )
    if not ids:
        raise ValueError("empty sparse selection: at least one token is needed")
    if any(not isinstance(p, int) or isinstance(p, bool) for p in positions):
        raise ValueError("prompt_token_positions must be integers")
    if positions[0] < 0:
        raise ValueError(f"prompt_token_positions must be >= 0, got {positions[0]}")
    for a, b in zip(positions, positions[1:]):
        if b <= a:
            raise ValueError(f"prompt_token_positions must be strictly increasing ({a} then {b})")


def runs(positions: Sequence[int]) -> list[tuple[int, int]]:
    """(start index, end index) of each contiguous run of positions."""
    out, start = [], 0
    for i in range(1, len(positions) + 1):
        if i == len(positions) or positions[i] != positions[i - 1] + 1:
            out.append((start, i))
            start = i
    return out


def scatter_warning(positions: Sequence[int], min_mean_run: float = 16.0) -> str | None:
    """A warning when the selection is scattered (short runs collapse draft acceptance)."""
    r = runs(positions)
    mean = len(positions) / len(r)
    if len(r) > 1 and mean < min_mean_run:
        return (
            f"scattered sparse selection: {len(r)} runs of {mean:.1f} tokens on average; "
            "select contiguous chunks (draft acceptance collapses on shredded context)"
        )
    return None


def select_chunks(
    n_tokens: int,
    keep: Sequence[tuple[int, int]] | None = None,
    chunk: int = 64,
    head: int = 64,
    tail: int = 256,
    every: int = 4,
) -> list[int]:
    """Positions of a chunked selection: the head, the tail, every `every`-th chunk between,
    and any explicit (start, end) ranges in `keep`. Contiguous by construction."""
    chosen: set[int] = set(range(min(head, n_tokens)))
    chosen |= set(range(max(0, n_tokens - tail), n_tokens))
    for i, start in enumerate(range(head, max(head, n_tokens - tail), chunk)):
        if i % every == 0:
            chosen |= set(range(start, min(start + chunk, n_tokens)))
    for a, b in keep or ():
        chosen |= set(range(max(0, a), min(b, n_tokens)))
    return sorted(chosen)
