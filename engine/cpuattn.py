"""Few-query attention on the CPU with a fast exp: the verify's and the draft block's softmax.

A 16-query attention over 300 keys of SmolLM2's 9 heads spends 1.1 of its 1.45 ms in MLX's exp,
and a 16-token verify runs 30 of them, where a decode step's one-query attention is a small share
of its time. Here the scores go through fastexp.softmax (same maths, rounding-level differences,
as the CUDA kernel, fewq.py): per layer 1.06 -> 0.47 ms (16 queries, 300 keys), 0.47 -> 0.19 ms
(4 queries), 13.7 -> 5.6 ms (16 queries, 4,000 keys), outputs within 2e-7 of MLX's.

engine/verifyattn.py routes the target's 2..16-query attentions and the draft's block through
`attention` on the CPU (fp32); mlx-lm's own decoding never comes here.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx

from .fastexp import softmax


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
