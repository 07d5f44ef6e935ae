"""Sampling: our transforms are mlx-lm's, greedy is untouched, seeds reproduce, bad input fails.

The exactness of the sampled output's distribution is tests/test_sampling_dist.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_sampler

from dflash.engine import sampling
from dflash.engine.drafters import OracleDrafter
from dflash.engine.sampling import SamplingParams
from helpers import cut_at_eos, greedy_reference, run_dflash

PROMPT = "Once upon a time there was a small town by the sea."


def _logprobs(x: mx.array) -> mx.array:
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def _random_logits(seed: int, rows: int = 64, vocab: int = 300) -> mx.array:
    """Half the rows continuous, half rounded to integers: many ties, at every boundary."""
    x = mx.random.normal((rows, vocab), key=mx.random.key(seed)) * 3
    return mx.concatenate([x[: rows // 2], mx.round(x[rows // 2 :])])


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.9, 0.95, 0.999])
def test_top_p_mask_equals_mlx_lm(top_p):
    lp = _logprobs(_random_logits(0))
    ours = sampling.top_p_mask(lp, top_p)
    assert mx.array_equal(ours, mx.isfinite(apply_top_p(lp, top_p)))
    assert ours.sum(axis=-1).min().item() >= 1


@pytest.mark.parametrize("top_k", [1, 2, 7, 50, 299])
def test_top_k_mask_equals_mlx_lm(top_k):
    lp = _logprobs(_random_logits(1))
    ours = sampling.top_k_mask(lp, top_k)
    theirs = mx.isfinite(apply_top_k(lp, top_k))
    assert (ours.sum(axis=-1) == top_k).all().item()  # exactly k, ties or not
    assert mx.array_equal(ours[:32], theirs[:32])  # no ties: the same tokens
    # with ties at the k-th place mlx-lm leaves the choice to argpartition; we take the lower
    # ids. Either way the kept values are the same multiset.
    kept = lambda m: mx.sort(mx.where(m, lp, -mx.inf), axis=-1)  # noqa: E731
    assert mx.array_equal(kept(ours), kept(theirs))


@pytest.mark.parametrize("min_p", [0.001, 0.05, 0.2, 0.5, 0.9, 1.0])
def test_min_p_mask_equals_mlx_lm(min_p):
    lp = _logprobs(_random_logits(5))
    ours = sampling.min_p_mask(lp, min_p)
    assert mx.array_equal(ours, mx.isfinite(apply_min_p(lp, min_p)))
    assert ours.sum(axis=-1).min().item() >= 1  # the most likely token (and its ties) always stays
    if min_p == 1.0:  # only the maximum and its ties
        assert mx.array_equal(ours, lp == lp.max(axis=-1, keepdims=True))


@pytest.mark.parametrize("min_p", [0.05, 0.5, 1.0])
@pytest.mark.parametrize("keep", [2, 5, 40, 299, 300])
def test_min_p_mask_with_min_tokens_to_keep_equals_mlx_lm(min_p, keep):
    """mlx-lm's apply_min_p(lp, min_p, min_tokens_to_keep): the keep most likely tokens stay
    whatever min-p says; with top-p's -inf already in the row too."""
    lp = _logprobs(_random_logits(6))
    lp = mx.concatenate([lp, apply_top_p(lp, 0.5)])  # rows where top-p left fewer than `keep` finite
    ours = sampling.min_p_mask(lp, min_p, keep)
    theirs = apply_min_p(lp, min_p, keep)
    kept = lambda m: mx.sort(mx.where(m, lp, -mx.inf), axis=-1)  # noqa: E731
    assert mx.array_equal(kept(ours), kept(mx.isfinite(theirs) | (lp == -mx.inf)))  # the same values kept
    continuous = mx.concatenate([mx.arange(32), mx.arange(64, 96)])  # no ties: the very same tokens
    assert mx.array_equal(mx.isfinite(mx.where(ours, lp, -mx.inf))[continuous], mx.isfinite(theirs)[continuous])
    assert (ours.sum(axis=-1) >= min(keep, lp.shape[-1])).all().item()
    plain = sampling.min_p_mask(lp, min_p)
    assert (ours.sum(axis=-1) > plain.sum(axis=-1)).any().item()  # it keeps more than min-p alone


def test_min_tokens_to_keep_ties_go_to_higher_ids():
    """mlx-lm keeps the last min_tokens_to_keep of argpartition(logprobs, kth=-m), whose order is
    (value, id): among ties at the cut the higher ids stay (top-k's ascending -logprobs: the lower)."""
    lp = _logprobs(mx.array([[0.0, 1.0, 1.0, 1.0, 3.0, 1.0]]))
    assert sampling.min_p_mask(lp, 0.9, 3).tolist() == [[False, False, False, True, True, True]]
    assert mx.array_equal(sampling.min_p_mask(lp, 0.9, 3), mx.isfinite(apply_min_p(lp, 0.9, 3)))
    assert sampling.min_p_mask(lp, 0.9, 6).all().item() and sampling.min_p_mask(lp, 0.9, 10**9).all().item()


@pytest.mark.parametrize("vocab", [8, 300, 151936])
@pytest.mark.parametrize("keep", [2, 5, 7])
def test_min_tokens_to_keep_tied_rows_are_mlx_lm_tokens(vocab, keep):
    """Rows of integer logits (ties at every cut, as bf16 logits have): the very tokens
    apply_min_p keeps, not only their values."""
    x = mx.round(mx.random.normal((32, vocab), key=mx.random.key(vocab + keep)) * 2)
    lp = _logprobs(x)
    for min_p in (1.0, 0.5, 0.01):
        theirs = mx.isfinite(apply_min_p(lp, min_p, keep))
        assert mx.array_equal(sampling.min_p_mask(lp, min_p, keep), theirs), min_p


def test_top_k_ties_go_to_lower_ids_and_large_k_is_off():
    lp = _logprobs(mx.array([[0.0, 1.0, 1.0, 1.0, 2.0, 1.0]]))
    assert sampling.top_k_mask(lp, 3).tolist() == [[False, True, True, False, True, False]]
    p = SamplingParams(temperature=1.0, top_k=6)  # k >= vocab keeps everything
    assert mx.allclose(sampling.probs(lp, p), mx.softmax(lp, axis=-1)).item()


@pytest.mark.parametrize(
    "temperature,top_p,top_k,min_p",
    [(1.0, 1.0, 0, 0.0), (0.7, 0.9, 0, 0.0), (1.3, 1.0, 20, 0.0), (0.5, 0.8, 5, 0.0), (1.0, 0.3, 2, 0.0),
     (1.0, 1.0, 0, 0.1), (0.7, 0.9, 0, 0.05), (1.3, 1.0, 20, 0.3), (0.5, 0.95, 5, 0.02), (1.0, 1.0, 0, 1.0)],
)
def test_probs_equal_mlx_lm_chain(temperature, top_p, top_k, min_p):
    """p = softmax(top-k(min-p(top-p(logprobs))) / temperature), the chain make_sampler applies."""
    logits = _random_logits(2)
    lp = _logprobs(logits)
    if top_p < 1:
        lp = apply_top_p(lp, top_p)
    if min_p:
        lp = apply_min_p(lp, min_p)
    if top_k:
        lp = apply_top_k(lp, top_k)
    theirs = mx.softmax(lp * (1.0 / temperature), axis=-1)
    ours = sampling.probs(logits, SamplingParams(temperature, top_p, top_k, min_p=min_p))
    assert mx.allclose(ours, theirs, atol=1e-6).item()
    assert mx.array_equal(ours > 0, theirs > 0)


@pytest.mark.parametrize(
    "temperature,top_p,top_k,min_p,keep",
    [(1.0, 1.0, 0, 0.5, 4), (0.7, 0.9, 0, 0.3, 6), (1.3, 1.0, 20, 0.8, 25), (0.5, 0.6, 5, 0.9, 3), (1.0, 1.0, 0, 1.0, 300)],
)
def test_probs_with_min_tokens_to_keep_equal_mlx_lm_chain(temperature, top_p, top_k, min_p, keep):
    """make_sampler's chain with min_tokens_to_keep: top-p, min-p keeping `keep`, top-k, temperature
    (continuous logits: no ties at the keep-th place, where mlx-lm's argpartition picks freely)."""
    logits = mx.random.normal((64, 300), key=mx.random.key(12)) * 3
    lp = _logprobs(logits)
    if top_p < 1:
        lp = apply_top_p(lp, top_p)
    lp = apply_min_p(lp, min_p, keep)
    if top_k:
        lp = apply_top_k(lp, top_k)
    theirs = mx.softmax(lp * (1.0 / temperature), axis=-1)
    ours = sampling.probs(logits, SamplingParams(temperature, top_p, top_k, min_p=min_p, min_tokens_to_keep=keep))
    assert mx.allclose(ours, theirs, atol=1e-6).item()
    assert mx.array_equal(ours > 0, theirs > 0)
    alone = sampling.probs(logits, SamplingParams(temperature, top_p, top_k, min_p=min_p))
    assert ((ours > 0).sum() > (alone > 0).sum()).item()  # the parameter does something here


def _edge_rows() -> mx.array:
    """Continuous and integer (tied) rows, a bias of -1e30 on 40 tokens, -inf on a third of
    them, two tokens biased +1e30 (tied at the top), and near-flat rows."""
    x = mx.random.normal((8, 300), key=mx.random.key(21)) * 3
    return mx.concatenate([x, mx.round(x), x.at[:, :40].add(-1e30), mx.where(mx.arange(300) % 3 == 0, -mx.inf, x),
                           x.at[:, 3].add(1e30).at[:, 7].add(1e30), x * 1e-3])



def _mlx_lm_cuts(lp: mx.array, top_p: float, min_p: float, keep: int, top_k: int) -> mx.array:
    """mlx-lm's own cuts, in make_sampler's order: top-p, then min-p, then top-k."""
    if top_p < 1:
        lp = apply_top_p(lp, top_p)
    if min_p:
        lp = apply_min_p(lp, min_p, keep)
    if top_k:
        lp = apply_top_k(lp, top_k)
    return lp

@pytest.mark.parametrize("temperature", [1e-6, 0.7, 1e6])
@pytest.mark.parametrize("top_p", [1.0, 0.999999, 0.5, 1e-9])
@pytest.mark.parametrize("min_p,keep", [(0.0, 1), (1e-9, 1), (0.1, 2), (1.0, 5), (0.5, 299), (0.5, 300)])
def test_probs_equal_mlx_lm_chain_at_edge_values(temperature, top_p, min_p, keep):
    """make_sampler's chain at the edges (top-k 1, 2, 50 and vocabulary - 1; ties at every cut),
    the very tokens and their probabilities: one-step, float32, to 1e-6."""
    logits = _edge_rows()
    for top_k in (0, 1, 2, 50, 299):
        lp = _mlx_lm_cuts(_logprobs(logits), top_p, min_p, keep, top_k)
        theirs = mx.softmax(lp * (1.0 / temperature), axis=-1)
        ours = sampling.probs(logits, SamplingParams(temperature, top_p, top_k, min_p=min_p, min_tokens_to_keep=keep))
        assert mx.array_equal(ours > 0, theirs > 0), top_k
        assert mx.allclose(ours, theirs, atol=1e-6).item(), top_k


@pytest.mark.parametrize(
    "temperature,top_p,top_k,min_p,keep",
    [(1.0, 1.0, 1, 0.0, 1), (1e-6, 1.0, 0, 0.0, 1), (0.7, 0.5, 0, 0.0, 1), (1.0, 1.0, 0, 0.9, 1),
     (1.0, 1.0, 0, 0.5, 3), (1.3, 0.95, 20, 0.0, 1), (1.0, 1.0, 0, 0.0, 1)],
)
def test_probs_on_bfloat16_logits_cut_as_mlx_lm(temperature, top_p, top_k, min_p, keep):
    """bfloat16 logits (a bfloat16 target's): mlx-lm's generate_step takes logits - logsumexp in
    bfloat16, where near-flat rows' close logits round to one log-prob, and its sampler cuts and
    tempers those in bfloat16 (log-prob times 1 / temperature rounded there). The same tokens
    survive (top-k 1: the lower id of a rounded pair; a tiny temperature: all of the rounded
    top), with the same probabilities to 1e-6."""
    x = mx.random.normal((32, 2000), key=mx.random.key(31))
    logits = mx.concatenate([x * 0.3, x * 1e-3, x * 3 + 10]).astype(mx.bfloat16)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # bfloat16, as generate_step has it
    lp = _mlx_lm_cuts(lp, top_p, min_p, keep, top_k)
    theirs = mx.softmax((lp * (1.0 / temperature)).astype(mx.float32), axis=-1)
    ours = sampling.probs(logits, SamplingParams(temperature, top_p, top_k, min_p=min_p, min_tokens_to_keep=keep))
    assert mx.array_equal(ours > 0, theirs > 0)
    assert (0.5 * mx.abs(ours - theirs).sum(axis=-1)).max().item() < 1e-6


@pytest.mark.parametrize("min_p,keep", [(0.0, 1), (0.3, 1), (0.6, 6)])
def test_make_sampler_draws_from_our_probs(min_p, keep):
    """mlx-lm's own sampler, drawn 200k times, matches our p (chi-square, pooled cells)."""
    from test_sampling_dist import assert_same_distribution

    logits = mx.random.normal((1, 40), key=mx.random.key(3)) * 2
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=12, min_p=min_p, min_tokens_to_keep=keep)
    p = np.array(sampling.probs(logits, params)[0])
    if min_p:
        assert 0 < (p > 0).sum() < 12  # min-p removes tokens top-p and top-k keep
    if keep > 1:  # and min_tokens_to_keep puts some back
        assert (p > 0).sum() == keep > (np.array(sampling.probs(logits, SamplingParams(0.7, 0.9, 12, min_p=min_p))[0]) > 0).sum()
    mx.random.seed(4)
    n = 200_000
    draws = make_sampler(0.7, top_p=0.9, min_p=min_p, min_tokens_to_keep=keep, top_k=12)(
        mx.broadcast_to(_logprobs(logits), (n, 40)))
    counts = np.bincount(np.array(draws), minlength=40)
    exact = {(i,): float(v) for i, v in enumerate(p)}
    assert_same_distribution({(i,): int(c) for i, c in enumerate(counts)}, exact, n)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(seed=-3), "seed"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_p=float("nan")), "min_p"),
        (dict(min_p=0.1, min_tokens_to_keep=0), "min_tokens_to_keep"),
        (dict(min_p=0.1, min_tokens_to_keep=2.5), "min_tokens_to_keep"),
        (dict(min_p=0.1, min_tokens_to_keep=True), "min_tokens_to_keep"),
    ],
)
def test_bad_parameters_raise(pairs, kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{"temperature": 1.0, **kwargs})
    pair = pairs("qwen3")
    with pytest.raises(ValueError, match=match):
        run_dflash(pair.target, pair.drafter, pair.tokenizer, [1, 2, 3], 4,
                   **{"temperature": 1.0, **kwargs})


def test_greedy_path_untouched(pairs, monkeypatch):
    """temperature 0 (with any top_p/top_k/seed) is today's greedy loop: no sampling op runs."""
    pair = pairs("qwen3_5")
    ids = pair.tokenizer.encode(PROMPT)
    eos = set(pair.tokenizer.eos_token_ids)
    ref = cut_at_eos(greedy_reference(pair.target.model, ids, 40), eos)
    base, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 40, verify_window=4)

    def boom(*a, **k):
        raise AssertionError("a sampling op ran on the greedy path")

    for name in ("scaled_logits", "probs", "draw", "draw_scaled", "accept", "KeyChain"):
        monkeypatch.setattr(sampling, name, boom)
    monkeypatch.setattr("dflash.engine.generate.KeyChain", boom)
    final, _ = run_dflash(
        pair.target, pair.drafter, pair.tokenizer, ids, 40, verify_window=4,
        temperature=0.0, top_p=0.5, top_k=3, seed=7, min_p=0.3,
    )
    assert final.token_ids == base.token_ids == ref
    keys = ("cycles", "accepted_drafts", "accept_histogram", "plain_steps", "mean_verify_window")
    assert all(getattr(final.stats, k) == getattr(base.stats, k) for k in keys)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "gemma3_text"])
def test_same_seed_same_ids(pairs, arch):
    pair = pairs(arch)
    ids = pair.tokenizer.encode(PROMPT)
    saved, pair.tokenizer.eos_token_ids = pair.tokenizer.eos_token_ids, set()
    try:
        runs = {}
        for seed in (11, 11, 12):
            for window in (4, "full"):
                final, _ = run_dflash(
                    pair.target, pair.drafter, pair.tokenizer, ids, 32,
                    temperature=1.0, top_p=0.95, seed=seed, verify_window=window,
                )
                runs.setdefault((seed, window), []).append(final.token_ids)
    finally:
        pair.tokenizer.eos_token_ids = saved
    for window in (4, "full"):
        a, b = runs[(11, window)]
        assert a == b and len(a) == 32
        assert runs[(12, window)][0] != a


def test_unseeded_runs_differ(pairs):
    pair = pairs("qwen3")
    ids = pair.tokenizer.encode(PROMPT)
    saved, pair.tokenizer.eos_token_ids = pair.tokenizer.eos_token_ids, set()
    try:
        a, b = (run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 24, temperature=1.0)[0]
                for _ in range(2))
    finally:
        pair.tokenizer.eos_token_ids = saved
    assert a.token_ids != b.token_ids


@pytest.mark.parametrize("window", ["auto", 1, 3])
def test_sampling_runs_every_window_and_reports_stats(pairs, window):
    """Plain steps pipelined on the sampled device-side token, drafts, auto: all sample."""
    pair = pairs("qwen3_5")
    ids = pair.tokenizer.encode(PROMPT)
    final, events = run_dflash(
        pair.target, pair.drafter, pair.tokenizer, ids, 48,
        temperature=0.8, top_k=40, seed=5, verify_window=window,
    )
    s = final.stats
    assert s.generated_tokens == len(final.token_ids) and sum(s.accept_histogram) == s.cycles
    assert s.accepted_drafts == sum(f for ev in events for f in ev.from_draft)
    if window == 1:
        assert s.plain_steps == s.cycles and s.accepted_drafts == 0


def test_oracle_under_sampling_is_ids_only(pairs):
    """An ids-only drafter (q one-hot): at a near-zero temperature the target's argmax
    continuation is accepted almost always; a drafter without `sampling` gives the same ids."""
    pair = pairs("qwen3")
    ids = pair.tokenizer.encode(PROMPT)
    ref = greedy_reference(pair.target.model, ids, 64)
    oracle = OracleDrafter(ref, len(ids), 16, vocab_size=pair.target.vocab_size)

    class IdsOnly:  # the Drafter protocol before sampling: no `sampling` parameter
        block_size, layer_ids = 16, [0]
        reset = jump = add_context = lambda self, *a, **k: None

        def propose(self, anchor, anchor_pos, count=None):
            return oracle.propose(anchor, anchor_pos, count)

    saved, pair.tokenizer.eos_token_ids = pair.tokenizer.eos_token_ids, set()
    try:
        a, _ = run_dflash(pair.target, oracle, pair.tokenizer, ids, 48, temperature=1e-3, seed=1,
                          verify_window="full")
        b, _ = run_dflash(pair.target, IdsOnly(), pair.tokenizer, ids, 48, temperature=1e-3,
                          seed=1, verify_window="full")
    finally:
        pair.tokenizer.eos_token_ids = saved
    assert a.token_ids == b.token_ids == ref[:48]
    assert a.stats.acceptance > 0.9


def test_accept_rule_edges():
    """q == p keeps every draft; a draft the target rules out is rejected and never re-emitted."""
    key = mx.random.key(0)
    p = mx.softmax(mx.random.normal((4, 9), key=mx.random.key(1)), axis=-1)
    drafts = sampling.draw(p[:3], mx.random.key(2))
    acc, toks = sampling.accept(p, drafts, p[:3], key)
    assert acc.item() == 3 and toks[:3].tolist() == drafts.tolist()
    banned = p.at[0, 4].multiply(0.0)
    for s in range(50):
        acc, toks = sampling.accept(banned, mx.array([4, 1, 2]), None, mx.random.key(s))
        assert acc.item() == 0 and toks[0].item() != 4
    acc, toks = sampling.accept(p[:1], mx.zeros((0,), mx.int32), None, key)  # a plain step
    assert acc.item() == 0 and toks.shape == (1,)
    keys = sampling.KeyChain(3)
    a = [keys.next().tolist() for _ in range(3)]
    keys = sampling.KeyChain(3)
    assert a == [keys.next().tolist() for _ in range(3)] and a[0] != a[1]


@pytest.mark.parametrize("top_p", [1.0, 0.9])
@pytest.mark.parametrize("temperature", [1e-3, 1e-20, 1e-37, 1e-38, 5e-39, 1e-45])
def test_tiny_temperatures_draw_the_argmax(temperature, top_p):
    """However small a positive temperature, p is the T -> 0 limit (one-hot at the argmax here,
    no ties), never NaN: the scaled logits must not overflow to +inf (raw logits above 0) nor
    turn a whole row to -inf (a flat row's log-probs). mlx-lm's sampler draws that argmax too
    wherever its own arithmetic stays finite (the peaked rows)."""
    peaked = mx.array([[3.0, 12.0, 25.0, -4.0, 0.0, 24.5], [-1.0, 2.0, 1.5, 0.5, 30.0, 29.0]])
    flat = np.array(mx.random.normal((2, 300), key=mx.random.key(7))) * 0.5
    flat[[0, 1], [17, 230]] = flat.max() + 0.2  # a clear argmax in a row whose top prob is ~1%
    flat = mx.array(flat)
    params = SamplingParams(temperature, top_p)
    for logits in (peaked, flat):
        best = mx.argmax(logits, axis=-1)
        p = sampling.probs(logits, params)
        assert mx.array_equal(p, (mx.arange(logits.shape[-1]) == best[:, None]).astype(p.dtype)), temperature
        for s in range(5):
            assert mx.array_equal(sampling.sample(logits, params, mx.random.key(s)), best)
    if temperature < 1e-39:  # 1 / temperature is inf in float32: mlx-lm's own arithmetic is NaN
        return
    mx.random.seed(0)
    theirs = make_sampler(temperature, top_p=top_p if top_p < 1 else 0.0)(_logprobs(peaked))
    assert mx.array_equal(theirs, mx.argmax(peaked, axis=-1))


def test_tiny_temperature_run_is_the_greedy_run(pairs):
    """End to end (first token, plain steps, verified blocks with the draft's q): a temperature of
    1e-38 decodes the greedy text, where 1 / temperature times a raw logit overflowed to NaN."""
    pair = pairs("qwen3")
    ids = pair.tokenizer.encode(PROMPT)
    greedy, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 24, verify_window=4)
    for window in (1, 4):
        cold, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 24, verify_window=window,
                             temperature=1e-38, seed=1)
        assert cold.token_ids == greedy.token_ids, window


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bfloat16_target_top_k_1_is_mlx_lm_sampler(tiny_dirs, arch):
    """End to end on a bfloat16 target: temperature 1 with top-k 1 is deterministic in mlx-lm
    (its sampler keeps the lower id of two log-probs that round to one), and DFlash's sampled
    ids (speculative sampling over the random draft) equal mlx-lm's generate_step with
    make_sampler(1.0, top_k=1), prompt after prompt."""
    from dflash.engine.loading import load_pair

    pair = load_pair(tiny_dirs[arch], tiny_dirs[arch] / "draft")  # not the shared fp32 fixture
    pair.target.model.set_dtype(mx.bfloat16)
    eos = set(pair.tokenizer.eos_token_ids)
    for seed in range(12):
        ids = mx.random.randint(0, 400, (8,), key=mx.random.key(seed)).tolist()
        ref = cut_at_eos(greedy_reference(pair.target.model, ids, 40, sampler=make_sampler(1.0, top_k=1)), eos)
        final, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 40, temperature=1.0, top_k=1, seed=seed)
        assert final.token_ids == ref, f"{arch}: diverged from mlx-lm's sampler (bfloat16) on {ids}"


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_huge_temperature_is_uniform_over_the_kept_tokens_not_nan(dtype):
    """temperature 1e300 is valid, and its scale rounds to 0: a cut (-inf) token times 0 was NaN,
    and so was the whole row (the draw and the acceptance then garbage). Now the T -> inf limit."""
    logits = mx.array([[1.0, 2.0, 3.0, -mx.inf, 0.5]]).astype(dtype)
    p = sampling.probs(logits, SamplingParams(temperature=1e300, top_k=2))
    assert p.tolist() == [[0.0, 0.5, 0.5, 0.0, 0.0]]
    p = sampling.probs(logits, SamplingParams(temperature=1e300))  # nothing cut, one -inf logit
    assert p.tolist() == [[0.25, 0.25, 0.25, 0.0, 0.25]]
