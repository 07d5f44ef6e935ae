"""engine/rowcache.py: a KV cache kept in R rows between several-row verifies."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from dflash.engine import rollback, rowcache
from dflash.engine.rowcache import RowsKVCache
from helpers import greedy_reference, run_dflash

H, D = 2, 4


def _kv(batch: int, n: int, seed: int) -> tuple[mx.array, mx.array]:
    mx.random.seed(seed)
    return mx.random.normal((batch, H, n, D)), mx.random.normal((batch, H, n, D))


def _one_row_cache(n: int) -> KVCache:
    c = KVCache()
    c.update_and_fetch(*_kv(1, n, 0))
    return c


def test_tiled_rows_equal_the_one_row_they_come_from():
    c = _one_row_cache(5)
    r = RowsKVCache.tiled(c, 3)
    k, v = r.update_and_fetch(*_kv(3, 2, 1))
    assert k.shape == (3, H, 7, D) and r.offset == 7
    for row in range(3):
        assert mx.array_equal(k[row, :, :5], c.keys[0, :, :5])
        assert mx.array_equal(v[row, :, :5], c.values[0, :, :5])


def test_spread_makes_the_kept_rows_new_tokens_every_rows():
    r = RowsKVCache.tiled(_one_row_cache(5), 3)
    new_k, new_v = _kv(3, 4, 2)
    r.update_and_fetch(new_k, new_v)
    r.spread(mx.array(2, mx.int32), 4)
    for row in range(3):
        assert mx.array_equal(r.keys[row, :, 5:9], new_k[2])
        assert mx.array_equal(r.values[row, :, 5:9], new_v[2])
    # a rewind (trim) then a pass of one row: written into every row, attended over row 0 alone
    rollback.rewind([r], [None], 2, 4, None)
    one_k, one_v = _kv(1, 1, 3)
    k, v = r.update_and_fetch(one_k, one_v)
    assert k.shape == (1, H, 8, D) and r.offset == 8
    for row in range(3):
        assert mx.array_equal(r.keys[row, :, 7], one_k[0, :, 0])
        assert mx.array_equal(r.keys[row, :, 5:7], new_k[2, :, :2])


def test_it_grows_past_a_step_and_goes_back_to_one_row():
    r = RowsKVCache.tiled(_one_row_cache(250), 2)
    k, _ = r.update_and_fetch(*_kv(2, 16, 4))
    assert r.offset == 266 and r.keys.shape[2] == 512 and k.shape == (2, H, 266, D)
    r.spread(mx.array(1, mx.int32), 16)
    c = r.one_row()
    assert type(c) is KVCache and c.offset == 266 and c.keys.shape[0] == 1
    assert mx.array_equal(c.keys[0, :, :266], r.keys[1, :, :266])


def test_a_pass_of_another_row_count_is_refused():
    r = RowsKVCache.tiled(_one_row_cache(3), 4)
    with pytest.raises(ValueError, match="a pass of 2 rows over a cache of 4"):
        r.update_and_fetch(*_kv(2, 1, 5))


def test_kept_rows_are_made_once_a_generation_and_give_mlx_lms_ids(pairs, monkeypatch):
    """DFLASH_ROWS_KEEP=1: the caches go into rows at the first several-row verify and stay
    there (one tiling a layer, however many row cycles); the ids are mlx-lm's greedy ones."""
    monkeypatch.setenv(rowcache.KEEP_ENV, "1")
    made = []
    tiled = RowsKVCache.tiled.__func__

    def counted(cls, cache, rows):
        made.append(rows)
        return tiled(cls, cache, rows)

    monkeypatch.setattr(RowsKVCache, "tiled", classmethod(counted))
    pair = pairs("qwen3")
    ids = pair.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    ref = greedy_reference(pair.target.model, ids, 48)
    final, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 48, verify_window="full",
                          branches=4)
    eos = set(pair.tokenizer.eos_token_ids)
    assert final.token_ids == [t for t in ref[: len(final.token_ids)]]
    assert len(final.token_ids) == 48 or final.token_ids[-1] in eos
    assert final.stats.branch_cycles >= 2
    assert made == [4] * len(pair.target.make_cache())
