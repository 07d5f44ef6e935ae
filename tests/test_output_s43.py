"""Where a generation's ids end at a stop string, and how error messages echo huge values.

Ids: a token whose text completes a stop string is the last id kept (its text cut), whatever the
detokenizer does. The tiny models' byte-level BPE holds a lone space (and a character's first
bytes) until the next token; when that held text completed the stop, the next token's id was
kept and counted too, though none of its text is in the output (also its from-draft flag). A
teacher (generate.py's `teacher`) makes the run emit exactly the ids we choose; the daemon and
the command line cannot be given one, so they run a "bigram" tiny model that writes "ba x".

Messages: a value of 10**300 (a seed, a context size) was echoed as a 301-digit number; past
4300 digits Python will not write an int at all, and an int past float's range made the
finiteness checks raise OverflowError instead of saying no.
"""

from __future__ import annotations

import json
import itertools

import pytest
from click.testing import CliRunner

from daemon_fixtures import Daemon, raw_request
from dflash.client.errors import DFlashError
from dflash.daemon import protocol as P
from dflash.engine.generate import Finished, prompt_ids, stream_dflash_generate
from dflash.engine.processors import ProcessorParams
from dflash.engine.sampling import SamplingParams
from test_text_deltas import EOS, _bigram_target

BIG = 10**300
CLIPPED = "1000000000000000000…(301 digits)"


@pytest.fixture(scope="module")
def pair(pairs):
    return pairs("qwen3")


def _run(pair, ids, max_tokens=20, stop=(), prompt="The quick brown", **kw) -> Finished:
    """The run that emits `ids`; checks that the deltas add up to the Finished text and ids."""
    tok = pair.tokenizer
    events = list(stream_dflash_generate(pair.target, pair.drafter, tok, tok.encode(prompt), max_tokens,
                                         teacher=ids, stop=stop, **kw))
    final, deltas = events[-1], events[:-1]
    assert isinstance(final, Finished)
    assert "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids
    assert final.stats.generated_tokens == len(final.token_ids)
    assert final.stats.accepted_drafts == sum(f for d in deltas for f in d.from_draft)
    assert final.stats.copy_accepted <= final.stats.accepted_drafts
    return final


def _pieces(pair, text: str) -> list[str]:
    return [pair.tokenizer.decode([i]) for i in pair.tokenizer.encode(text)]


# --- ids end at the token that completed the stop string ---------------------------------------
def test_the_token_completing_a_stop_is_the_last_id(pair):
    """The ordinary case, the contract: " qu" completes " q"; its id stays, its text is cut."""
    ids = pair.tokenizer.encode("hello quick")
    assert _pieces(pair, "hello quick")[3] == " qu"
    final = _run(pair, ids, stop=[" q"], verify_window="full")
    assert final.text == "hello" and final.token_ids == ids[:4] and final.stats.finish_reason == "stop"


@pytest.mark.parametrize("window", [1, 3, "full"])
def test_a_stop_the_held_space_completes_ends_at_the_space(pair, window):
    """"o " ends at the lone space, which the detokenizer writes only with "x": "x" used to be
    kept and counted (5 ids for 4)."""
    tok = pair.tokenizer
    ids = tok.encode("hello x")
    assert _pieces(pair, "hello x")[3:] == [" ", "x"]
    final = _run(pair, ids, stop=["o "], verify_window=window)
    assert final.text == "hell" and final.stats.finish_reason == "stop"
    assert final.token_ids == tok.encode("hello ")


def test_a_stop_the_next_token_completes_keeps_it(pair):
    """" x" needs "x": its id stays, as in the ordinary case."""
    ids = pair.tokenizer.encode("hello x")
    final = _run(pair, ids, stop=[" x"], verify_window="full")
    assert final.text == "hello" and final.token_ids == ids


@pytest.mark.parametrize("window", [1, "full"])
def test_a_stop_before_a_characters_bytes_drops_them(pair, window):
    """The held space, then an emoji's four byte tokens (held until the fourth): all four ids
    came after the stop and were kept."""
    tok = pair.tokenizer
    ids = tok.encode("hello \U0001f600")
    assert _pieces(pair, "hello \U0001f600")[3:] == [" "] + ["\ufffd"] * 4
    final = _run(pair, ids, stop=["o "], verify_window=window)
    assert final.text == "hell" and final.token_ids == tok.encode("hello ")


def test_a_stop_in_the_final_flush_drops_the_cut_bytes_after_it(pair):
    """max_tokens ends inside the emoji: the flush writes " \ufffd"; the stop ends at the space."""
    tok = pair.tokenizer
    ids = tok.encode("hello \U0001f600")
    final = _run(pair, ids, max_tokens=6, stop=["o "], verify_window=1)
    assert final.text == "hell" and final.stats.finish_reason == "stop"
    assert final.token_ids == tok.encode("hello ")


def test_a_cancel_with_the_stop_in_the_flush_counts_the_ids_it_returns(pair):
    """Cancelled after the space and two bytes: the flush finds the stop and drops the bytes;
    the stats (counted before that flush, so two more than the ids) now count the ids returned."""
    tok = pair.tokenizer
    ids = tok.encode("hello \U0001f600")
    asked = itertools.count(1)  # asked before each plain step: the n-th time, n tokens are committed
    final = _run(pair, ids, stop=["o "], verify_window=1, should_cancel=lambda: next(asked) > 5)
    assert final.stats.finish_reason == "cancelled"
    assert final.text == "hell" and final.token_ids == tok.encode("hello ")


@pytest.mark.parametrize("window", [4, "full"])
def test_an_accepted_draft_past_the_stop_does_not_count(pair, window):
    """The text repeats the prompt, so a copy draft proposes " ", "x" and both are accepted in
    one cycle: "x" is past the stop, and was counted as an accepted draft."""
    tok = pair.tokenizer
    final = _run(pair, tok.encode("hello x hello x"), stop=["o "], verify_window=window,
                 prompt="hello x hello x hello x hello x")
    assert final.token_ids == tok.encode("hello ") and final.text == "hell"
    assert final.stats.copy_cycles >= 1 and final.stats.accepted_drafts == 1


@pytest.mark.parametrize("tail", ["eos_after_x", "eos_after_space"])
def test_an_end_of_sequence_in_the_block_of_the_stop(pair, tail):
    """EOS in the same verified block as the stop: whichever comes first ends it, and the ids,
    their count and the text agree (EOS itself is never an id)."""
    tok = pair.tokenizer
    eos = next(iter(tok.eos_token_ids))
    head = tok.encode("hello ")
    ids = [*head, *tok.encode("x"), eos] if tail == "eos_after_x" else [*head, eos, *tok.encode("x")]
    final = _run(pair, ids, stop=["o "], verify_window="full")
    assert final.text == "hell" and final.token_ids == head and final.stats.finish_reason == "stop"


# --- the same through the daemon and the command line -------------------------------------------
@pytest.fixture(scope="module")
def bigram(tmp_path_factory):
    """Q -> b -> a -> " " -> x -> EOS: the text "ba x", the space held until "x"."""
    d = tmp_path_factory.mktemp("bigram43")
    ids = _bigram_target(d, {"Q": "b", "b": "a", "a": "Ġ", "Ġ": "x", "x": EOS})
    return d, dict(zip(["Q", "b", "a", "space", "x"], ids))


@pytest.fixture(scope="module")
def daemon(bigram):
    d, _ = bigram
    dm = Daemon(str(d), str(d / "draft"), cache=False)
    try:
        yield dm.start()
    finally:
        dm.stop()


def test_daemon_stream_and_usage_end_at_the_stop(daemon, bigram):
    _, t = bigram
    want = [t["b"], t["a"], t["space"]]
    with daemon.client(timeout=30) as c:
        whole = c.generate([t["Q"]], max_tokens=16, verify_window=1)
        assert whole.text == "ba x" and whole.token_ids == [*want, t["x"]]  # the model writes what it was built to
        s = c.stream([t["Q"]], max_tokens=16, verify_window=1, stop=["a "])
        deltas = list(s)
    res = s.result
    assert res.text == "b" and res.finish_reason == "stop"
    assert res.token_ids == want and [x for d in deltas for x in d.token_ids] == want
    assert res.stats["generated_tokens"] == 3


def test_generate_command_ends_at_the_stop(bigram):
    from dflash.engine.cli import main

    d, t = bigram
    res = CliRunner(env={"DFLASH_BLAS": "none"}).invoke(main, [
        "generate", "--model", str(d), "--draft", str(d / "draft"), "-p", "Q", "--raw", "--stop", "a ",
        "-m", "16", "--verify-window", "1", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["text"] == "b" and out["token_ids"] == [t["b"], t["a"], t["space"]]
    assert out["stats"]["generated_tokens"] == 3


# --- error messages clip huge values ------------------------------------------------------------
def test_shown_clips_numbers_and_long_text():
    assert P.shown(BIG) == CLIPPED and P.shown(-BIG) == "-" + CLIPPED
    assert P.shown((1 << 64) - 1) == "18446744073709551615" and P.shown(1.5) == "1.5"
    assert P.shown(10**5000) == "a number of about 5001 digits"  # str() refuses past 4300 digits
    long = P.shown("j" * 1000)
    assert long.startswith("'jjj") and long.endswith("…(1002 characters)") and len(long) <= 64
    assert P.shown([10**5000]) == "a list"


@pytest.mark.parametrize("problem, field, allowed", [
    (lambda: P.sampling_problem(seed=BIG), "seed", "0..2^64-1"),
    (lambda: P.sampling_problem(seed=-BIG), "seed", "0..2^64-1"),
    (lambda: P.sampling_problem(top_k=-BIG), "top_k", ">= 0"),
    (lambda: P.sampling_problem(min_tokens_to_keep=BIG), "min_tokens_to_keep", "at most 2^64-1"),
    (lambda: P.sampling_problem(temperature=BIG * 10**100), "temperature", ">= 0"),
    (lambda: P.processors_problem({"repetition_context_size": BIG}), "repetition_context_size", "at most 2^64-1"),
    (lambda: P.processors_problem({"presence_penalty": BIG * 10**100}), "presence_penalty", "finite"),
    (lambda: P.processors_problem({"logit_bias": {"1": BIG * 10**100}}), "logit_bias", "finite"),
])
def test_protocol_messages_name_the_field_and_range_not_every_digit(problem, field, allowed):
    name, message = problem()
    assert name == field and message.startswith(field) and allowed in message
    assert "digits)" in message and len(message) < 160, message


def test_protocol_refusals_of_long_text_are_short():
    with pytest.raises(P.ProtocolError) as e:
        P.check_job_id("j" * 100_000)
    assert e.value.param == "job_id" and "1-64 characters" in e.value.message and len(e.value.message) < 160
    problem = P.verify_window_problem("x" * 100_000)
    assert problem.startswith("verify_window") and len(problem) < 160
    with pytest.raises(P.ProtocolError) as e:
        P.parse_request({"v": P.VERSION, "op": "submit", "text": "hi", "k" * 100_000: 1})
    assert e.value.message.startswith("unknown field(s)") and len(e.value.message) < 160


@pytest.mark.parametrize("make, field", [
    (lambda: SamplingParams(seed=BIG), "seed"),
    (lambda: SamplingParams(temperature=1.0, top_k=-BIG), "top_k"),
    (lambda: SamplingParams(temperature=BIG * 10**100), "temperature"),  # was OverflowError
    (lambda: ProcessorParams(repetition_context_size=-BIG), "repetition_context_size"),
    (lambda: ProcessorParams(presence_penalty=BIG * 10**100), "presence_penalty"),  # was OverflowError
    (lambda: ProcessorParams(logit_bias={"9" * 5000: 1.0}), "logit_bias"),  # was int()'s own ValueError
])
def test_engine_checks_clip_huge_values(make, field):
    with pytest.raises(ValueError) as e:
        make()
    message = str(e.value)
    assert message.startswith(field) and len(message) < 160, message


def test_engine_generation_checks_clip_huge_values(pair):
    with pytest.raises(ValueError, match=r"^token id 1000000000000000000…\(301 digits\) is outside") as e:
        prompt_ids(pair.tokenizer, [BIG], pair.target.vocab_size)
    with pytest.raises(ValueError, match="^max_tokens must be >= 1") as e:
        next(stream_dflash_generate(pair.target, pair.drafter, pair.tokenizer, [1, 2], -BIG))
    assert str(e.value).endswith("-" + CLIPPED)


def test_daemon_refusals_clip_huge_values(daemon, bigram):
    """Through the real client (which checks a submit by the daemon's rules before sending it)
    and a raw frame to the worker."""
    _, t = bigram
    with daemon.client(timeout=30) as c:
        with pytest.raises(DFlashError) as e:
            c.generate([t["Q"]], max_tokens=4, temperature=1.0, seed=BIG)
    assert e.value.param == "seed" and str(e.value).count("0") < 40 and CLIPPED in str(e.value)
    reply = raw_request(daemon.endpoint, {"v": P.VERSION, "op": "submit", "token_ids": [t["Q"]],
                                          "job_id": "j" * 100_000})
    assert reply["type"] == "error" and reply["param"] == "job_id" and len(reply["message"]) < 160


def test_generate_command_clips_a_long_bias_flag(bigram):
    from dflash.engine.cli import main

    d, _ = bigram
    res = CliRunner(env={"DFLASH_BLAS": "none"}).invoke(main, [
        "generate", "--model", str(d), "--draft", str(d / "draft"), "-p", "Q", "--raw",
        "--logit-bias", "1" * 5000 + "=1"])
    assert res.exit_code == 2 and "is not ID=BIAS" in res.output and "(5004 characters)" in res.output
    assert len(res.output) < 1000, res.output
