"""Text deltas at a cut multi-byte character: the tiny models' byte-level BPE spells an emoji as
four byte tokens, and a teacher (generate.py's `teacher`) makes the run emit exactly the ids we
choose, so max_tokens, an end-of-sequence id or a cancel can fall inside the character.

Each delta carries the ids whose text it releases: ids whose bytes the detokenizer still holds
wait for the delta that writes their text. The text and ids, concatenated, are the Finished ones
and mlx-lm's stream_generate's for the same ids (its detokenizer writes a cut character as
U+FFFD). What changed: when generation ended in a cycle with ids (max_tokens), that flush arrived
as a last delta of text with no ids; it joined that cycle's delta. When the last cycle brought no
ids (an EOS first in its cycle, a cancel) the flush still came alone, text without the ids that
wrote it, in the engine's events and in the daemon's stream: now it carries them there too.

The daemon cannot be given a teacher, so its tests run a "bigram" tiny model: every layer's
output projection zeroed, the next token is a chosen function of the last one alone."""

from __future__ import annotations

import itertools
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate

from daemon_fixtures import Daemon
from dflash.engine.generate import Finished, TokenDelta, stream_dflash_generate
from dflash.engine.tiny import build_draft, build_target

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


def _check(final, deltas, byte_ids: set[int] = frozenset()) -> None:
    """Concatenations equal the Finished ones; every delta carries ids, the last one included;
    the bytes of a character (`byte_ids`) travel with the delta holding its text (the character,
    or U+FFFD for a cut one), never ahead of it in a delta without it."""
    assert "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids
    assert all(len(d.from_draft) == len(d.token_ids) for d in deltas)
    for d in deltas:
        assert d.token_ids, f"a delta of text without the ids that wrote it: {d}"
        if byte_ids & set(d.token_ids):
            assert "\ufffd" in d.text or "\U0001f600" in d.text, f"bytes' ids ahead of their text: {d}"


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
        _check(final, deltas, set(ids[first_byte:first_byte + 4]))
        assert (final.text, final.token_ids) == _mlx_lm(pair, prompt, ids, max_tokens)
        if first_byte <= max_tokens - 1 < first_byte + 3:  # cut inside the emoji
            assert final.text.endswith("\ufffd") and deltas[-1].text.endswith("\ufffd")
            assert deltas[-1].token_ids[-(max_tokens - first_byte):] == ids[first_byte:max_tokens]
        # at most one delta per cycle, the first token's included (a cycle of held bytes has none)
        assert len(deltas) <= final.stats.cycles + 1


def test_end_of_sequence_right_after_a_partial_character(setup):
    """EOS first in its cycle (plain decoding: every cycle is one token) after the emoji's first
    bytes: the text and ids are mlx-lm's, the cut character's U+FFFD last, with those bytes' ids."""
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
    _check(final, deltas, set(ids[first_byte:first_byte + 4]))
    assert (final.text, final.token_ids) == want and final.text.endswith("\ufffd")
    # the flush: the space the detokenizer held before the emoji, then its cut first bytes
    assert deltas[-1].text == " \ufffd" and deltas[-1].token_ids == ids[first_byte - 1:eos_at]


def test_cancel_after_a_partial_character(setup):
    pair, prompt, ids = setup
    first_byte = next(i for i, t in enumerate(ids) if pair.tokenizer.decode([t]) == "\ufffd")
    asked = itertools.count(1)  # asked before each cycle: the n-th time, n tokens are committed
    events = list(stream_dflash_generate(pair.target, pair.drafter, pair.tokenizer, prompt, 32, teacher=ids,
                                         verify_window=1, should_cancel=lambda: next(asked) > first_byte + 1))
    final, deltas = events[-1], events[:-1]
    assert final.stats.finish_reason == "cancelled" and final.token_ids == ids[:first_byte + 2]
    _check(final, deltas, set(ids[first_byte:first_byte + 4]))
    assert final.text == pair.tokenizer.decode(final.token_ids) and final.text.endswith("\ufffd")
    assert deltas[-1].text == " \ufffd" and deltas[-1].token_ids == final.token_ids[first_byte - 1:]


# --- through the daemon's stream, as a client sees it -------------------------------------------
def _bigram_target(d: Path, successor: dict[str, str]) -> list[int]:
    """A tiny llama whose next token depends on the last token only: `successor` maps a token to
    the one that follows it (greedy). The mapped tokens get orthonormal embeddings and every
    layer's output projection is zero, so the hidden state is the last token's embedding and
    only the successor's lm_head row points along it. Returns the mapped tokens' ids in order."""
    from tokenizers import Tokenizer

    build_target(d, "llama")
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tid = {t: tok.token_to_id(t) for t in {*successor, *successor.values()}}
    w = dict(mx.load(str(d / "model.safetensors")))
    hidden = w["model.embed_tokens.weight"].shape[1]
    embed, head = w["model.embed_tokens.weight"], mx.zeros_like(w["lm_head.weight"])
    basis = mx.eye(hidden)
    for i, t in enumerate(successor):
        embed[tid[t]] = basis[i] * 8.0
    for i, n in enumerate(successor.values()):
        head[tid[n]] = head[tid[n]] + basis[i] * 10.0
    w["model.embed_tokens.weight"], w["lm_head.weight"] = embed, head
    for k in w:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            w[k] = mx.zeros_like(w[k])
    mx.save_safetensors(str(d / "model.safetensors"), w)
    build_draft(d / "draft", d)
    return [tid[t] for t in successor]


EOS = "<|im_end|>"


@pytest.fixture(scope="module")
def bigram(tmp_path_factory):
    """Q -> a -> 0xF0 (a character's first byte) -> EOS; Z -> b -> c -> 0xE2 -> 0xE2 -> ...
    (never a whole character: the detokenizer holds every byte until the end)."""
    d = tmp_path_factory.mktemp("bigram")
    ids = _bigram_target(d, {"Q": "a", "a": "ð", "ð": EOS, "Z": "b", "b": "c", "c": "â", "â": "â"})
    return d, dict(zip(["Q", "a", "F0", "Z", "b", "c", "E2"], ids))


def test_bigram_model_writes_what_it_was_built_to(bigram):
    from dflash.engine.loading import load_pair

    d, t = bigram
    pair = load_pair(d, d / "draft")
    events = list(stream_dflash_generate(pair.target, pair.drafter, pair.tokenizer, [t["Q"]], 8, verify_window=1))
    assert events[-1].token_ids == [t["a"], t["F0"]] and events[-1].stats.finish_reason == "stop"
    assert events[-1].text == "a\ufffd"
    _check(events[-1], events[:-1], {t["F0"]})
    assert [(e.text, e.token_ids) for e in events[:-1]] == [("a", [t["a"]]), ("\ufffd", [t["F0"]])]


@pytest.fixture(scope="module")
def daemon(bigram):
    d, _ = bigram
    dm = Daemon(str(d), str(d / "draft"), cache=False)
    try:
        yield dm.start()
    finally:
        dm.stop()


def test_daemon_stream_eos_first_in_its_cycle(daemon, bigram):
    """Plain decoding: the EOS is the whole of its cycle, right after a character's first byte."""
    _, t = bigram
    with daemon.client(timeout=30) as c:
        s = c.stream([t["Q"]], max_tokens=16, verify_window=1)
        deltas = list(s)
    assert s.result.finish_reason == "stop" and s.result.token_ids == [t["a"], t["F0"]]
    _check(s.result, deltas, {t["F0"]})
    assert [(d.text, d.token_ids) for d in deltas] == [("a", [t["a"]]), ("\ufffd", [t["F0"]])]


def test_daemon_stream_cancelled_mid_character(daemon, bigram):
    """Cancelled while the detokenizer holds bytes: the last delta brings their text and ids.
    Z -> b -> c, then 0xE2 bytes with no text until the end. The cancel lands between decode
    cycles, at whichever one the worker has reached: a job cancelled before its first byte is
    tried again (the worker decodes a cycle in a millisecond, a cancel takes a round trip)."""
    _, t = bigram
    tries = []
    with daemon.client(timeout=30) as c:
        while len(tries) < 20:
            s = c.stream([t["Z"]], max_tokens=4000, verify_window=1)
            it = iter(s)
            head = [next(it), next(it)]
            assert [(d.text, d.token_ids) for d in head] == [("b", [t["b"]]), ("c", [t["c"]])]
            assert c.cancel(s.job_id)["cancelled"] is True
            deltas = [*head, *it]
            res = s.result
            assert res.finish_reason == "cancelled" and len(res.token_ids) < 4000
            _check(res, deltas, {t["E2"]})
            tries.append(len(res.token_ids))
            if len(res.token_ids) > 2:
                break
    assert len(res.token_ids) > 2, f"never cancelled after a byte in {tries}"
    assert set(res.token_ids[2:]) == {t["E2"]}
    assert deltas[-1].token_ids == res.token_ids[2:] and deltas[-1].text == "\ufffd" * (len(res.token_ids) - 2)


@pytest.mark.parametrize("max_tokens", [2, 16])  # max_tokens or the EOS ends it
def test_daemon_stream_stop_string_in_the_final_flush(daemon, bigram, max_tokens):
    """Q -> a -> 0xF0: the byte's U+FFFD is written by the detokenizer's final flush only, which
    was never looked at for stop strings: a stop string there stayed in the text."""
    _, t = bigram
    with daemon.client(timeout=30) as c:
        s = c.stream([t["Q"]], max_tokens=max_tokens, verify_window=1, stop=["\ufffd"])
        deltas = list(s)
    assert s.result.token_ids == [t["a"], t["F0"]]
    assert s.result.text == "a" and s.result.finish_reason == "stop"
    assert "".join(d.text for d in deltas) == "a"
    assert [x for d in deltas for x in d.token_ids] == s.result.token_ids
