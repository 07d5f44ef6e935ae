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
tests/test_branches.py). Greedy only: sampled cycles verify one row. (Sampled rows, exact by
multi-candidate speculative sampling, DFLASH_SAMPLED_ROWS=1, commit 63e1f61, were removed after
session 31 measured them on the H200 at temperature 0.7: 1.095x / 1.098x of mlx-lm against
1.187x / 1.102x with one row.) Model drafts only (a copy proposal has no second choice), and
full-attention KV caches only (rollback.rows_supported).

What it buys, measured offline on 48 held-out prompts (the bundled SmolLM2 draft, CPU fp32,
128 tokens; every anchor's draft scored, cycles replayed against the target's greedy text):
tokens per cycle 2.57 with one row, 2.90 / 3.16 / 3.40 with 2 / 4 / 8 rows; other rules (swaps
ranked by expected accepted length, trees of two or three swaps a row) gave the same up to 8
rows (session 26, docs/benchmark.md). What it costs: R times the verify's tokens, and a copy of
the KV cache per row each cycle (`rollback.tile_rows`; keeping the rows between cycles instead
was tried and removed, see rollback.py).
On the H200 (bf16, SmolLM2-135M) the step is bound by launching kernels, not by the rows: a
16-token verify took 13.1 ms with one row, 14.8 ms with 8 (session 15). End to end it paid once
MLX's CUDA graphs were off and the products fused (sessions 21-22): session 24, mlx-lm's own
answers re-decoded (`scripts/arms_ab.py --teach`, 32 pairs) 2.18x of mlx-lm with 8 rows against
1.83x with one; session 25, `dflash benchmark --chat --max-tokens 256 --repeats 3`, alternated on
one machine, 2.55x / 2.68x with 8 rows against 2.10x / 2.19x with one (geometric means). So a
CUDA GPU verifies 8 rows by default, while R copies of the KV cache stay within
DEFAULT_BUDGET_BYTES (256 MiB: ~1,450 tokens of SmolLM2-135M, ~230 of Qwen3-8B in bf16); past
that a cycle verifies one row. What the rows cost a verify, synced, at first-time cache lengths
(scripts/rows_cost_probe.py, H200 bf16, session 26): SmolLM2-135M 1.16-1.29x of one row at every
length from 128 to 4,096 tokens; Qwen3 shapes (random weights) 1.12-1.23x at 128 tokens, then
rising with the length (8B: 1.59x at 512, 1.90x at 1,024, 3.83x at 4,096; 0.6B 1.18x at 512,
1.68x at 4,096). Against the ~1.24x more tokens a cycle that 8 rows buy on chat, the budget
stops them where they stop paying on the larger shapes (~230 tokens for 8B and 4B, ~290 for
0.6B) and early on SmolLM2, whose rows would still pay at 4,096 (`DFLASH_BRANCHES=8` there). On
the CPU the BLAS is the bound and R rows cost about R times the product work: one row.

    DFLASH_BRANCHES unset: 8 rows on a CUDA GPU (within the budget above), 1 on the CPU
    DFLASH_BRANCHES=N      N rows, 1 .. 8, at any cache length (1: off)

Only verifies of MIN_WIDTH tokens or more take several rows: their attention is ours (fewq.py on
CUDA, cpuattn.py on the CPU), which reads a batched cache by its strides. MLX 0.32's CUDA
attention for 2 or 3 queries failed on the H200 with batched rows over the KV cache's buffer
(an illegal memory access). So on a CUDA GPU rows run only where the kernel takes the verify's
attention (`attention_takes_rows`: the kernel chosen, bf16/fp16, a head shape it supports);
elsewhere there (fp32, `DFLASH_VERIFY_ATTN=mlx`, other head shapes) the target loads with one
row (and a warning when DFLASH_BRANCHES asked for rows). On the CPU, MLX's attention and
cpuattn.py both read batched rows right.
"""

from __future__ import annotations

import os

import mlx.core as mx

from . import fewq, verifyattn

ENV = "DFLASH_BRANCHES"
MAX_ROWS = 8
MIN_WIDTH = 4  # verify tokens (anchor + drafts) below which a cycle verifies one row
DEFAULT_BUDGET_BYTES = 256 * 2**20  # R copies of the KV cache a default several-row verify may make


def configure() -> int:
    """DFLASH_BRANCHES as a row count, or this device's default when unset (a bad value raises,
    naming the variable)."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return default_rows()
    try:
        rows = int(value)
    except ValueError:
        rows = 0
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"{ENV}={value!r}: expected a row count from 1 to {MAX_ROWS}")
    return rows


def default_rows() -> int:
    """Rows a verify takes when DFLASH_BRANCHES is unset: MAX_ROWS on a CUDA GPU, where they paid
    end to end (sessions 24-25), one on the CPU, where each row costs its share of the BLAS."""
    return MAX_ROWS if verifyattn.cuda() else 1


def explicit() -> bool:
    """Whether DFLASH_BRANCHES names the rows (then they run at any cache length, and a target
    that cannot take them says so)."""
    return bool(os.environ.get(ENV, "").strip())


def budget() -> int | None:
    """Bytes of KV cache copies a several-row verify may make: DEFAULT_BUDGET_BYTES for the
    default rows, None (no limit) for rows DFLASH_BRANCHES asked for."""
    return None if explicit() else DEFAULT_BUDGET_BYTES


def kv_bytes_per_token(caches) -> int:
    """Bytes one token takes across these KV caches ([B, kv heads, length, head dim] keys and
    values); 0 while none holds anything."""
    total = 0
    for c in caches:
        keys = getattr(c, "keys", None)
        if keys is not None and keys.ndim == 4:
            total += 2 * keys.shape[1] * keys.shape[3] * keys.dtype.size
    return total


def rows_fit(rows: int, tokens: int, per_token: int, limit: int | None) -> bool:
    """Whether `rows` copies of a cache of `tokens` tokens stay within `limit` bytes (None: any)."""
    return limit is None or rows * tokens * per_token <= limit


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
