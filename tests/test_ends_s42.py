"""Stop strings at the end of generation's text: a teacher (generate.py's `teacher`) makes the run
emit exactly the ids we choose, so a stop string can fall where the detokenizer writes text late.

Three cuts used to leave a stop string, or its start, in the text: one token's text holding two
stop strings was cut at the first in the list, not the earliest in the text; text the detokenizer
held until its final flush (the tiny models' byte-level BPE holds a lone space until the next
token) was never looked at for stop strings, so a run ending by max_tokens or EOS just after it
kept it; and text shorter than the hold-back (the longest stop string less one character) was
released in part (a negative slice), so a stop string starting there could no longer be cut."""

from __future__ import annotations

import pytest

from dflash.engine.generate import Finished, stream_dflash_generate


@pytest.fixture(scope="module")
def pair(pairs):
    return pairs("qwen3")


def _run(pair, ids, max_tokens, stop):
    prompt = pair.tokenizer.encode("The quick brown")
    events = list(stream_dflash_generate(pair.target, pair.drafter, pair.tokenizer, prompt, max_tokens,
                                         teacher=ids, stop=stop, verify_window="full"))
    final = events[-1]
    assert isinstance(final, Finished)
    deltas = events[:-1]
    assert "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids
    return final


def test_earliest_of_two_stops_in_one_token_cuts(pair):
    tok = pair.tokenizer
    ids = tok.encode("hello quick fox")
    assert " qu" in [tok.decode([i]) for i in ids]  # one token holds both stops below
    final = _run(pair, ids, 20, ["u", " q"])
    assert final.text == "hello"
    assert final.stats.finish_reason == "stop"


@pytest.mark.parametrize("end", ["length", "eos"])
def test_stop_in_text_the_final_flush_writes(pair, end):
    tok = pair.tokenizer
    ids = tok.encode("hello ")
    assert tok.decode(ids[-1:]) == " "  # a lone space: the detokenizer holds it to the end
    if end == "eos":
        ids = ids + [next(iter(tok.eos_token_ids))]
    final = _run(pair, ids, len(tok.encode("hello ")) if end == "length" else 20, [" "])
    assert final.text == "hello"
    assert final.token_ids == tok.encode("hello ")
    assert final.stats.finish_reason == "stop"


@pytest.mark.parametrize("window", [1, 3, "full"])
def test_text_shorter_than_the_hold_back_stays_held(pair, window):
    """A stop string's first characters come before the text is as long as the hold-back (the
    longest stop less one): nothing of them goes out (a negative slice let a prefix go)."""
    tok = pair.tokenizer
    ids = tok.encode("hello quick fox")
    assert tok.decode(ids[:1]) == "he"
    prompt = tok.encode("The quick brown")
    events = list(stream_dflash_generate(pair.target, pair.drafter, tok, prompt, 20, teacher=ids,
                                         stop=["ox j", "hell"], verify_window=window))
    final = events[-1]
    assert final.text == "" and final.stats.finish_reason == "stop"
    assert "".join(d.text for d in events[:-1]) == ""
