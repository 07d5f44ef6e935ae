"""Few-query attention on the CPU with a fast exp: the verify's and the draft block's softmax.

MLX 0.32's CPU exp runs ~25 ns an element (a product ~0.4 ns): a 16-query attention over 300
keys of SmolLM2's 9 heads spends 1.1 of its 1.45 ms in the softmax's exp, and a 16-token verify
runs 30 of them (~43 ms of ~120), where a decode step's one-query attention is a small share of
its time. Here the scores go through our own exp, fused into one compiled kernel: 2^y split into
2^floor(y) (the float's exponent bits) and 2^frac(y) (a degree-7 polynomial), max relative error
~1e-6, as MLX's own exp (9e-7 measured). Same maths, rounding-level differences, as the CUDA
kernel (fewq.py): per layer 1.06 -> 0.47 ms (16 queries, 300 keys), 0.47 -> 0.19 ms (4 queries),
13.7 -> 5.6 ms (16 queries, 4,000 keys), outputs within 2e-7 of MLX's.

engine/verifyattn.py routes the target's 2..16-query attentions and the draft's block through
`attention` on the CPU (fp32); mlx-lm's own decoding never comes here.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx

LOG2E = 1.4426950408889634
# 2^f = e^(f ln 2) on [0, 1): Taylor terms (ln 2)^i / i!, i = 0..7 (relative error < 1e-7 there)
_COEFFS = tuple(math.log(2) ** i / math.factorial(i) for i in range(8))


def _weights(scores: mx.array, bias: mx.array) -> tuple[mx.array, mx.array]:
    """Unnormalised softmax weights of scores + bias (bias 0 or -inf), as (2^frac, exponent bits):
    exp(s - max) = 2^y with y clamped at -127, whose 2^floor(y) is the float with exponent bits
    floor(y) + 127 (0 at -127: the weight is 0, as a masked key's must be)."""
    s = scores + bias
    y = mx.maximum((s - mx.max(s, axis=-1, keepdims=True)) * LOG2E, -127.0)
    n = mx.floor(y)
    f = y - n
    p = _COEFFS[-1]
    for c in reversed(_COEFFS[:-1]):
        p = p * f + c
    return p, mx.left_shift(n.astype(mx.int32) + 127, 23)


# one fused kernel for every shape (the key count grows every cycle: no recompiles); the bits'
# reinterpretation as floats (a view) cannot be traced shapeless, so it stays outside
_weights_compiled = mx.compile(_weights, shapeless=True)


def softmax(scores: mx.array, bias: mx.array) -> mx.array:
    """softmax(scores + bias) over the last axis with the fast exp (float32)."""
    p, bits = _weights_compiled(scores, bias)
    e = p * bits.view(mx.float32)
    return e / mx.sum(e, axis=-1, keepdims=True)


def supported(q: mx.array, k: mx.array, v: mx.array, mask: object) -> bool:
    """The calls taken here: fp32, 2..16 queries, heads a multiple of the KV heads, no mask or
    the causal one (the queries are the last keys, as in a verify)."""
    plain_mask = mask is None or (isinstance(mask, str) and mask == "causal")
    return (plain_mask and q.ndim == 4 and 2 <= q.shape[2] <= 16 and q.dtype == mx.float32
            and k.dtype == mx.float32 and q.shape[1] % k.shape[1] == 0 and k.shape[2] >= q.shape[2])


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, causal: bool) -> mx.array:
    """softmax(q k^T * scale [+ causal mask]) v for q [B, Hq, M, D], k/v [B, Hkv, N, D]; with
    `causal` query i sits at key position N - M + i."""
    b, hq, m, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    rep = hq // hkv
    s = (q.reshape(b, hkv, rep * m, d) * scale) @ k.swapaxes(-1, -2)
    return (softmax(s, _bias(rep, m, n, causal)) @ v).reshape(b, hq, m, v.shape[-1])


@functools.lru_cache(maxsize=4)
def _bias(rep: int, m: int, n: int, causal: bool) -> mx.array:
    """The additive mask (0 or -inf) of `rep` groups of m queries over n keys: built once per
    forward and shared by its layers (the key count changes every cycle, so a few entries do)."""
    if not causal:
        return mx.zeros((1, n), mx.float32)
    last = mx.tile(mx.arange(n - m, n), rep)  # the last key each row may see
    return mx.where(mx.arange(n)[None, :] <= last[:, None], 0.0, -math.inf)
