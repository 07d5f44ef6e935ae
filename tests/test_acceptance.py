"""Acceptance is exact: a corrupted oracle is accepted up to its first corruption, every time."""

from __future__ import annotations

import pytest

from dflash.engine.drafters import OracleDrafter
from dflash.engine.verify import greedy_accept
from helpers import greedy_reference, run_dflash

import mlx.core as mx


def test_greedy_accept_counts_prefix():
    g = mx.array([5, 6, 7, 8, 9])
    assert greedy_accept(mx.array([5, 6, 7, 8]), g).item() == 4
    assert greedy_accept(mx.array([5, 6, 0, 8]), g).item() == 2
    assert greedy_accept(mx.array([0, 6, 7, 8]), g).item() == 0


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "gemma3_text"])
@pytest.mark.parametrize("corrupt", [1, 5, 11, 15])
def test_acceptance_stops_at_first_corruption(pairs, arch, corrupt):
    pair = pairs(arch)
    B, n_new = 16, 64
    ids = pair.tokenizer.encode("Once upon a time there was a small town by the sea.")
    ref = greedy_reference(pair.target.model, ids, n_new + B)
    oracle = OracleDrafter(
        ref, len(ids), B, corrupt_at=[corrupt, corrupt + 2], vocab_size=pair.target.vocab_size
    )
    saved, pair.tokenizer.eos_token_ids = pair.tokenizer.eos_token_ids, set()
    try:
        final, events = run_dflash(
            pair.target, oracle, pair.tokenizer, ids, n_new, verify_window="full"
        )
    finally:
        pair.tokenizer.eos_token_ids = saved
    assert final.token_ids == ref[:n_new]
    s = final.stats
    # block position j is draft index j-1: the first corrupted draft sits at index corrupt-1
    accepted = corrupt - 1
    full_cycles = (n_new - 1) // (accepted + 1)
    assert s.accept_histogram[accepted] >= full_cycles
    assert sum(s.accept_histogram) == s.cycles
    assert all(c == 0 for i, c in enumerate(s.accept_histogram) if i > accepted)
    # per-token draft flags: every cycle emits `accepted` draft tokens then the target's bonus
    flags = [f for ev in events for f in ev.from_draft]
    assert len(flags) == n_new and flags[0] is False


def test_window_policy_tracks_acceptance():
    from dflash.engine.window import VerifyWindow

    w = VerifyWindow(16, "auto")
    for _ in range(30):
        w.observe(16, 15, 0.02)  # everything accepted, 20 ms a cycle
    assert w.next() == 1  # no plain step timed yet: the next cycle times one
    w.observe(1, 0, 0.01)  # a plain step: 10 ms
    assert w.next() == 16
    windows = []
    for _ in range(70):  # nothing accepted; a draft cycle costs three plain steps
        k = w.next()
        windows.append(k)
        w.observe(k, 0, 0.01 if k == 1 else 0.03)
    assert windows[0] == 16  # a long good streak is not forgotten at once ...
    late = windows[30:]
    assert late.count(1) >= 30  # ... but then drafting does not pay: mostly plain steps,
    assert any(k > 1 for k in late) and max(late) < 16  # with a shorter probe every few
    assert w.d > 0.5  # the measured draft cost (the median of its last few) replaced the prior, 0.2
    assert VerifyWindow(16, "full").next() == 16 and VerifyWindow(16, 4).next() == 4
    assert VerifyWindow(16, 1).next() == 1
    for bad in (0, 17):
        with pytest.raises(ValueError):
            VerifyWindow(16, bad)


@pytest.mark.parametrize("max_tokens", [2, 5, 9])
def test_acceptance_counts_only_the_drafts_handed_out(pairs, max_tokens):
    """A whole block accepted where max_tokens cuts the answer short: the stats count the drafts
    that were emitted (acceptance <= 1), not all the verify accepted."""
    pair = pairs("qwen3")
    ids = pair.tokenizer.encode("Once upon a time there was a small town by the sea.")
    ref = greedy_reference(pair.target.model, ids, 40)
    saved, pair.tokenizer.eos_token_ids = pair.tokenizer.eos_token_ids, set()
    try:
        final, _ = run_dflash(pair.target, OracleDrafter(ref, len(ids), 16, vocab_size=pair.target.vocab_size),
                              pair.tokenizer, ids, max_tokens, verify_window="full", copy_draft=False)
    finally:
        pair.tokenizer.eos_token_ids = saved
    s = final.stats
    assert final.token_ids == ref[:max_tokens] and s.cycles == 1
    assert s.accept_histogram[15] == 1  # the verify itself accepted all 15 drafts
    assert s.accepted_drafts == max_tokens - 1 and s.acceptance == pytest.approx((max_tokens - 1) / max_tokens)
