"""Losslessness per architecture: DFlash ids == mlx-lm greedy ids, random and oracle drafts."""

from __future__ import annotations

import pytest

from dflash.engine.drafters import OracleDrafter
from helpers import cut_at_eos, greedy_reference, run_dflash
from conftest import ARCHS

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def fibonacci(n):\n    a, b = 0, 1\n",
    "Question: what is the capital of France? Answer:",
]
N_NEW = 72


@pytest.mark.parametrize("arch", ARCHS)
def test_random_draft_equals_greedy(pairs, arch):
    """A random draft is rejected almost always: every cycle exercises the rollback."""
    pair = pairs(arch)
    eos = set(pair.tokenizer.eos_token_ids)
    for prompt in PROMPTS:
        ids = pair.tokenizer.encode(prompt)
        ref = cut_at_eos(greedy_reference(pair.target.model, ids, N_NEW), eos)
        final, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, N_NEW)
        assert final.token_ids == ref, f"{arch}: diverged from mlx-lm greedy on {prompt!r}"
        assert final.stats.cycles >= 1


@pytest.mark.parametrize("arch", ARCHS)
def test_oracle_draft_fills_every_block(pairs, arch):
    """With the target's own ids as draft, each cycle emits the whole block."""
    pair = pairs(arch)
    B = 16
    for prompt in PROMPTS[:2]:
        ids = pair.tokenizer.encode(prompt)
        ref = greedy_reference(pair.target.model, ids, N_NEW + B)
        oracle = OracleDrafter(ref, len(ids), B, vocab_size=pair.target.vocab_size)
        saved, pair.tokenizer.eos_token_ids = pair.tokenizer.eos_token_ids, set()
        try:  # no EOS: measure pure cycle behaviour
            final, _ = run_dflash(
                pair.target, oracle, pair.tokenizer, ids, N_NEW, verify_window="full"
            )
        finally:
            pair.tokenizer.eos_token_ids = saved
        assert final.token_ids == ref[:N_NEW]
        hist = final.stats.accept_histogram
        # every cycle but possibly the last accepts all B-1 drafts
        assert hist[B - 1] >= final.stats.cycles - 1
        assert final.stats.cycles == -(-(N_NEW - 1) // B)  # the fewest cycles N_NEW tokens can take


@pytest.mark.parametrize("arch", ARCHS)
def test_wide_windows_never_change_output(pairs, arch, monkeypatch):
    """DFLASH_WINDOW_WIDE=1 (a GPU's default: the whole block or a plain step, by measurement):
    the same ids, with a draft good enough to draft wide (the reference, wrong at its 5th token)
    and the model's random one."""
    from dflash.daemon.worker import _pair_notes

    monkeypatch.setenv("DFLASH_VERIFY_COST", "0.035,0.3")  # a GPU's verify-cost prior
    monkeypatch.setenv("DFLASH_WINDOW_WIDE", "1")
    pair = pairs(arch)
    notes = _pair_notes(pair)  # dflashd status
    assert "; wide verify windows (the whole block or a plain step, by measurement)" in notes
    ids = pair.tokenizer.encode(PROMPTS[1])
    ref = greedy_reference(pair.target.model, ids, N_NEW + 16)
    eos = set(pair.tokenizer.eos_token_ids)
    oracle = OracleDrafter(ref, len(ids), 16, corrupt_at=(5,), vocab_size=pair.target.vocab_size)
    for drafter in (oracle, pair.drafter):
        final, _ = run_dflash(pair.target, drafter, pair.tokenizer, ids, N_NEW, verify_window="auto")
        assert final.token_ids == cut_at_eos(ref[:N_NEW], eos), f"{arch}: wide windows diverged"
    monkeypatch.setenv("DFLASH_WINDOW_WIDE", "2")
    assert "DFLASH_WINDOW_WIDE must be 0 or 1" in _pair_notes(pair)


@pytest.mark.parametrize("window", ["auto", 1, 2, 5])
def test_verify_window_never_changes_output(pairs, window):
    """Any verify window gives the same ids (1: plain steps, no draft); auto shrinks it when the draft is poor."""
    pair = pairs("qwen3_5")
    ids = pair.tokenizer.encode(PROMPTS[0])
    ref = cut_at_eos(greedy_reference(pair.target.model, ids, N_NEW), set(pair.tokenizer.eos_token_ids))
    final, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, N_NEW, verify_window=window)
    assert final.token_ids == ref
    limit = 16 if window == "auto" else window
    assert final.stats.mean_verify_window <= limit
    if window == "auto":  # a random draft is rejected: the window shrinks, plain steps appear
        assert final.stats.mean_verify_window < 8 and final.stats.plain_steps >= 1
    if window == 1:
        assert final.stats.plain_steps == final.stats.cycles and final.stats.accepted_drafts == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_last_only_logits_equal_full_forward(pairs, arch):
    """Prefill's last-row LM head gives exactly the full forward's last row."""
    import mlx.core as mx

    pair = pairs(arch)
    ids = mx.array(pair.tokenizer.encode(PROMPTS[0]))[None]
    full, f1 = pair.target.forward(ids, pair.target.make_cache())
    last, f2 = pair.target.forward(ids, pair.target.make_cache(), last_only=True)
    assert last.shape[1] == 1
    assert mx.array_equal(full[:, -1:], last) and mx.array_equal(f1, f2)


def test_plain_steps_refused_for_sliding_window_targets(pairs):
    """A ring write of one token cannot be undone: such targets keep every verify window >= 2."""
    pair = pairs("gemma3_text")
    ids = pair.tokenizer.encode(PROMPTS[0])
    with pytest.raises(ValueError, match="sliding-window"):
        run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 8, verify_window=1)
    final, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, N_NEW, verify_window="auto")
    assert final.stats.plain_steps == 0


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_cut_blocks_never_change_output(pairs, arch):
    """A draft that cuts its block to short windows (short_max): same ids at every window."""
    pair = pairs(arch)
    ids = pair.tokenizer.encode(PROMPTS[1])
    ref = cut_at_eos(greedy_reference(pair.target.model, ids, N_NEW), set(pair.tokenizer.eos_token_ids))
    saved, pair.drafter.short_max = pair.drafter.short_max, 4
    try:
        from dflash.daemon.worker import _pair_notes

        assert "; draft blocks cut to the window up to 4 tokens" in _pair_notes(pair)  # dflashd status
        for window in (2, 3, 4, 6, "auto"):
            final, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, N_NEW, verify_window=window)
            assert final.token_ids == ref, f"{arch}: window {window} with cut blocks diverged"
    finally:
        pair.drafter.short_max = saved


@pytest.mark.parametrize("arch", ARCHS)
def test_confidence_windows_never_change_output(pairs, arch, monkeypatch):
    """Greedy windows chosen after the draft by its confidence (DFLASH_WINDOW_CONFIDENCE=1, in the
    model's window mode): whatever window the choice makes, 2 to 16, the ids stay mlx-lm's. Every cycle
    drafts the whole block here and the choice is forced through all windows in turn, since a
    random draft is never confident enough to pick more than 2 itself."""
    from dflash.daemon.worker import _pair_notes
    from dflash.engine.window import VerifyWindow

    monkeypatch.setenv("DFLASH_WINDOW_WIDE", "0")
    monkeypatch.delenv("DFLASH_WINDOW_CONFIDENCE", raising=False)
    pair = pairs(arch)
    assert "confidence" not in _pair_notes(pair)  # off by default
    monkeypatch.setenv("DFLASH_WINDOW_CONFIDENCE", "1")
    assert "; greedy verify windows chosen by the draft's confidence" in _pair_notes(pair)
    picks = iter(range(10**6))
    seen: list[int] = []
    choose = VerifyWindow.after_draft

    def forced(self, confidence):
        assert len(confidence) == 15 and all(0.0 <= c <= 1.0 + 1e-6 for c in confidence)
        seen.append(choose(self, confidence))  # the real choice runs too
        return 2 + next(picks) % 15

    monkeypatch.setattr(VerifyWindow, "_model", lambda self: (16, 2.0))  # always draft whole
    monkeypatch.setattr(VerifyWindow, "after_draft", forced)
    ids = pair.tokenizer.encode(PROMPTS[1])
    ref = greedy_reference(pair.target.model, ids, N_NEW)
    final, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, N_NEW, verify_window="auto")
    assert final.token_ids == cut_at_eos(ref, set(pair.tokenizer.eos_token_ids))
    assert final.stats.confidence_windows == final.stats.cycles > 0 and seen
    assert all(2 <= k <= 16 for k in seen)
    monkeypatch.setenv("DFLASH_WINDOW_CONFIDENCE", "yes")
    assert "DFLASH_WINDOW_CONFIDENCE must be 0 or 1" in _pair_notes(pair)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bfloat16_target_equals_greedy(tiny_dirs, arch):
    """A bfloat16 target (as most served models are): mlx-lm's greedy sampler takes the argmax of
    logits - logsumexp in bfloat16, where two close logits can round to one log-prob and the lower
    id wins; the random tiny targets are flat enough for that to happen within 40 tokens on most
    of these prompts. Every prompt's ids equal mlx-lm's, the first token and the verified ones."""
    import mlx.core as mx

    from dflash.engine.loading import load_pair

    pair = load_pair(tiny_dirs[arch], tiny_dirs[arch] / "draft")  # not the shared fp32 fixture
    pair.target.model.set_dtype(mx.bfloat16)
    for seed in range(12):
        ids = mx.random.randint(0, 400, (8,), key=mx.random.key(seed)).tolist()
        ref = cut_at_eos(greedy_reference(pair.target.model, ids, 40), set(pair.tokenizer.eos_token_ids))
        final, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 40)
        assert final.token_ids == ref, f"{arch}: diverged from mlx-lm greedy (bfloat16) on {ids}"
