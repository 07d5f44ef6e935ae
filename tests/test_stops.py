"""Stopping: EOS inside an accepted block, stop strings, and max_tokens are exact."""

from __future__ import annotations

import pytest

from dflash.engine.drafters import OracleDrafter
from helpers import greedy_reference, run_dflash

PROMPT = "The quick brown fox jumps over the lazy dog. The quick"


PROMPTS = [PROMPT, "def fibonacci(n):\n    a, b = 0, 1\n", "1 2 3 4 5 6 7 8 9 10 11", "Question: what"]


def _prompt_with_fresh_token(pair, lo: int, hi: int) -> tuple[list[int], list[int], int]:
    """A prompt whose greedy output has, at index lo..hi, a token not seen before it."""
    for prompt in PROMPTS:
        ids = pair.tokenizer.encode(prompt)
        ref = greedy_reference(pair.target.model, ids, 80)
        for j in range(lo, hi):
            if ref[j] not in ref[:j]:
                return ids, ref, j
    pytest.skip("no prompt gives a fresh token to use as EOS")


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_eos_inside_accepted_block_ends_output(pairs, arch):
    pair = pairs(arch)
    ids, ref, j = _prompt_with_fresh_token(pair, 18, 60)  # inside a later cycle's block
    oracle = OracleDrafter(ref, len(ids), 16, vocab_size=pair.target.vocab_size)
    saved, pair.tokenizer.eos_token_ids = pair.tokenizer.eos_token_ids, {ref[j]}
    try:
        final, _ = run_dflash(pair.target, oracle, pair.tokenizer, ids, 80)
    finally:
        pair.tokenizer.eos_token_ids = saved
    assert final.token_ids == ref[:j]
    assert final.stats.finish_reason == "stop"


@pytest.mark.parametrize("max_tokens", [1, 2, 15, 16, 17, 33])
def test_max_tokens_is_exact(pairs, max_tokens):
    pair = pairs("qwen3")
    ids = pair.tokenizer.encode(PROMPT)
    ref = greedy_reference(pair.target.model, ids, 40)
    oracle = OracleDrafter(ref, len(ids), 16, vocab_size=pair.target.vocab_size)
    saved, pair.tokenizer.eos_token_ids = pair.tokenizer.eos_token_ids, set()
    try:
        final, events = run_dflash(pair.target, oracle, pair.tokenizer, ids, max_tokens)
    finally:
        pair.tokenizer.eos_token_ids = saved
    assert final.token_ids == ref[:max_tokens]
    assert sum(len(e.token_ids) for e in events) == max_tokens
    assert final.stats.finish_reason == "length"


def test_stop_string_truncates_text(pairs):
    pair = pairs("qwen3")
    tok = pair.tokenizer
    ids = tok.encode(PROMPT)
    ref = greedy_reference(pair.target.model, ids, 40)
    full = tok.decode(ref)
    if len(full) < 12:
        pytest.skip("reference text too short")
    stop = full[8:11]
    first = full.find(stop)
    saved, tok.eos_token_ids = tok.eos_token_ids, set()
    try:
        final, events = run_dflash(pair.target, pair.drafter, tok, ids, 40, stop=[stop])
    finally:
        tok.eos_token_ids = saved
    assert final.text == full[:first]
    assert "".join(e.text for e in events) == final.text
    assert final.stats.finish_reason == "stop"


def test_streamed_text_matches_decode(pairs):
    pair = pairs("llama")
    tok = pair.tokenizer
    ids = tok.encode(PROMPT)
    final, events = run_dflash(pair.target, pair.drafter, tok, ids, 48)
    assert "".join(e.text for e in events) == final.text
    # the same text mlx-lm's streaming detokenizer makes of these ids in one go
    detok = tok.detokenizer
    detok.reset()
    for t in final.token_ids:
        detok.add_token(t)
    detok.finalize()
    assert final.text == detok.text


def test_bad_arguments_are_refused(pairs):
    pair = pairs("qwen3")
    with pytest.raises(ValueError, match="empty prompt"):
        run_dflash(pair.target, pair.drafter, pair.tokenizer, [], 8)
    with pytest.raises(ValueError, match="max_tokens"):
        run_dflash(pair.target, pair.drafter, pair.tokenizer, [1, 2], 0)
