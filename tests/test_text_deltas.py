"""Text deltas at a cut multi-byte character: the tiny models' byte-level BPE spells an emoji as
four byte tokens, and a teacher (generate.py's `teacher`) makes the run emit exactly the ids we
choose, so max_tokens, an end-of-sequence id or a cancel can fall inside the character.

Each delta keeps one cycle's ids; the text and ids, concatenated, are the Finished ones and
mlx-lm's stream_generate's for the same ids (its detokenizer writes a cut character as U+FFFD).
What changed: when generation ended in a cycle with ids (max_tokens), that flush arrived as a
last delta of text with no ids; it now joins that cycle's delta. When the last cycle brought no
ids (an EOS first in its cycle, a cancel) the flush still comes alone: holding deltas back for it
would delay streamed text every cycle."""

from __future__ import annotations

import itertools

import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate

from dflash.engine.generate import Finished, TokenDelta, stream_dflash_generate

TEXT = "a 😀 b"


def _mlx_lm(pair, prompt: list[int], ids: list[int], max_tokens: int) -> tuple[str, list[int]]:
    """mlx-lm's own streamed text and ids when its sampler picks `ids` in turn."""
    forced = itertools.chain(ids, itertools.repeat(ids[0]))

    def sampler(logprobs: mx.array) -> mx.array:
        return mx.array([next(forced)], dtype=mx.uint32)

    text, out = "", []
    for r in stream_generate(pair.target.model, pair.tokenizer, mx.array(prompt), max_tokens=max_tokens,
                             sampler=sampler):
        text += r.text
        if r.token not in pair.tokenizer.eos_token_ids:
            out.append(r.token)
    return text, out[: max_tokens]


def _run(pair, prompt, ids, max_tokens, **kw) -> tuple[Finished, list[TokenDelta]]:
    events = list(stream_dflash_generate(pair.target, pair.drafter, pair.tokenizer, prompt, max_tokens,
                                         teacher=ids, **kw))
    assert isinstance(events[-1], Finished)
    return events[-1], events[:-1]


def _check(final: Finished, deltas: list[TokenDelta], flush_alone: bool = False) -> None:
    """Concatenations equal the Finished ones; every delta carries ids, except (flush_alone)
    a last one holding only the detokenizer's flush."""
    assert "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids
    assert all(len(d.from_draft) == len(d.token_ids) for d in deltas)
    body = deltas[:-1] if flush_alone and not deltas[-1].token_ids else deltas
    if body is not deltas:
        assert deltas[-1].text.endswith("\ufffd"), deltas[-1]  # what the detokenizer still held
    for d in body:
        assert d.token_ids, f"a delta of text without the ids that wrote it: {d}"


@pytest.fixture(scope="module")
def setup(pairs):
    pair = pairs("qwen3")
    ids = pair.tokenizer.encode(TEXT)
    pieces = [pair.tokenizer.decode([i]) for i in ids]
    assert sum(p == "\ufffd" for p in pieces) == 4, pieces  # the emoji: four byte tokens
    return pair, pair.tokenizer.encode("The quick brown"), ids


@pytest.mark.parametrize("window", [1, "full"])
def test_max_tokens_inside_a_character(setup, window):
    pair, prompt, ids = setup
    first_byte = next(i for i, t in enumerate(ids) if pair.tokenizer.decode([t]) == "\ufffd")
    for max_tokens in range(1, len(ids) + 1):
        final, deltas = _run(pair, prompt, ids, max_tokens, verify_window=window)
        assert final.token_ids == ids[:max_tokens]
        _check(final, deltas)
        assert (final.text, final.token_ids) == _mlx_lm(pair, prompt, ids, max_tokens)
        if first_byte <= max_tokens - 1 < first_byte + 3:  # cut inside the emoji
            assert final.text.endswith("\ufffd") and deltas[-1].text.endswith("\ufffd")
        # one delta per cycle, the first token's included
        assert len(deltas) == final.stats.cycles + 1


def test_end_of_sequence_right_after_a_partial_character(setup):
    """EOS first in its cycle (plain decoding: every cycle is one token) after the emoji's first
    bytes: the text and ids are mlx-lm's, the cut character's U+FFFD last, in a delta of its own."""
    pair, prompt, ids = setup
    first_byte = next(i for i, t in enumerate(ids) if pair.tokenizer.decode([t]) == "\ufffd")
    eos_at = first_byte + 2
    saved = pair.tokenizer.eos_token_ids
    pair.tokenizer.eos_token_ids = {ids[eos_at]}
    try:
        final, deltas = _run(pair, prompt, ids, 32, verify_window=1)
        want = _mlx_lm(pair, prompt, ids, 32)
    finally:
        pair.tokenizer.eos_token_ids = saved
    assert final.token_ids == ids[:eos_at] and final.stats.finish_reason == "stop"
    _check(final, deltas, flush_alone=True)
    assert (final.text, final.token_ids) == want and final.text.endswith("\ufffd")


def test_cancel_after_a_partial_character(setup):
    pair, prompt, ids = setup
    first_byte = next(i for i, t in enumerate(ids) if pair.tokenizer.decode([t]) == "\ufffd")
    seen: list[int] = []
    events = []
    gen = stream_dflash_generate(pair.target, pair.drafter, pair.tokenizer, prompt, 32, teacher=ids,
                                 verify_window=1, should_cancel=lambda: len(seen) >= first_byte + 2)
    for ev in gen:
        events.append(ev)
        if isinstance(ev, TokenDelta):
            seen.extend(ev.token_ids)
    final, deltas = events[-1], events[:-1]
    assert final.stats.finish_reason == "cancelled"
    _check(final, deltas, flush_alone=True)
    assert final.text == pair.tokenizer.decode(final.token_ids) and final.text.endswith("\ufffd")
