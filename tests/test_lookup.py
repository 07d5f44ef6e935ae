"""Copy drafting's n-gram lookup (engine/lookup.py): what it proposes, against a brute force."""

from __future__ import annotations

import random

import pytest

from dflash.engine.lookup import CopyAcceptance, CopyProposer


def brute_force(h: list[int], count: int, lo: int, hi: int) -> tuple[list[int], int]:
    """The longest suffix (hi..lo) with an earlier occurrence; the latest one; periodic extension."""
    L = len(h)
    for n in range(min(hi, L - 1), lo - 1, -1):
        suffix = h[L - n :]
        for start in range(L - 1, n - 1, -1):  # start: index after the occurrence, < L
            if h[start - n : start] == suffix:
                seq = list(h)
                for _ in range(count):
                    seq.append(seq[len(seq) - (L - start)])
                return seq[L : L + count], n
    return [], 0


def test_proposes_the_continuation_of_the_latest_occurrence():
    p = CopyProposer(min_ngram=2, max_ngram=4)
    p.reset([5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 3, 4, 5, 6])
    # suffix [5, 6]: latest earlier occurrence at index 7 -> followed by 7, 3, 4, 5, 6, ...
    assert p.propose(4) == ([7, 3, 4, 5], 2)
    p.extend([7])  # suffix [5, 6, 7] now matches at 7..9 -> followed by 3, 4
    assert p.propose(3) == ([3, 4, 5], 3)


def test_periodic_text_keeps_repeating():
    p = CopyProposer(min_ngram=2, max_ngram=6)
    p.reset([9, 1, 2, 1, 2, 1, 2])
    assert p.propose(5) == ([1, 2, 1, 2, 1], 4)


def test_no_match_and_limits():
    p = CopyProposer(min_ngram=3, max_ngram=5)
    p.reset([1, 2, 3, 4, 5])
    assert p.propose(8) == ([], 0)
    assert p.propose(0) == ([], 0)
    with pytest.raises(ValueError):
        CopyProposer(min_ngram=4, max_ngram=3)


@pytest.mark.parametrize("seed", range(5))
def test_matches_brute_force_while_text_grows(seed: int):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 8])
    p = CopyProposer(min_ngram=2, max_ngram=5)
    h = [rng.randrange(vocab) for _ in range(4)]
    p.reset(h)
    for _ in range(120):
        assert p.propose(7) == brute_force(h, 7, 2, 5)
        new = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
        h += new
        p.extend(new)


def test_acceptance_estimate_follows_outcomes():
    a = CopyAcceptance()
    assert a.p == 0.5
    for _ in range(20):
        a.observe(8, 8)
    high = a.p
    for _ in range(60):
        a.observe(8, 0)
    assert high > 0.9 and a.p < 0.1


@pytest.mark.parametrize("seed", range(3))
def test_long_prompt_indexed_at_once_matches_brute_force(seed: int):
    """reset() indexes a whole prompt with numpy hashes; what it finds equals the brute force,
    before and after tokens are committed one by one."""
    rng = random.Random(100 + seed)
    vocab = rng.choice([4, 50, 49152])
    h = [rng.randrange(vocab) for _ in range(600)] + [7, 8, 9, 10, 11] * 3
    p = CopyProposer(min_ngram=2, max_ngram=6)
    p.reset(h)
    assert p.propose(9) == brute_force(h, 9, 2, 6)
    for _ in range(40):
        new = [rng.randrange(vocab)] if rng.random() < 0.5 else h[rng.randrange(len(h) - 3):][:3]
        h += new
        p.extend(new)
        assert p.propose(9) == brute_force(h, 9, 2, 6)
