"""Logits processors (logit bias, repetition / presence / frequency penalties) are mlx-lm's.

Greedy: DFlash's ids equal mlx_lm's generate_step with the same `make_logits_processors`, on
every family, with the random draft (rejections, rollback), an oracle fed the processed answer
(whole blocks kept: each row judged with the drafts before it in its history) and one that is
wrong at its 5th token; sampled: the same distribution (tests/test_sampling_dist.py style);
bad values: a ValueError before any work.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_logits_processors

from conftest import ARCHS
from dflash.engine.drafters import OracleDrafter
from dflash.engine.processors import LogitsProcessors, ProcessorParams
from helpers import cut_at_eos, greedy_reference, run_dflash

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
N_NEW = 40


def _settings(ids: list[int], plain: list[int]) -> dict[str, dict]:
    """Settings that change the greedy answer: a bias that forces a token, one that bans the
    plain answer's first tokens, each penalty (also with a short window) and all together."""
    banned = {str(t): -100.0 for t in dict.fromkeys(plain[:6])}
    return {
        "force": {"logit_bias": {plain[3]: 100.0}},
        "ban": {"logit_bias": banned},
        "repetition": {"repetition_penalty": 1.8},
        "repetition_short": {"repetition_penalty": 0.6, "repetition_context_size": 5},
        "presence": {"presence_penalty": 2.0},
        "frequency": {"frequency_penalty": 2.0, "frequency_context_size": 40},
        "all": {"logit_bias": {ids[-1]: 3.0}, "repetition_penalty": 1.3, "presence_penalty": 0.7,
                "presence_context_size": 7, "frequency_penalty": 0.5, "frequency_context_size": 30},
    }


def _mlx_lm(model, ids: list[int], n: int, setting: dict) -> list[int]:
    bias = setting.get("logit_bias")
    kw = {**setting, "logit_bias": {int(k): v for k, v in bias.items()} if bias else None}
    return greedy_reference(model, ids, n, logits_processors=make_logits_processors(**kw))


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_ids_equal_mlx_lm_with_processors(pairs, arch):
    pair = pairs(arch)
    ids = pair.tokenizer.encode(PROMPT)
    eos = set(pair.tokenizer.eos_token_ids)
    plain = greedy_reference(pair.target.model, ids, N_NEW)
    for name, setting in _settings(ids, plain).items():
        ref = _mlx_lm(pair.target.model, ids, N_NEW + 16, setting)
        assert ref[:N_NEW] != plain, f"{arch} {name}: the setting changes nothing, so it tests nothing"
        oracle = OracleDrafter(ref, len(ids), 16, vocab_size=pair.target.vocab_size)
        wrong = OracleDrafter(ref, len(ids), 16, corrupt_at=(5,), vocab_size=pair.target.vocab_size)
        for drafter, window in ((pair.drafter, "auto"), (pair.drafter, 4), (oracle, "full"), (wrong, 6)):
            final, _ = run_dflash(pair.target, drafter, pair.tokenizer, ids, N_NEW, verify_window=window, **setting)
            assert final.token_ids == cut_at_eos(ref[:N_NEW], eos), f"{arch} {name} window {window}"
        if name == "force" and not set(ref[:N_NEW]) & eos:
            assert set(ref[1:N_NEW]) == {plain[3]}  # a bias of 100 forces its token
    # the oracle's whole blocks were accepted: every row judged with the drafts before it
    final, _ = run_dflash(pair.target, oracle, pair.tokenizer, ids, N_NEW, verify_window="full", **setting)
    if len(final.token_ids) == N_NEW:
        assert final.stats.accept_histogram[15] >= final.stats.cycles - 1


def test_plain_steps_and_a_long_prompt(pairs):
    """Pipelined plain steps (window 1: each step queued on the device-side token) and a prompt
    longer than the windows, on qwen3_5 (tape rollback)."""
    pair = pairs("qwen3_5")
    ids = pair.tokenizer.encode(PROMPT * 4)
    setting = {"repetition_penalty": 1.5, "presence_penalty": 0.5, "frequency_penalty": 0.4,
               "frequency_context_size": 50}
    ref = _mlx_lm(pair.target.model, ids, N_NEW, setting)
    assert ref != greedy_reference(pair.target.model, ids, N_NEW)
    eos = set(pair.tokenizer.eos_token_ids)
    for window in (1, 2, "auto"):
        final, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, N_NEW, verify_window=window, **setting)
        assert final.token_ids == cut_at_eos(ref, eos), window


def test_rows_equal_mlx_lm_processors():
    """One block's rows against mlx-lm's processors called on each row's own history."""
    vocab = 50
    rng = np.random.default_rng(0)
    history = rng.integers(0, vocab, 30).tolist()
    block = rng.integers(0, vocab, 6).tolist()
    logits = mx.array(rng.normal(size=(6, vocab)).astype(np.float32) * 3)
    kw = dict(logit_bias={3: 2.5, 7: -4.0}, repetition_penalty=1.7, repetition_context_size=9,
              presence_penalty=0.8, presence_context_size=4, frequency_penalty=0.6, frequency_context_size=25)
    procs = LogitsProcessors(ProcessorParams(**kw), history)
    ours = procs(logits, len(history), mx.array(block))
    for i in range(6):
        theirs = logits[i : i + 1]
        for proc in make_logits_processors(**kw):
            theirs = proc(mx.array(history + block[: i + 1]), theirs)
        assert mx.array_equal(ours[i : i + 1], theirs), i
    first = procs(logits[:1], 20)  # no block: the history alone (its first 20 tokens here)
    theirs = logits[:1]
    for proc in make_logits_processors(**kw):
        theirs = proc(mx.array(history[:20]), theirs)
    assert mx.array_equal(first, theirs)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_rows_equal_mlx_lm_processors_random_settings(dtype):
    """Random settings, bit for bit (float32 and bfloat16 logits, as a target gives them): small
    vocabularies (ids repeated in the history and in the block), windows from 1 token to past the
    history, biases of +-1e30, repetition penalties of 1 and 1e30 (a logit times it is -inf)."""
    rng = np.random.default_rng(1)
    for trial in range(60):
        vocab = int(rng.choice([5, 17, 64]))
        history = rng.integers(0, vocab, int(rng.integers(1, 60))).tolist()
        block = rng.integers(0, vocab, int(rng.integers(1, 9))).tolist()
        logits = mx.array((rng.normal(size=(len(block), vocab)) * 4).astype(np.float32)).astype(dtype)
        kw = {"logit_bias": {int(t): float(rng.choice([-1e30, -5.0, 3.3, 1e30])) for t in rng.integers(0, vocab, 3)},
              "repetition_penalty": float(rng.choice([0.5, 1.0, 1.3, 1e30])),
              "repetition_context_size": int(rng.choice([1, 3, 20, 100])),
              "presence_penalty": float(rng.choice([-1.0, 0.7])), "presence_context_size": int(rng.choice([1, 4, 100])),
              "frequency_penalty": float(rng.choice([-0.5, 0.4])), "frequency_context_size": int(rng.choice([1, 8, 100]))}
        ours = LogitsProcessors(ProcessorParams(**kw), history)(logits, len(history), mx.array(block))
        for i in range(len(block)):
            theirs = logits[i : i + 1]
            for proc in make_logits_processors(**kw):
                theirs = proc(mx.array(history + block[: i + 1]), theirs)
            assert ours.dtype == theirs.dtype and mx.array_equal(ours[i : i + 1], theirs, equal_nan=True), (trial, i, kw)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={"x": 1.0}), "logit_bias"),
        (dict(logit_bias={3: float("nan")}), "logit_bias"),
        (dict(logit_bias={3: 1e39}), "within"),  # finite in Python, inf in float32
        (dict(logit_bias={3: -1e31}), "within"),
        (dict(logit_bias={10**9: 1.0}), "outside the vocabulary"),
        (dict(logit_bias=[1, 2]), "logit_bias"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(repetition_penalty=1e-40), "within"),  # 0 in float32: a logit over it is inf
        (dict(repetition_penalty=1e31), "within"),
        (dict(presence_penalty=-1e31), "within"),
        (dict(frequency_penalty=1e31), "within"),
        (dict(presence_penalty=float("inf")), "presence_penalty"),
        (dict(frequency_penalty="1"), "frequency_penalty"),
        (dict(repetition_context_size=0), "repetition_context_size"),
        (dict(presence_context_size=2.5), "presence_context_size"),
        (dict(frequency_context_size=-3), "frequency_context_size"),
    ],
)
def test_bad_values_raise(pairs, kwargs, match):
    pair = pairs("qwen3")
    with pytest.raises(ValueError, match=match):
        run_dflash(pair.target, pair.drafter, pair.tokenizer, [1, 2, 3], 4, **kwargs)


def test_neutral_values_change_nothing(pairs):
    pair = pairs("qwen3")
    ids = pair.tokenizer.encode(PROMPT)
    base, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 24, verify_window=4)
    same, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 24, verify_window=4, logit_bias={},
                         repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
    assert same.token_ids == base.token_ids
    assert not ProcessorParams(logit_bias={"5": 0.0}).penalties() and ProcessorParams(logit_bias={"5": 0.0}).active
