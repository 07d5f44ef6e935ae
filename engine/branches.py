"""Branches: a greedy verify of several draft rows at once, keeping the row accepted furthest.

The draft scores every block position in one pass, and its second choice is often right where
its first is wrong. With `rows` R > 1 a cycle verifies R proposals in one batched target pass:
row 0 is the draft's top-1 block, and each other row differs from it at exactly one position,
where it takes a lower-ranked token. The R - 1 substitutions are the (position, rank) pairs the
draft itself finds likeliest to be needed and right: log P(top-1 at every earlier position) +
log P(that rank at that position), the draft's estimate of the chance that the row is correct
up to and including its substitution. All of it is MLX ops on the device (no host read between
the draft and the verify), so a pipelined cycle stays one host sync.

Every row is checked against the target's own argmax, so whichever row is kept, the emitted
tokens are exactly the target's greedy ones: the output never depends on R, only the tokens
a cycle produces (in bf16 on a GPU a batched pass rounds differently from a one-row pass, so
near-ties may part elsewhere: on the H200 chat benchmark the second question parts from mlx-lm
at token 19 with 4 or 8 rows, at 32 with one row; in fp32 the ids are mlx-lm's,
tests/test_branches.py). Greedy only (sampled cycles verify one row: speculative sampling over
several drafts needs a different acceptance rule), model drafts only (a copy proposal has no
second choice), and full-attention KV caches only (rollback.rows_supported).

What it buys, measured offline on 48 held-out prompts (the bundled SmolLM2 draft, CPU fp32,
128 tokens; every anchor's draft scored, cycles replayed against the target's greedy text):
tokens per cycle 2.57 with one row, 2.90 / 3.16 / 3.40 with 2 / 4 / 8 rows. What it costs: R
times the verify's tokens. On the H200 (bf16, SmolLM2-135M, scripts/host_probe.py, medians of 5
interleaved rounds at new cache lengths) a 16-token verify took 13.1 ms with one row, 14.4 ms
with 4 and 14.8 ms with 8: the step is bound by launching kernels, not by the rows. The chat
benchmark there (`--chat --max-tokens 256`, one machine, one run each) gave 1.68x with one row,
1.68x with 4 and 1.69x with 8: no end-to-end gain shown above that host's drift (its baseline
moved between 181 and 264 tok/s), so it stays opt-in. On the CPU the BLAS is the bound and R
rows cost about R times the product work: off.

    DFLASH_BRANCHES=1  (default) one row;  =N  N rows, 2 .. 8 (8: the most run on the H200)

Only verifies of MIN_WIDTH tokens or more take several rows: their attention is ours (fewq.py on
CUDA, cpuattn.py on the CPU), which reads a batched cache by its strides. MLX 0.32's CUDA
attention for 2 or 3 queries failed on the H200 with batched rows over the KV cache's buffer
(an illegal memory access). So on a CUDA GPU rows run only where the kernel takes the verify's
attention (`attention_takes_rows`: the kernel chosen, bf16/fp16, a head shape it supports);
elsewhere there (fp32, `DFLASH_VERIFY_ATTN=mlx`, other head shapes) the target loads with one
row and a warning. On the CPU, MLX's attention and cpuattn.py both read batched rows right.
"""

from __future__ import annotations

import os

import mlx.core as mx

from . import fewq, verifyattn

ENV = "DFLASH_BRANCHES"
MAX_ROWS = 8
MIN_WIDTH = 4  # verify tokens (anchor + drafts) below which a cycle verifies one row


def configure() -> int:
    """DFLASH_BRANCHES as a row count (a bad value raises, naming the variable)."""
    value = os.environ.get(ENV, "1").strip() or "1"
    try:
        rows = int(value)
    except ValueError:
        rows = 0
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"{ENV}={value!r}: expected a row count from 1 to {MAX_ROWS}")
    return rows


def attention_takes_rows(verify_attention: str, dtype: mx.Dtype, heads: int | None,
                         kv_heads: int | None, head_dim: int | None) -> bool:
    """Whether a several-row verify's attention is one known to read a batched cache right here:
    anything on the CPU; on a CUDA GPU only fewq's kernel (`verify_attention` "kernel") for this
    dtype and head shape (unknown shapes: no)."""
    if not verifyattn.cuda():
        return True
    if verify_attention != "kernel" or None in (heads, kv_heads, head_dim):
        return False
    q = mx.zeros((1, heads, MIN_WIDTH, head_dim), dtype)
    k = mx.zeros((1, kv_heads, MIN_WIDTH, head_dim), dtype)
    return fewq.supported(q, k, k)


def rows_from_logits(logits: mx.array, rows: int) -> mx.array:
    """Draft ids [rows, n] from the draft's logits [n, V] over n block positions, lazily.

    Row 0 is the argmax at every position; row i > 0 replaces one position's argmax by a
    lower-ranked token (see the module docstring for which). Distinct rows, always: two
    substitutions differ in position or in token. Fewer rows than asked when the block has
    fewer (position, rank) pairs than that (a tiny vocabulary)."""
    n, vocab = logits.shape
    rows = max(1, min(rows, 1 + n * (vocab - 1)))
    if rows == 1:
        return mx.argmax(logits, axis=-1).astype(mx.int32)[None]
    ranks = min(rows, vocab)  # at most rows - 1 substitutions at one position: ranks 0..rows-1
    logp = logits.astype(mx.float32)
    logp = logp - mx.logsumexp(logp, axis=-1, keepdims=True)
    part = mx.argpartition(-logp, ranks - 1, axis=-1)[:, :ranks]  # the `ranks` best, unordered
    vals = mx.take_along_axis(logp, part, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    top = mx.take_along_axis(part, order, axis=-1)  # [n, ranks], best first
    vals = mx.take_along_axis(vals, order, axis=-1)
    before = mx.cumsum(vals[:, 0]) - vals[:, 0]  # log P(top-1 at every earlier position)
    score = (before[:, None] + vals[:, 1:]).reshape(-1)  # [n * (ranks - 1)]
    pick = mx.argpartition(-score, rows - 2)[: rows - 1]
    pos, rank = pick // (ranks - 1), pick % (ranks - 1) + 1
    base = top[:, 0]
    subs = top[pos, rank]  # [rows - 1]
    others = mx.where(mx.arange(n)[None, :] == pos[:, None], subs[:, None], base[None, :])
    return mx.concatenate([base[None], others]).astype(mx.int32)
