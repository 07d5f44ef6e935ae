"""A KV cache that stays in R rows between several-row verifies (engine/branches.py).

A greedy verify of R draft rows runs the target over [R, k] tokens, so every attention layer
needs R rows of the committed cache. The default (`rollback.into_rows` / `keep_row`) copies the
one-row cache into R rows before each such verify and takes the kept row back out after it: two
copies of the whole cache a cycle. On large targets they are what a rows cycle pays beyond its
extra attention (session 29, H200, the Qwen3-8B shape at 4,096 tokens: 15.9 ms with one row,
36.6 ms with 8, the batched pass growing ~6 ms per 1,000 tokens of cache, the take 3.7 ms).

RowsKVCache keeps the R rows instead. Every row holds the same committed tokens (the invariant
between cycles), so a cycle of R rows writes its k new keys into each row in place and then
copies the kept row's k keys into the others (`spread`): k tokens moved, not the cache. A pass
of one row (a plain step, a copy proposal, a narrow window) writes its keys into every row
(broadcast) and attends over row 0 alone, so it costs what it costs on a one-row cache. R
copies of the cache still take R times the memory: when the rows stop fitting their budget the
cache goes back to one row for good (`one_row`: the cache only grows within a generation).
Rollback is the plain cache's (lower the offset): the rows stay equal below it.

Opt-in until measured on a GPU (DFLASH_ROWS_KEEP=1; see rollback.into_rows): on the CPU, where
the default is one row, the outputs are tested equal to mlx-lm's greedy ids either way.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .accel import env_switch

KEEP_ENV = "DFLASH_ROWS_KEEP"


def keep_rows() -> bool:
    """Whether several-row verifies keep their caches in rows (RowsKVCache) instead of copying
    them in and out each cycle: DFLASH_ROWS_KEEP=1 (off by default until measured on a GPU)."""
    return env_switch(KEEP_ENV, False)


class RowsKVCache(KVCache):
    """R equal rows of a KV cache; passes of R rows or of one (see the module doc)."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows = rows

    @classmethod
    def tiled(cls, cache: KVCache, rows: int) -> "RowsKVCache":
        """`cache`'s one row repeated into `rows` rows (one copy, lazily)."""
        out = cls(rows)
        out.offset = cache.offset
        if cache.keys is not None:
            out.keys = mx.repeat(cache.keys, rows, axis=0)
            out.values = mx.repeat(cache.values, rows, axis=0)
        return out

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write the new keys (one row: into every row) and return the rows the pass attends
        over: all R for a pass of R rows, row 0 for a pass of one."""
        batch, n, prev = keys.shape[0], keys.shape[2], self.offset
        if batch not in (1, self.rows):
            raise ValueError(f"a pass of {batch} rows over a cache of {self.rows}")
        if self.keys is None or prev + n > self.keys.shape[2]:
            self._grow(keys, values, prev + n)
        self.offset += n
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        return self.keys[:batch, :, : self.offset, :], self.values[:batch, :, : self.offset, :]

    def _grow(self, keys: mx.array, values: mx.array, needed: int) -> None:
        """Room for `needed` tokens in whole steps of `step`, as the plain cache grows."""
        size = (needed + self.step - 1) // self.step * self.step
        have = 0 if self.keys is None else self.keys.shape[2]
        if have >= size:
            return
        heads = keys.shape[1]
        more_k = mx.zeros((self.rows, heads, size - have, keys.shape[3]), keys.dtype)
        more_v = mx.zeros((self.rows, heads, size - have, values.shape[3]), values.dtype)
        if self.keys is None:
            self.keys, self.values = more_k, more_v
        else:
            self.keys = mx.concatenate([self.keys, more_k], axis=2)
            self.values = mx.concatenate([self.values, more_v], axis=2)

    def spread(self, row: mx.array, n: int) -> None:
        """Copy the last `n` tokens of row `row` (a device index) into every row: after a pass
        of R rows, the kept row's keys become every row's."""
        start, index = self.offset - n, row.reshape(1)
        kept_k = mx.take(self.keys[..., start : self.offset, :], index, axis=0)
        kept_v = mx.take(self.values[..., start : self.offset, :], index, axis=0)
        self.keys[..., start : self.offset, :] = kept_k
        self.values[..., start : self.offset, :] = kept_v

    def one_row(self) -> KVCache:
        """Row 0 as a plain one-row cache (a copy, so the R rows' memory can go)."""
        out = KVCache()
        out.offset = self.offset
        if self.keys is not None:
            out.keys = mx.contiguous(self.keys[:1])
            out.values = mx.contiguous(self.values[:1])
        return out
