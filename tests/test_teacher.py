"""A teacher's ids (generate.py's `teacher`): DFlash decodes a fixed text at the cost of its own
passes, so arms can be timed on mlx-lm's text where bf16 rounding would part the texts."""

from __future__ import annotations

import pytest

from tests.helpers import greedy_reference, run_dflash


def _teacher(pair, ids: list[int], n: int) -> list[int]:
    """A text the target would not write: its greedy start, then a repeating pattern (which
    copy drafting proposes, so accepted runs are forced too), no end-of-sequence id in it."""
    eos = set(pair.tokenizer.eos_token_ids)
    start = greedy_reference(pair.target.model, ids, 6)
    pattern = [t for t in range(40, 60) if t not in eos][:5]
    text = start + pattern * 6
    return [t for t in text if t not in eos][:n]


@pytest.mark.parametrize("window", ["auto", "full", 1, 4])
def test_a_run_decodes_its_teachers_text_and_then_the_targets_own(pairs, window):
    """Every emitted id is the teacher's while it has one; after its end the target's own greedy
    continuation of that text follows (the caches hold the forced tokens as a real run would)."""
    pair = pairs("qwen3")
    ids = pair.tokenizer.encode("The quick brown fox jumps")
    teacher = _teacher(pair, ids, 30)
    fin, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 42, verify_window=window,
                        teacher=teacher)
    assert fin.token_ids[:30] == teacher
    after = greedy_reference(pair.target.model, ids + teacher, 12)
    eos = set(pair.tokenizer.eos_token_ids)
    want = teacher + after
    cut = next((i for i, t in enumerate(want) if t in eos), len(want))
    assert fin.token_ids == want[:cut]
    if window != 1:  # the repeated pattern is copied and accepted: forced ids are accepted ids
        assert fin.stats.accepted_drafts > 0


def test_the_targets_own_text_as_teacher_changes_nothing(pairs):
    """Forcing mlx-lm's greedy ids gives the same ids and the same cycles as no teacher."""
    pair = pairs("llama")
    ids = pair.tokenizer.encode("def add(a, b):")
    plain, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 40, verify_window="full")
    taught, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 40, verify_window="full",
                           teacher=plain.token_ids)
    assert taught.token_ids == plain.token_ids
    assert (taught.stats.cycles, taught.stats.accepted_drafts) == (plain.stats.cycles, plain.stats.accepted_drafts)


def test_draft_rows_follow_the_teacher_too(pairs):
    pair = pairs("qwen3")
    ids = pair.tokenizer.encode("def add(a, b):")
    teacher = _teacher(pair, ids, 24)
    fin, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 24, verify_window="full",
                        branches=3, teacher=teacher)
    assert fin.stats.branch_rows == 3 and fin.token_ids == teacher


def test_a_teacher_is_for_greedy_runs_only(pairs):
    pair = pairs("qwen3")
    ids = pair.tokenizer.encode("hello")
    with pytest.raises(ValueError, match="greedy"):
        run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 8, temperature=0.7, teacher=[5, 6])


def test_the_first_token_is_the_teachers_too(pairs):
    """The prefill's token (handed out before any cycle) follows the teacher as well."""
    pair = pairs("llama")
    ids = pair.tokenizer.encode("hello world")
    greedy = greedy_reference(pair.target.model, ids, 1)[0]
    eos = set(pair.tokenizer.eos_token_ids)
    teacher = [t for t in range(30, 60) if t != greedy and t not in eos][:12]
    fin, events = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 12, teacher=teacher)
    assert fin.token_ids == teacher and events[0].token_ids[0] == teacher[0]
