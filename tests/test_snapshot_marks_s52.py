"""Where a prefill takes its prefix snapshots (session 52): `every` tokens apart up to
DENSE_MARKS * every, then a spacing that doubles with the length, so one long prompt's snapshots
cost a few times its last one instead of O(n^2 / every) bytes, and a run resumed at a sparse
mark computes what a cold run computes."""

from __future__ import annotations

import pytest

from dflash.cache.tiers import DENSE_MARKS, Identity, PrefixCache, snapshot_marks
from dflash.daemon.caching import pair_identity
from dflash.engine.prefix import Snapshot
from helpers import run_dflash
from test_cache_s42 import PROMPT
from test_l2 import cache_proc  # noqa: F401  (fixture)


@pytest.mark.parametrize("every", [1, 4, 16, 256])
@pytest.mark.parametrize("n", [0, 1, 5, 100, 2048, 2049, 8100, 32768, 100_003])
def test_marks_lie_on_the_grid_dense_first_then_doubling(every, n):
    marks = snapshot_marks(n, every)
    assert marks == sorted(set(marks)) and all(0 < m < n and m % every == 0 for m in marks)
    dense = list(range(every, min(n, DENSE_MARKS * every + 1), every))
    assert marks[: len(dense)] == dense  # short prompts: exactly the old grid
    for a, b in zip(marks, marks[1:]):  # past the dense part, at most a quarter of the prefix
        assert b - a <= max(every, a // 4), (a, b)
    if marks:  # the prompt's end is close behind the last mark, too
        assert n - marks[-1] <= max(every, marks[-1] // 4 + every)
    # bytes: a snapshot holds its whole prefix; the total stays within a few prompts' worth
    assert sum(marks) <= 7 * n + every * DENSE_MARKS * (DENSE_MARKS + 1) // 2  # 6.5n per doubling chain


def test_an_8100_token_prompt_takes_16_snapshots_not_32():
    pc = PrefixCache(Identity("t", "d", (1,)), Snapshot.decode, None, every=256)
    marks = pc.boundaries(8100)
    assert marks == [256, 512, 768, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096,
                     5120, 6144, 7168, 8100]
    old = [*range(256, 8100, 256), 8100]
    assert sum(marks) * 2.7 < sum(old)  # ~49K snapshot tokens against ~135K


def test_a_run_resumed_at_a_sparse_mark_matches_a_cold_run(pairs, cache_proc):  # noqa: F811
    """every=4: marks 4..32 dense, then 40, 48, 56, 64, 80, ...: a second prompt that shares a
    prefix ending between sparse marks resumes at the last mark before it, and its tokens equal
    a cold run's (greedy ids)."""
    pair = pairs("llama")
    ids = pair.tokenizer.encode(PROMPT * 4)
    assert len(ids) > 4 * DENSE_MARKS + 16, len(ids)
    proc = cache_proc()
    pc = PrefixCache(pair_identity(pair, None), Snapshot.decode, proc.client(), every=4)
    first, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 6, prefix_cache=pc)
    assert first.stats.cached_prompt_tokens == 0
    marks = pc.boundaries(len(ids))
    assert marks[-2] - marks[-3] > 4  # the last mark before the prompt's end is a sparse one
    cut = marks[-2] + 1  # a prompt sharing more than that mark, less than the prompt's end
    other = ids[:cut] + pair.tokenizer.encode(" and then something else entirely.")
    warm, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, other, 12, prefix_cache=pc)
    cold, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, other, 12)
    assert warm.stats.cached_prompt_tokens == marks[-2]
    assert warm.token_ids == cold.token_ids


def test_a_prompt_end_on_the_grid_but_off_the_marks_is_found_by_a_longer_prompt():
    """every=4: 36 is a multiple of 4 but no mark (32, 40, ...). The prompt end stored there is
    remembered as a known end, so a longer prompt sharing it resumes there; and lookups probe
    only the marks, so a length on the old dense grid that was never an end is not asked for."""
    from test_prefix_cache import _tiny_snapshot

    pc = PrefixCache(Identity("t", "d", (1,)), Snapshot.decode, None, every=4)
    assert 36 not in snapshot_marks(100, 4) and 40 in snapshot_marks(100, 4)
    ids = list(range(1, 60))
    pc.insert(ids[:36], _tiny_snapshot(36, 36 * 16))
    assert pc.lookup(ids[:50])[0] == 36
    assert 44 not in pc._candidates(50) and 40 in pc._candidates(50)
