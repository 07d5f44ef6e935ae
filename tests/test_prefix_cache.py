"""The tiered prefix cache end to end: generation with a hit equals generation without one.

Proves, for every architecture family: a cold run with a cache, an L1 hit, an L2 hit from a
fresh PrefixCache (a restarted worker) and a partial-prefix hit all give the same token ids as
cold runs; L1 keeps its byte/entry budgets and spills what it evicts to L2; a corrupt L2 entry
is dropped and the lookup falls back; the worker keeps generating (L1 only) while the cache
process is killed, and uses L2 again once it is back.
"""

from __future__ import annotations

import time

import mlx.core as mx
import pytest

from conftest import ARCHS
from dflash.cache import snapshot
from dflash.cache.tiers import Identity, PrefixCache
from dflash.engine.prefix import Snapshot
from helpers import run_dflash
from test_l2 import cache_proc  # noqa: F401  (fixture)

PROMPT = "Question: what is the capital of France? Answer: Paris is the capital. " * 2
MORE = " Once upon a time there was a small town by the sea."
N_NEW = 24
EVERY = 16


def _identity(pair, tag: str = "") -> Identity:
    return Identity(pair.model_path + tag, pair.draft_path, tuple(pair.drafter.layer_ids))


def _cache(pair, l2=None, tag: str = "", **kw) -> PrefixCache:
    kw.setdefault("every", EVERY)
    return PrefixCache(_identity(pair, tag), Snapshot.decode, l2, **kw)


def _gen(pair, ids, cache=None):
    final, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, N_NEW,
                          prefix_cache=cache)
    return final


@pytest.mark.parametrize("arch", ARCHS)
def test_hits_are_token_identical(pairs, cache_proc, arch):  # noqa: F811
    pair = pairs(arch)
    proc = cache_proc()
    ids = pair.tokenizer.encode(PROMPT)
    ids2 = ids + pair.tokenizer.encode(MORE)
    assert len(ids) % EVERY and len(ids) > 2 * EVERY

    plain = _gen(pair, ids)
    warm = _cache(pair, proc.client())
    cold = _gen(pair, ids, warm)
    assert cold.stats.cached_prompt_tokens == 0
    assert cold.token_ids == plain.token_ids

    l1 = _gen(pair, ids, warm)  # the whole prompt from L1: no prefill at all
    assert l1.stats.cached_prompt_tokens == len(ids)
    assert l1.token_ids == cold.token_ids
    assert warm.stats()["l1"]["hits"] == 1
    assert warm.flush()

    fresh = _cache(pair, proc.client())  # a restarted worker: empty L1, same cache process
    l2 = _gen(pair, ids, fresh)
    assert l2.stats.cached_prompt_tokens == len(ids)
    assert l2.token_ids == cold.token_ids
    assert fresh.stats()["l2"]["hits"] == 1

    # a longer prompt resumes from the last stored grid boundary inside the shared prefix
    reference = _gen(pair, ids2, _cache(pair, tag="#cold"))
    again = _cache(pair, proc.client())
    part = _gen(pair, ids2, again)
    assert part.stats.cached_prompt_tokens == len(ids) // EVERY * EVERY
    assert part.token_ids == reference.token_ids
    assert again.stats()["l2"]["hits"] == 1


def _tiny_snapshot(n: int, size: int = 4096) -> Snapshot:
    kv = mx.random.normal((1, 1, n, size // (4 * n)))
    return Snapshot(n, [{"kind": "kv", "keys": kv, "values": kv + 1, "offset": n}], None,
                    mx.zeros((1, 1, 8)))


def _ids(i: int, n: int) -> list[int]:
    return [i] * n


def test_l1_budgets_and_spill_to_l2(cache_proc):  # noqa: F811
    proc = cache_proc()
    size = _tiny_snapshot(8).nbytes
    pc = PrefixCache(Identity("t", "d", (1,)), Snapshot.decode, proc.client(),
                     l1_max_bytes=int(2.5 * size), l1_max_entries=10, every=4,
                     write_through=False)
    for i in range(6):
        pc.insert(_ids(i, 8), _tiny_snapshot(8))
        assert pc.l1.bytes <= int(2.5 * size)
    st = pc.stats()
    assert st["l1"]["entries"] == 2 and st["l1"]["evictions"] == 4
    assert pc.flush()
    assert pc.stats()["l2_writes"] == 4  # every eviction spilled
    assert pc.lookup(_ids(0, 8))[0] == 8  # spilled entry, found in L2
    assert pc.stats()["l2"]["hits"] == 1

    by_count = PrefixCache(Identity("t", "d", (1,)), Snapshot.decode, None,
                           l1_max_bytes=1 << 30, l1_max_entries=3, every=4)
    for i in range(5):
        by_count.insert(_ids(i, 8), _tiny_snapshot(8))
    assert len(by_count.l1) == 3
    assert by_count.lookup(_ids(0, 8)) is None and by_count.lookup(_ids(4, 8))[0] == 8
    # the longest stored boundary wins; a prefix of a stored prompt is no hit
    by_count.insert(_ids(4, 4), _tiny_snapshot(4))
    assert by_count.lookup(_ids(4, 11))[0] == 8
    assert by_count.lookup(_ids(4, 7))[0] == 4


def test_corrupt_l2_entry_falls_back(cache_proc):  # noqa: F811
    proc = cache_proc()
    ident = Identity("t", "d", (1,))
    pc = PrefixCache(ident, Snapshot.decode, proc.client(), every=4)
    pc.insert(_ids(7, 4), _tiny_snapshot(4, 200_000))
    pc.insert(_ids(7, 8), _tiny_snapshot(8, 200_000))
    assert pc.flush()
    files = sorted((proc.directory / "snapshots").rglob("*.val"), key=lambda p: p.stat().st_mtime)
    data = bytearray(files[-1].read_bytes())  # the 8-token entry
    data[snapshot.HEADER_SIZE + 100] ^= 0xFF
    files[-1].write_bytes(bytes(data))

    fresh = PrefixCache(ident, Snapshot.decode, proc.client(), every=4)
    n, snap = fresh.lookup(_ids(7, 8))
    assert n == 4  # the damaged longer entry was skipped, never loaded
    assert proc.client().stats()["corrupt_dropped"] == 1


def test_worker_survives_cache_process_death(pairs, cache_proc):  # noqa: F811
    pair = pairs("qwen3")
    proc = cache_proc()
    ids = pair.tokenizer.encode(PROMPT)
    other = pair.tokenizer.encode(MORE * 3)
    pc = _cache(pair, proc.client(timeout_s=1.0, retry_after_s=0.3))
    cold = _gen(pair, ids, pc)
    assert pc.flush()

    proc.kill9()
    t = time.monotonic()
    hit = _gen(pair, ids, pc)  # L1 still serves
    miss = _gen(pair, other, pc)  # a new prompt: cold prefill, write to L2 dropped
    assert time.monotonic() - t < 5
    assert hit.stats.cached_prompt_tokens == len(ids) and hit.token_ids == cold.token_ids
    assert miss.stats.cached_prompt_tokens == 0
    assert not pc.flush()  # the writer has tried everything queued; the process is gone
    assert pc.stats()["l2_dropped_writes"] >= 1

    proc.start()  # same directory: what was written before the kill is still there
    time.sleep(0.4)
    fresh = _cache(pair, proc.client())
    assert _gen(pair, ids, fresh).token_ids == cold.token_ids
    assert fresh.stats()["l2"]["hits"] == 1
    deadline = time.monotonic() + 10
    while not pc.flush():  # the old client reconnects by itself
        assert time.monotonic() < deadline
        time.sleep(0.1)
