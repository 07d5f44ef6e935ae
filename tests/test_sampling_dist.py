"""Sampling is exact: the emitted tokens are distributed as the target's own sampler.

Two levels, each compared with the EXACT distribution by a chi-square test (cells pooled to an
expected count >= 5, alpha 1e-4) and by the total-variation distance against its null
distribution (multinomial samples of the same n from the exact distribution):

* the acceptance rule itself (engine/sampling.py `accept`), vectorised over 200k chains of a
  small Markov "model" (p and q tables over 8 tokens), 4 tokens deep: every path (kept drafts,
  the residual after a rejection, the bonus) and every kind of draft;
* the real engine end to end, on a tiny target of every family: the joint distribution of the
  first three generated tokens over many seeds, against p(t1) p(t2|t1) p(t3|t1,t2) computed
  from target forwards over every prefix that matters.

Random tiny targets are nearly uniform over their ~500 tokens at temperature 1 (entropy ~5.8
nats): no test of a few thousand samples could tell a wrong sampler from a right one there. So
the target's logits are scaled (`Sharp`: per family and per setting, to a first-token entropy of
1.3 nats under the test's own temperature/top-p), as peaked as a trained model's often are; the
random draft keeps its flat q, so its drafts are mostly rejected.

Every run is seeded, so each test is deterministic. The power checks build a wrong sampler
through a hook (the residual without q subtracted; temperature 1.1 in place of 1.0) and require
the same tests to reject it.
"""

from __future__ import annotations

import math
import zlib
from collections import Counter
from dataclasses import replace
from typing import Any, Callable, Sequence

import mlx.core as mx
import numpy as np
import pytest

from dflash.cache.tiers import Identity, PrefixCache
from dflash.engine import sampling
from dflash.engine.drafters import OracleDrafter
from dflash.engine.generate import stream_dflash_generate
from dflash.engine.prefix import Snapshot
from dflash.engine.sampling import DraftSampling, KeyChain, SamplingParams

ALPHA = 1e-4
MIN_EXPECTED = 5.0


# --- statistics ------------------------------------------------------------------------------
def chi2_sf(x: float, dof: int) -> float:
    """P(chi-square(dof) >= x): the regularized upper incomplete gamma Q(dof/2, x/2)."""
    a, z = dof / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    log_front = -z + a * math.log(z) - math.lgamma(a)
    if z < a + 1:  # series for the lower function P
        term = total = 1.0 / a
        ap = a
        for _ in range(10_000):
            ap += 1
            term *= z / ap
            total += term
            if term < total * 1e-16:
                break
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300  # continued fraction for Q (modified Lentz)
    b = z + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-16:
            break
    return math.exp(log_front) * h


def pooled(counts: dict, exact: dict, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Observed counts and exact probabilities over the cells with n*p >= 5, plus one "rest"."""
    cells = [c for c, p in exact.items() if n * p >= MIN_EXPECTED]
    probs = np.array([exact[c] for c in cells], dtype=np.float64)
    obs = np.array([counts.get(c, 0) for c in cells], dtype=np.float64)
    rest_p, rest_obs = max(0.0, 1.0 - probs.sum()), n - obs.sum()
    if n * rest_p >= MIN_EXPECTED or len(cells) < 2:
        probs, obs = np.append(probs, rest_p), np.append(obs, rest_obs)
    else:  # too rare to stand alone: fold into the smallest cell
        i = int(np.argmin(probs))
        probs[i] += rest_p
        obs[i] += rest_obs
    return obs, probs / probs.sum()


def compare(counts: dict, exact: dict, n: int, sims: int = 2000) -> dict[str, float]:
    """Chi-square and total-variation statistics of `counts` (n samples) against `exact`.

    The TV p-value is the normal tail beyond the observed TV, with the mean and spread of the
    TV of `sims` multinomial samples (size n) of the exact distribution: a sum over many
    cells, close to normal, and far cheaper than the 10^5 simulations an empirical 1e-4 needs.
    """
    obs, probs = pooled(counts, exact, n)
    expected = n * probs
    chi2 = float(((obs - expected) ** 2 / expected).sum())
    dof = len(obs) - 1
    tv = 0.5 * float(np.abs(obs / n - probs).sum())
    rng = np.random.default_rng(12345)
    null = 0.5 * np.abs(rng.multinomial(n, probs, size=sims) / n - probs).sum(axis=1)
    z = (tv - null.mean()) / max(null.std(), 1e-12)
    return {
        "n": n, "cells": len(obs), "chi2": round(chi2, 1), "dof": dof,
        "p_chi2": chi2_sf(chi2, dof), "tv": round(tv, 4),
        "tv_null_mean": round(float(null.mean()), 4), "tv_null_max": round(float(null.max()), 4),
        "p_tv": 0.5 * math.erfc(z / math.sqrt(2)),
    }


def assert_same_distribution(counts: dict, exact: dict, n: int) -> dict[str, float]:
    r = compare(counts, exact, n)
    assert r["cells"] >= 3, f"too few informative cells to test anything: {r}"
    assert r["p_chi2"] > ALPHA and r["p_tv"] > ALPHA, f"not the exact distribution: {r}"
    return r


def assert_rejected(counts: dict, exact: dict, n: int) -> dict[str, float]:
    r = compare(counts, exact, n)
    assert r["p_chi2"] < ALPHA and r["p_tv"] < ALPHA, f"a wrong sampler was not caught: {r}"
    return r


def test_chi2_sf_known_values():
    for x in (0.5, 3.0, 40.0):
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-9)
    assert chi2_sf(3.841459, 1) == pytest.approx(0.05, rel=1e-5)
    assert chi2_sf(18.307038, 10) == pytest.approx(0.05, rel=1e-5)
    assert chi2_sf(124.342113, 100) == pytest.approx(0.05, rel=1e-5)
    assert chi2_sf(37.566235, 20) == pytest.approx(0.01, rel=1e-5)


# --- level 1: the acceptance rule, vectorised over many chains -------------------------------
V, DEPTH, BLOCK_DRAFTS, CHAINS = 8, 4, 2, 200_000


def markov_tables(params: SamplingParams, draft: str) -> tuple[mx.array, mx.array | None]:
    """Target table T[prev] = p(next | prev) and the draft's Q (None: Q = T exactly)."""
    logits = mx.random.normal((V, V), key=mx.random.key(7)) * 1.5
    t = sampling.probs(logits, params)
    if draft == "exact":
        return t, None
    if draft == "close":  # a good draft: the target's logits, slightly off
        other = logits + 0.6 * mx.random.normal((V, V), key=mx.random.key(8))
    else:  # "random" / "ids": an unrelated draft
        other = mx.random.normal((V, V), key=mx.random.key(9)) * 1.5
    return t, sampling.probs(other, params)


def simulate(t: mx.array, q: mx.array | None, ids_only: bool, seed: int) -> np.ndarray:
    """CHAINS independent generations of DEPTH tokens after token 0, BLOCK_DRAFTS per cycle."""
    keys = KeyChain(seed)
    q = t if q is None else q
    anchor = mx.zeros((CHAINS,), mx.int32)
    out = np.full((CHAINS, DEPTH), -1, np.int64)
    length = np.zeros(CHAINS, np.int64)
    while (length < DEPTH).any():
        prev, drafts, qs = anchor, [], []
        for _ in range(BLOCK_DRAFTS):
            qi = q[prev]
            if ids_only:
                d = mx.argmax(qi, axis=-1).astype(mx.int32)
            else:
                d = sampling.draw(qi, keys.next())
            drafts.append(d)
            qs.append(qi)
            prev = d
        d = mx.stack(drafts, axis=1)
        p = mx.stack([t[anchor]] + [t[x] for x in drafts], axis=1)
        acc, toks = sampling.accept(p, d, None if ids_only else mx.stack(qs, axis=1), keys.next())
        anchor = advance(out, length, acc, toks)
    return out


def advance(out: np.ndarray, length: np.ndarray, acc: mx.array, toks: mx.array) -> mx.array:
    """Write each chain's emitted tokens (up to DEPTH; `length` grows in place) and return the
    next cycle's anchors."""
    acc, toks = np.array(acc), np.array(toks)
    chains = np.arange(len(acc))
    for j in range(toks.shape[1]):
        sel = (j <= acc) & (length + j < DEPTH)
        out[chains[sel], length[sel] + j] = toks[sel, j]
    length += acc + 1
    return mx.array(toks[chains, acc])


def markov_exact(t: mx.array) -> dict[tuple, float]:
    tn = np.array(t, dtype=np.float64)
    probs = {(): 1.0}
    for _ in range(DEPTH):
        probs = {
            c + (x,): pr * tn[c[-1] if c else 0, x] for c, pr in probs.items() for x in range(V)
        }
    return probs


def counts_of(samples: np.ndarray) -> dict[tuple, int]:
    codes = samples @ (V ** np.arange(DEPTH))
    seen = np.bincount(codes, minlength=V**DEPTH)
    cell = lambda code: tuple(code // V**i % V for i in range(DEPTH))  # noqa: E731
    return {cell(code): int(k) for code, k in enumerate(seen) if k}


PARAMS = {
    "t1.0": SamplingParams(temperature=1.0),
    "t0.7_p0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "t1.3_k3": SamplingParams(temperature=1.3, top_k=3),
}


@pytest.mark.parametrize("draft", ["random", "close", "exact", "ids"])
@pytest.mark.parametrize("pname", list(PARAMS))
def test_accept_rule_is_exact(pname, draft):
    t, q = markov_tables(PARAMS[pname], draft)
    samples = simulate(t, q, draft == "ids", seed=zlib.crc32(f"{pname}/{draft}".encode()))
    assert (samples >= 0).all()
    assert_same_distribution(counts_of(samples), markov_exact(t), CHAINS)


def test_accept_rule_wrong_residual_is_rejected(monkeypatch):
    """Power: resampling from p at a rejection (q not subtracted) is caught."""
    t, q = markov_tables(PARAMS["t1.0"], "close")
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    r = assert_rejected(counts_of(simulate(t, q, False, seed=1)), markov_exact(t), CHAINS)
    print("wrong residual (rule, n=200k):", r)


def test_accept_rule_wrong_temperature_is_rejected():
    """Power: the target's p at temperature 1.1 where 1.0 was asked is caught."""
    t, q = markov_tables(PARAMS["t1.0"], "close")
    t_wrong, _ = markov_tables(SamplingParams(temperature=1.1), "close")
    r = assert_rejected(counts_of(simulate(t_wrong, q, False, seed=2)), markov_exact(t), CHAINS)
    print("temperature 1.1 for 1.0 (rule, n=200k):", r)


# --- level 2: the engine end to end on every family ------------------------------------------
PROMPT = "Once upon a time"
NEW = 3  # tokens per run: the first from prefill, then a 2-draft cycle (window 3) or two


class Sharp:
    """The target with its logits scaled by `scale` (a peaked, informative distribution)."""

    def __init__(self, target: Any, scale: float):
        self._target, self.scale = target, scale

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)

    def forward(self, tokens: mx.array, cache: list[Any], last_only: bool = False, eager: bool = False):
        logits, features = self._target.forward(tokens, cache, last_only, eager)
        return logits * self.scale, features

    def last_logits(self, seqs: Sequence[Sequence[int]]) -> mx.array:
        """Next-token logits after each sequence (equal lengths), one uncached batch forward."""
        return self._target.model(mx.array(seqs, dtype=mx.int32))[:, -1] * self.scale


def sharpen(target: Any, ids: list[int], params: SamplingParams, entropy: float = 1.3) -> Sharp:
    """Scale found by bisection so the first token's entropy under `params` is `entropy`."""
    logits = Sharp(target, 1.0).last_logits([ids])[0].astype(mx.float32)

    def h(c: float) -> float:
        p = sampling.probs(logits * c, params)
        return -(p * mx.log(mx.maximum(p, 1e-30))).sum().item()

    lo, hi = 0.1, 50.0
    for _ in range(40):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if h(mid) > entropy else (lo, mid)
    return Sharp(target, lo)


def engine_exact(
    sharp: Sharp, ids: list[int], params: SamplingParams, n: int,
    law: Callable[[mx.array], mx.array] | None = None, **processors: Any,
) -> dict[tuple, float]:
    """p(t1) p(t2|t1) p(t3|t1,t2) for every prefix that can reach an expected count of 5; with
    `processors`, mlx-lm's own (make_logits_processors) on each prefix's logits and history.
    `law`: the sampling distribution of a batch of logits (default: ours, sampling.probs)."""
    from mlx_lm.sample_utils import make_logits_processors

    procs = make_logits_processors(**processors) if processors else []
    probs = {(): 1.0}
    for _ in range(NEW):
        live = [c for c, pr in probs.items() if n * pr >= MIN_EXPECTED]
        logits = sharp.last_logits([ids + list(c) for c in live])
        if procs:
            rows = []
            for i, c in enumerate(live):
                row = logits[i : i + 1]
                for proc in procs:
                    row = proc(mx.array(ids + list(c)), row)
                rows.append(row)
            logits = mx.concatenate(rows)
        dist = np.array(sampling.probs(logits, params) if law is None else law(logits))
        probs = {
            c + (x,): probs[c] * float(dist[i, x])
            for i, c in enumerate(live)
            for x in np.nonzero(n * probs[c] * dist[i] >= MIN_EXPECTED)[0].tolist()
        }
    return probs


class SelfDrafter:
    """A good draft: the (sharpened) target itself at a wider temperature, so its drafts are
    usually but not always accepted. It draws on the host (numpy, seeded from the engine's
    key) from q memoised per prefix, and hands the engine that same q."""

    def __init__(self, sharp: Sharp, prompt: list[int], widen: float = 1.5,
                 memo: dict | None = None, block_size: int = 16):
        self.sharp, self.prompt, self.widen = sharp, prompt, widen
        self.memo = {} if memo is None else memo  # prefix -> (q, q as float64), across runs
        self.block_size, self.layer_ids = block_size, [0]
        self.seq = list(prompt)

    def reset(self, positioned: bool = False) -> None:
        self.seq = list(self.prompt)

    def jump(self, position: int) -> None: ...

    def add_context(self, features: mx.array) -> None: ...

    def _q(self, prefix: tuple[int, ...], params: SamplingParams) -> tuple[mx.array, np.ndarray]:
        if prefix not in self.memo:
            q = sampling.probs(self.sharp.last_logits([list(prefix)])[0], params)
            q64 = np.array(q, dtype=np.float64)
            self.memo[prefix] = (q, q64 / q64.sum())
        return self.memo[prefix]

    def propose(self, anchor: mx.array, anchor_pos: int, count: int | None = None,
                sampling: DraftSampling | None = None) -> tuple[mx.array, mx.array]:
        count = self.block_size - 1 if count is None else count
        params = replace(sampling.params, temperature=sampling.params.temperature * self.widen)
        rng = np.random.default_rng(np.array(sampling.key).tolist())
        seq = self.seq[:anchor_pos] + [anchor.item()]
        ids, qs = [], []
        for _ in range(count):
            q, q64 = self._q(tuple(seq), params)
            seq.append(int(rng.choice(len(q64), p=q64)))
            ids.append(seq[-1])
            qs.append(q)
        self.seq = seq
        return mx.array(ids, dtype=mx.int32), mx.stack(qs)


def engine_counts(
    pair: Any, sharp: Sharp, make_drafter: Callable[[], Any], ids: list[int],
    params: SamplingParams, n: int, window: int | str = 3, **processors: Any,
) -> dict[tuple, int]:
    """Counts of the first NEW ids over n seeded runs (the prompt restored from a prefix cache
    after the first run: a whole-prompt hit samples t1 from the stored logits, no prefill)."""
    cache = PrefixCache(Identity("sharp", "test", (0,)), Snapshot.decode, None)
    saved, pair.tokenizer.eos_token_ids = pair.tokenizer.eos_token_ids, set()
    counts: Counter = Counter()
    try:
        for seed in range(n):
            *_, final = stream_dflash_generate(
                sharp, make_drafter(), pair.tokenizer, ids, NEW, verify_window=window,
                temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=seed,
                min_p=params.min_p, min_tokens_to_keep=params.min_tokens_to_keep, prefix_cache=cache, **processors,
            )
            assert len(final.token_ids) == NEW
            counts[tuple(final.token_ids)] += 1
    finally:
        pair.tokenizer.eos_token_ids = saved
    return dict(counts)


FAMILIES = ["llama", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "gemma3_text"]
# attention KV trim and Gated DeltaNet tape replay get the most runs; the others a smaller n
RUNS_RANDOM_DRAFT = {"qwen3": 1500, "qwen3_5": 1500}
RUNS_GOOD_DRAFT = {"qwen3": 800, "qwen3_5": 800}
RUNS_OTHER = 300


def _setup(pairs, arch: str, params: SamplingParams) -> tuple[Any, Sharp, list[int]]:
    pair = pairs(arch)
    ids = pair.tokenizer.encode(PROMPT)
    return pair, sharpen(pair.target, ids, params), ids


def _self_drafter(sharp: Sharp, ids: list[int], widen: float = 1.5) -> Callable[[], SelfDrafter]:
    memo: dict = {}
    return lambda: SelfDrafter(sharp, ids, widen, memo)


@pytest.mark.parametrize("arch", FAMILIES)
def test_engine_exact_random_draft(pairs, arch):
    """Temperature 1, the untrained DFlash draft (flat q): rejections, residual draws, rollback."""
    params = SamplingParams(temperature=1.0)
    pair, sharp, ids = _setup(pairs, arch, params)
    n = RUNS_RANDOM_DRAFT.get(arch, RUNS_OTHER)
    counts = engine_counts(pair, sharp, lambda: pair.drafter, ids, params, n)
    print(arch, assert_same_distribution(counts, engine_exact(sharp, ids, params, n), n))


@pytest.mark.parametrize("arch", FAMILIES)
def test_engine_exact_good_draft(pairs, arch):
    """Temperature 0.7, top_p 0.9, a draft that is the target at a wider temperature: most
    drafts kept, so every path runs (kept drafts, residual draws, the bonus)."""
    params = SamplingParams(temperature=0.7, top_p=0.9)
    pair, sharp, ids = _setup(pairs, arch, params)
    n = RUNS_GOOD_DRAFT.get(arch, RUNS_OTHER)
    counts = engine_counts(pair, sharp, _self_drafter(sharp, ids), ids, params, n)
    print(arch, assert_same_distribution(counts, engine_exact(sharp, ids, params, n), n))


@pytest.mark.parametrize("arch", sorted(RUNS_RANDOM_DRAFT))
@pytest.mark.parametrize("draft", ["random", "good"])
def test_engine_exact_crossed_settings(pairs, arch, draft):
    """The other pairing on the main families: the random draft at temperature 0.7 + top-p
    0.9, the good draft at temperature 1."""
    params = SamplingParams(temperature=0.7, top_p=0.9) if draft == "random" else SamplingParams(1.0)
    pair, sharp, ids = _setup(pairs, arch, params)
    make = (lambda: pair.drafter) if draft == "random" else _self_drafter(sharp, ids)
    n = 500
    counts = engine_counts(pair, sharp, make, ids, params, n)
    print(arch, draft, assert_same_distribution(counts, engine_exact(sharp, ids, params, n), n))


def test_engine_exact_oracle_and_plain_steps(pairs):
    """An ids-only drafter (the oracle fed a sample of the target; q one-hot) on llama, and
    pipelined plain steps (window 1: each step queued on the sampled device-side token) on
    qwen3_5."""
    n = 400
    params = SamplingParams(temperature=1.0, top_k=20)
    pair, sharp, ids = _setup(pairs, "llama", params)
    sample = list(engine_counts(pair, sharp, lambda: pair.drafter, ids, params, 1))[0]
    reference = list(sample) * 6

    def oracle() -> OracleDrafter:
        return OracleDrafter(reference, len(ids), 16, vocab_size=sharp.vocab_size)

    counts = engine_counts(pair, sharp, oracle, ids, params, n)
    print("oracle", assert_same_distribution(counts, engine_exact(sharp, ids, params, n), n))

    params = SamplingParams(temperature=0.7, top_p=0.9)
    pair, sharp, ids = _setup(pairs, "qwen3_5", params)
    counts = engine_counts(pair, sharp, lambda: pair.drafter, ids, params, n, window=1)
    print("plain", assert_same_distribution(counts, engine_exact(sharp, ids, params, n), n))


def test_engine_wrong_samplers_are_rejected(pairs, monkeypatch):
    """Power at engine scale (qwen3, temperature 1): the same test rejects a sampler that
    resamples from p at a rejection (q not subtracted; a draft at 2.5x the temperature, n=500)
    and one that applies temperature 1.1 where 1.0 was asked (the random draft, n=400)."""
    params = SamplingParams(temperature=1.0)
    pair, sharp, ids = _setup(pairs, "qwen3", params)
    n = 500
    with monkeypatch.context() as m:
        m.setattr(sampling, "residual", lambda p, q: p)
        counts = engine_counts(pair, sharp, _self_drafter(sharp, ids, 2.5), ids, params, n)
    r = assert_rejected(counts, engine_exact(sharp, ids, params, n), n)
    print("engine, q not subtracted:", r)
    n = 400
    real_scaled = sampling.scaled_logits  # the one transform every draw goes through
    with monkeypatch.context() as m:
        hot = lambda x, p: real_scaled(x, replace(p, temperature=p.temperature * 1.1))  # noqa: E731
        m.setattr(sampling, "scaled_logits", hot)
        counts = engine_counts(pair, sharp, lambda: pair.drafter, ids, params, n)
    r = assert_rejected(counts, engine_exact(sharp, ids, params, n), n)
    print("engine, temperature 1.1:", r)


@pytest.mark.parametrize("arch", sorted(RUNS_RANDOM_DRAFT))
@pytest.mark.parametrize("draft", ["random", "good"])
def test_engine_exact_min_p(pairs, arch, draft):
    """min-p (mlx-lm's make_sampler(min_p=...)): p keeps the tokens at least 0.1 times as likely as
    the first; the draft's q is filtered the same way (the good draft) or left flat (random)."""
    params = SamplingParams(temperature=1.0, min_p=0.1)
    pair, sharp, ids = _setup(pairs, arch, replace(params, min_p=0.0))  # 1.3 nats before the cut
    make = (lambda: pair.drafter) if draft == "random" else _self_drafter(sharp, ids)
    n = 500
    exact = engine_exact(sharp, ids, params, n)
    counts = engine_counts(pair, sharp, make, ids, params, n)
    print(arch, draft, assert_same_distribution(counts, exact, n))


def test_engine_min_p_ignored_is_rejected(pairs):
    """Power: a sampler that leaves min-p out (qwen3, n=500) is caught by the same test."""
    params = SamplingParams(temperature=1.0, min_p=0.1)
    pair, sharp, ids = _setup(pairs, "qwen3", replace(params, min_p=0.0))
    n = 500
    counts = engine_counts(pair, sharp, lambda: pair.drafter, ids, replace(params, min_p=0.0), n)
    print("engine, min_p ignored:", assert_rejected(counts, engine_exact(sharp, ids, params, n), n))


def mlx_lm_law(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    """The distribution mlx-lm's make_sampler(temp, top_p, min_p, min_tokens_to_keep, top_k) draws
    from, built from mlx-lm's own transforms: its sampler applies apply_top_p, apply_min_p and
    apply_top_k to the log-probs, then draws categorical(logprobs / temp)."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    def law(logits: mx.array) -> mx.array:
        x = logits.astype(mx.float32)
        lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
        if 0 < params.top_p < 1:
            lp = apply_top_p(lp, params.top_p)
        if params.min_p != 0:
            lp = apply_min_p(lp, params.min_p, params.min_tokens_to_keep)
        if params.top_k > 0:
            lp = apply_top_k(lp, params.top_k)
        return mx.softmax(lp * (1 / params.temperature), axis=-1)

    return law


# min-p that alone keeps only the first token of the sharpened target (the next is under 0.1 of
# its probability), with min_tokens_to_keep 4 putting the next three back: 13-20% of each step's
# mass, so the three-token law is far from min-p's alone (total variation 0.49 on qwen3, 0.20 on
# qwen3_5).
KEEP = SamplingParams(temperature=1.0, min_p=0.5, min_tokens_to_keep=4)


@pytest.mark.parametrize("arch", sorted(RUNS_RANDOM_DRAFT))
@pytest.mark.parametrize("draft", ["random", "good"])
def test_engine_min_tokens_to_keep_matches_mlx_lm(pairs, arch, draft):
    """min-p with min_tokens_to_keep 4 (mlx-lm's make_sampler(min_p=0.5, min_tokens_to_keep=4)):
    the engine's tokens against the law mlx-lm's own transforms give, with the random draft
    (rejections) and the good one (whose q is cut the same way)."""
    pair, sharp, ids = _setup(pairs, arch, replace(KEEP, min_p=0.0))  # 1.3 nats before the cut
    make = (lambda: pair.drafter) if draft == "random" else _self_drafter(sharp, ids)
    n = 500
    exact = engine_exact(sharp, ids, KEEP, n, law=mlx_lm_law(KEEP))
    one = replace(KEEP, min_tokens_to_keep=1)
    alone = engine_exact(sharp, ids, one, n, law=mlx_lm_law(one))
    cells = set(exact) | set(alone)
    assert 0.5 * sum(abs(exact.get(c, 0) - alone.get(c, 0)) for c in cells) > 0.15  # far from min-p alone
    counts = engine_counts(pair, sharp, make, ids, KEEP, n)
    print(arch, draft, assert_same_distribution(counts, exact, n))


def test_engine_min_tokens_to_keep_ignored_is_rejected(pairs):
    """Power: the engine with min-p alone (min_tokens_to_keep 1), against mlx-lm's law with 4
    (qwen3, the random draft, n=500): the same test catches it."""
    pair, sharp, ids = _setup(pairs, "qwen3", replace(KEEP, min_p=0.0))
    n = 500
    counts = engine_counts(pair, sharp, lambda: pair.drafter, ids, replace(KEEP, min_tokens_to_keep=1), n)
    r = assert_rejected(counts, engine_exact(sharp, ids, KEEP, n, law=mlx_lm_law(KEEP)), n)
    print("engine, min_tokens_to_keep ignored:", r)


# Negative penalties (mlx-lm takes any value; repetition < 1 boosts): the history's tokens become
# likely, so each drawn token (a kept draft too) reshapes the next rows' law, and the law moves
# far enough from the unprocessed one for the power check to see it.
PENALTIES = dict(repetition_penalty=0.6, presence_penalty=-1.0, frequency_penalty=-0.5, frequency_context_size=8)


@pytest.mark.parametrize("arch", sorted(RUNS_RANDOM_DRAFT))
@pytest.mark.parametrize("draft", ["random", "good"])
def test_engine_exact_with_penalties(pairs, arch, draft):
    """Penalties and a logit bias (mlx-lm's make_logits_processors) under sampling: the target's
    processed distribution, with the random draft (rejections) and a good one (kept drafts,
    each later row penalised for them)."""
    params = SamplingParams(temperature=1.0, top_p=0.95)
    pair, sharp, ids = _setup(pairs, arch, params)
    top = int(mx.argmax(sharp.last_logits([ids])[0]).item())
    procs = {**PENALTIES, "logit_bias": {top: -1.0}}
    make = (lambda: pair.drafter) if draft == "random" else _self_drafter(sharp, ids)
    n = 500
    exact = engine_exact(sharp, ids, params, n, **procs)
    assert exact != engine_exact(sharp, ids, params, n)  # the processors change the law
    counts = engine_counts(pair, sharp, make, ids, params, n, **procs)
    print(arch, draft, assert_same_distribution(counts, exact, n))


def test_engine_penalties_ignored_are_rejected(pairs):
    """Power: the engine without the penalties, against the penalised law (qwen3, n=500)."""
    params = SamplingParams(temperature=1.0, top_p=0.95)
    pair, sharp, ids = _setup(pairs, "qwen3", params)
    n = 500
    counts = engine_counts(pair, sharp, _self_drafter(sharp, ids), ids, params, n)
    r = assert_rejected(counts, engine_exact(sharp, ids, params, n, **PENALTIES), n)
    print("engine, penalties ignored:", r)


def test_engine_draft_history_left_out_is_rejected(pairs, monkeypatch):
    """Power: every row of a block processed with the history before the block alone (the drafts
    before a row left out of its window), with the good draft whose drafts are mostly kept
    (qwen3, n=500): the same test catches it."""
    from dflash.engine.processors import LogitsProcessors

    params = SamplingParams(temperature=1.0, top_p=0.95)
    pair, sharp, ids = _setup(pairs, "qwen3", params)
    real = LogitsProcessors.__call__

    def anchor_only(self, logits, n_before, block=None):
        if block is None:
            return real(self, logits, n_before)
        return real(self, logits, n_before, mx.broadcast_to(block[:1], block.shape))

    monkeypatch.setattr(LogitsProcessors, "__call__", anchor_only)
    n = 500
    counts = engine_counts(pair, sharp, _self_drafter(sharp, ids), ids, params, n, **PENALTIES)
    r = assert_rejected(counts, engine_exact(sharp, ids, params, n, **PENALTIES), n)
    print("engine, drafts left out of the rows' history:", r)


def test_engine_exact_with_cut_blocks(pairs):
    """Window 3 drafting from a block cut to 3 rows (train-draft --short-block-frac drafts): q
    comes from the cut block, and the draws stay the target's."""
    params = SamplingParams(temperature=1.0)
    pair, sharp, ids = _setup(pairs, "qwen3", params)
    saved, pair.drafter.short_max = pair.drafter.short_max, 3
    try:
        n = 500
        counts = engine_counts(pair, sharp, lambda: pair.drafter, ids, params, n)
    finally:
        pair.drafter.short_max = saved
    print(assert_same_distribution(counts, engine_exact(sharp, ids, params, n), n))


# Exact ties at min_tokens_to_keep's cut, built with a logit bias: biases of 2e9 and 1e9 swallow
# the tiny target's logits (float32 steps of 128 and 64 there), so token A tops and B, C, D tie
# exactly below it, 1e9 nats down, the rest 2e9 down; temperature 1e9 turns those gaps into 1
# and 2. min-p 0.5 alone keeps A; min_tokens_to_keep 3 adds two of the tied B, C, D: mlx-lm's
# argpartition (ordered by value, then id) gives C and D, the higher ids.
TIE_A, TIE_BCD = 20, (10, 11, 12)
TIES = SamplingParams(temperature=1e9, min_p=0.5, min_tokens_to_keep=3)


@pytest.mark.parametrize("draft", ["random", "oracle"])
def test_engine_min_tokens_to_keep_ties_are_mlx_lm(pairs, draft):
    """Ties at min_tokens_to_keep's cut (qwen3, n=300): the engine's tokens are those mlx-lm
    keeps (A, C, D), drawn with its law, far from the law that keeps the lower ids (A, B, C);
    with the random draft (rejections) and an ids-only one proposing A, D, B, A (kept drafts,
    a draft outside p)."""
    pair = pairs("qwen3")
    ids = pair.tokenizer.encode(PROMPT)
    sharp = Sharp(pair.target, 1.0)
    bias = {TIE_A: 2e9, **{t: 1e9 for t in TIE_BCD}}
    reference = [TIE_A, TIE_BCD[2], TIE_BCD[0], TIE_A] * 4  # the continuation
    make = (lambda: pair.drafter) if draft == "random" else (
        lambda: OracleDrafter(reference, len(ids), 16, vocab_size=sharp.vocab_size))
    n = 300
    exact = engine_exact(sharp, ids, TIES, n, law=mlx_lm_law(TIES), logit_bias=bias)
    assert {t for c in exact for t in c} == {TIE_A, *TIE_BCD[1:]}
    counts = engine_counts(pair, sharp, make, ids, TIES, n, logit_bias=bias)
    print(draft, assert_same_distribution(counts, exact, n))
