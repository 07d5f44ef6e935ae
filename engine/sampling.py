"""Sampling: the distribution transforms and the speculative acceptance rule, in one place.

The target's distribution p and the draft's q are the same transform of their logits, with
mlx-lm's semantics (`make_sampler(temp, top_p=..., min_p=..., min_tokens_to_keep=..., top_k=...)`):
on the untempered log-probs, top-p keeps the most likely tokens until their mass reaches top_p
(every token tied with the last one kept stays), then min-p keeps the tokens at least min_p times
as likely as the most likely one, and always the min_tokens_to_keep most likely, then top-k keeps
the k most likely, then the temperature scales what is left. Ties at a count's cut are mlx-lm's:
its argpartition orders by (value, id), so top-k (the first k of -logprobs) keeps the lower ids,
min_tokens_to_keep (the last m of the logprobs) the higher ones. The log-probs, the cuts and
log-prob / temperature are computed in the logits' own dtype, as mlx-lm's generate_step and
sampler compute them (a bfloat16 target's: its roundings, and the ties they make, included);
top-p's mass and the softmax in float32. Logits processors (penalties, logit
bias: engine/processors.py) run before all of this, on the raw logits, as in mlx-lm.

Acceptance is standard speculative sampling, exact whatever the draft: draft x_i is kept with
probability min(1, p_i(x_i) / q_i(x_i)); the first rejected position j emits a draw from
normalise(max(0, p_j - q_j)); when every draft is kept, a draw from p at the next position.
A drafter that only gives ids has q = one-hot at its ids. Everything is MLX ops over the whole
block (and any leading batch axes), so a cycle still needs one host read.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import mlx.core as mx

from ..daemon.protocol import finite_number, shown

F32_MAX = 3.4028234663852886e38  # the largest float32: 1 / temperature is capped there


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy (top_p / top_k / min_p then change nothing); seed None draws one.
    min_p 0 is off; min_tokens_to_keep (mlx-lm's, default 1) is how many of the most likely
    tokens min-p always keeps, and changes nothing without min-p. Both appended last: positional
    callers keep their meaning."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0
    min_tokens_to_keep: int = 1

    def __post_init__(self) -> None:
        t, p, k, s, m = self.temperature, self.top_p, self.top_k, self.seed, self.min_p
        keep = self.min_tokens_to_keep
        if not finite_number(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {shown(t)}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {shown(p)}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: off), got {shown(k)}")
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0: off), got {shown(m)}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"min_tokens_to_keep must be an integer >= 1 (1: mlx-lm's default), got {shown(keep)}")
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 2**64):
            raise ValueError(f"seed must be an integer in [0, 2**64) or None, got {shown(s)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class DraftSampling:
    """What a sampling drafter needs: the transform and the key for its draws."""

    params: SamplingParams
    key: mx.array


class KeyChain:
    """One MLX key per use, split off a request's seeded key: the same seed, the same draws."""

    def __init__(self, seed: int | None):
        self.seed = secrets.randbits(63) if seed is None else seed
        self._key = mx.random.key(self.seed)

    def next(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub


def log_probs(logits: mx.array) -> mx.array:
    """logits - logsumexp over the last axis in the logits' own dtype, as mlx-lm's generate_step
    computes what its sampler sees: in bfloat16 the subtraction rounds, and close logits can
    share one log-prob, which decides an argmax and a cut's ties the way mlx-lm does."""
    x = logits if mx.issubdtype(logits.dtype, mx.floating) else logits.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def greedy_ids(logits: mx.array) -> mx.array:
    """The target's greedy ids (int32) over the last axis, as mlx-lm's greedy sampler picks them:
    the argmax of the log-probs (the lower id of two that round to one), not of the logits.

    Float32 logits take their own argmax: there the subtraction can make one log-prob of two
    logits only within about one float32 step of each other, closer than the verify's batched
    forward and a decode step already differ (tests/test_near_ties.py), and the log-sum-exp over
    the vocabulary would cost a CPU's 16-row verify ~12 ms (the LM head ~27 ms; MLX's CPU exp is
    ~25 ns an element) and every plain step ~1.2 ms. In bfloat16 a step is 1/128 of the value,
    so flat rows round to ties often (tiny bf16 llama: 9 of 12 prompts parted within 40 tokens)."""
    if logits.dtype == mx.float32:
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    return mx.argmax(log_probs(logits), axis=-1).astype(mx.int32)


def top_p_mask(logprobs: mx.array, top_p: float) -> mx.array:
    """Keep (True) the most likely tokens until their mass reaches top_p, and their ties.

    A token stays when the mass of the tokens ranked before it (most likely first) is below
    top_p of the total; every token tied with the last one kept stays too.
    """
    desc = -mx.sort(-logprobs, axis=-1)
    prob = mx.exp(desc.astype(mx.float32))  # the mass in float32 whatever the log-probs' dtype
    mass_before = mx.cumsum(prob, axis=-1, inclusive=False)
    total = mass_before[..., -1:] + prob[..., -1:]
    n_keep = (mass_before < top_p * total).sum(axis=-1, keepdims=True)  # >= 1
    lowest_kept = mx.take_along_axis(desc, n_keep - 1, axis=-1)
    return logprobs >= lowest_kept


def min_p_mask(logprobs: mx.array, min_p: float, min_tokens_to_keep: int = 1) -> mx.array:
    """Keep (True) the tokens at least min_p times as likely as the most likely one (its ties
    included, so at least one token stays), and the min_tokens_to_keep most likely whatever
    their probability (ties at the last place: the higher ids, as mlx-lm's argpartition of the
    ascending logprobs leaves them). min_tokens_to_keep >= the vocabulary keeps every token."""
    top = logprobs.max(axis=-1, keepdims=True)
    keep = logprobs >= top + math.log(min_p)
    if min_tokens_to_keep > 1:
        if min_tokens_to_keep >= logprobs.shape[-1]:
            return mx.ones_like(keep)
        keep = keep | top_k_mask(logprobs, min_tokens_to_keep, ties_to_higher_ids=True)
    return keep


def top_k_mask(logprobs: mx.array, top_k: int, ties_to_higher_ids: bool = False) -> mx.array:
    """Keep (True) exactly the k most likely tokens; ties at the k-th place go to the lower ids
    (top-k's rule in mlx-lm), or to the higher ones (min_tokens_to_keep's)."""
    kth = mx.topk(logprobs, top_k, axis=-1).min(axis=-1, keepdims=True)
    above = logprobs > kth
    tied = logprobs == kth
    room = top_k - above.sum(axis=-1, keepdims=True)
    rank = mx.cumsum(tied.astype(mx.int32), axis=-1, reverse=ties_to_higher_ids)
    return above | (tied & (rank <= room))


def filter_logprobs(logits: mx.array, params: SamplingParams) -> mx.array:
    """Log-probs in the logits' own dtype (`log_probs`) with the tokens outside top-p, then
    min-p, then top-k, set to -inf: mlx-lm's cuts, ties where rounding made them included (in
    bfloat16, top-k 1 keeps the lower id of two tokens whose log-probs round to one)."""
    lp = log_probs(logits)
    if params.top_p < 1.0:
        lp = mx.where(top_p_mask(lp, params.top_p), lp, -mx.inf)
    if params.min_p > 0:
        lp = mx.where(min_p_mask(lp, params.min_p, params.min_tokens_to_keep), lp, -mx.inf)
    if 0 < params.top_k < lp.shape[-1]:
        lp = mx.where(top_k_mask(lp, params.top_k), lp, -mx.inf)
    return lp


def scaled_logits(logits: mx.array, params: SamplingParams) -> mx.array:
    """Logits (float32) whose softmax is the sampling distribution: the filtered log-probs times
    1 / temperature, that product in the logits' dtype as mlx-lm's sampler rounds it (in
    bfloat16 the scale itself rounds: 1 / 0.7 is 1.4297 there), then shifted so the top is 0.
    Where a temperature is so small that the top overflows (the scale capped at float32's
    largest, 0 * inf made no NaN), the shift comes first: p is then the T -> 0 limit, the
    argmax and its ties, where mlx-lm's own draw would be garbage. Float32 logits are shifted
    first always, and not normalised when nothing is cut (the same softmax)."""
    scale = min(1.0 / params.temperature, F32_MAX)
    filtered = filters(params, logits.shape[-1])
    if logits.dtype == mx.float32:
        # Nothing rounds here as a narrower dtype would: shift, then scale (fewer passes over
        # the vocabulary); with nothing cut the shifted logits have the log-probs' softmax,
        # without the log-sum-exp (greedy_ids: its CPU cost)
        x = filter_logprobs(logits, params) if filtered else logits
        return _times(x - x.max(axis=-1, keepdims=True), scale)
    x = filter_logprobs(logits, params) if filtered else log_probs(logits)
    y = _times(x, scale).astype(mx.float32)
    top = y.max(axis=-1, keepdims=True)
    x = x.astype(mx.float32)
    limit = _times(x - x.max(axis=-1, keepdims=True), scale)
    return mx.where(mx.isfinite(top), y - top, limit)


def _times(x: mx.array, scale: float) -> mx.array:
    """x * scale, cut tokens (-inf) kept at -inf: a temperature so large that its scale rounds to
    0 (1e300 is a valid temperature) made -inf * 0 = NaN and the whole row NaN; now the T -> inf
    limit, uniform over the tokens kept."""
    return mx.where(x == -mx.inf, x, x * scale)


def filters(params: SamplingParams, vocab: int) -> bool:
    """Whether top-p, min-p or top-k may remove anything."""
    return params.top_p < 1.0 or params.min_p > 0 or 0 < params.top_k < vocab


def probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """The sampling distribution over the last axis (p for the target, q for the draft)."""
    return mx.softmax(scaled_logits(logits, params), axis=-1)


def draw(p: mx.array, key: mx.array) -> mx.array:
    """One token id per row of p (int32); zero-probability tokens are never drawn."""
    return mx.random.categorical(mx.log(p), axis=-1, key=key).astype(mx.int32)


def draw_scaled(x: mx.array, key: mx.array) -> mx.array:
    """One token id per row, drawn from softmax(x) for x = scaled_logits(...) (int32)."""
    return mx.random.categorical(x, axis=-1, key=key).astype(mx.int32)


def sample(logits: mx.array, params: SamplingParams, key: mx.array) -> mx.array:
    """One token id per row, drawn as mlx-lm's sampler draws it (a first token, a plain step)."""
    return draw_scaled(scaled_logits(logits, params), key)


def residual(p: mx.array, q: mx.array) -> mx.array:
    """normalise(max(0, p - q)): where a rejection's token comes from (p itself if p <= q)."""
    r = mx.maximum(p - q, 0.0)
    mass = r.sum(axis=-1, keepdims=True)
    return mx.where(mass > 0, r / mx.where(mass > 0, mass, 1.0), p)


def accept(
    p: mx.array, drafts: mx.array, q: mx.array | None, key: mx.array
) -> tuple[mx.array, mx.array]:
    """Speculative sampling over a block: (accepted count, the k+1 emitted-token slots).

    p: (..., k+1, V) target probs after the anchor and each draft; drafts: (..., k) ids;
    q: (..., k, V) the probs the drafts were drawn from, or None (one-hot at the drafts).
    tokens[..., :accepted] are the kept drafts and tokens[..., accepted] the new token
    (a draw from the residual at the first rejection, or from p after the last draft).
    """
    k = drafts.shape[-1]
    drafts = drafts.astype(mx.int32)
    key_u, key_r = mx.random.split(key)
    idx = drafts[..., None]
    p_x = mx.take_along_axis(p[..., :k, :], idx, axis=-1)[..., 0]
    q_x = 1.0 if q is None else mx.take_along_axis(q, idx, axis=-1)[..., 0]
    u = mx.random.uniform(shape=drafts.shape, key=key_u)
    kept = (u * q_x < p_x).astype(mx.int32)  # u < p/q, i.e. probability min(1, p/q)
    accepted = mx.cumprod(kept, axis=-1).sum(axis=-1) if k else mx.zeros(p.shape[:-2], mx.int32)
    at = accepted[..., None, None]
    p_n = mx.take_along_axis(p, at, axis=-2)[..., 0, :]
    if q is None:  # one-hot at the draft that was rejected; none after the last draft (bonus)
        no_draft = mx.full((*drafts.shape[:-1], 1), -1, mx.int32)
        d_n = mx.take_along_axis(mx.concatenate([drafts, no_draft], axis=-1), at[..., 0], axis=-1)
        q_n = (mx.arange(p.shape[-1]) == d_n).astype(p.dtype)
    elif k:
        q_n = mx.take_along_axis(q, mx.minimum(at, k - 1), axis=-2)[..., 0, :]
        q_n = q_n * (accepted < k)[..., None].astype(q_n.dtype)
    else:
        q_n = mx.zeros_like(p_n)
    new = draw(residual(p_n, q_n), key_r)
    slots = mx.concatenate([drafts, new[..., None]], axis=-1)
    tokens = mx.where(mx.arange(k + 1) < accepted[..., None], slots, new[..., None])
    return accepted.astype(mx.int32), tokens
