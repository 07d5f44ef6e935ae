"""The verify step: the target scores a whole block in one pass; acceptance on device.

Greedy (no sampling params): a draft is kept while it equals the target's argmax. Sampling:
speculative sampling (engine/sampling.py), exact for any draft. Logits processors (penalties,
logit bias: engine/processors.py) run on the block's logits first, each row with the history
the target alone would have had there, so both rules judge the drafts by the processed logits. Either way acceptance is MLX
ops, so the cycle needs a single host read (the summary array: accepted count + the emitted
ids) and nothing scales with the vocabulary in Python.

Greedy drafts may come as several rows [R, k-1] (engine/branches.py): the target scores all R
blocks in one batched pass over caches copied into R rows, and the row accepted furthest is
kept (row 0 on ties) -- its tokens, its features, its cache row -- all chosen on the device, so
to the caller the cycle looks like one verify of that row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx

from . import rollback
from . import sampling as sampling_mod
from . import tape as tape_mod
from .sampling import SamplingParams
from .target import TargetModel


@dataclass
class Verified:
    """One verify pass, still lazy until `summary` is read."""

    block_len: int
    tokens: mx.array  # (B,) slot i: the token emitted after block position i if i <= accepted
    features: mx.array  # [1, B, K*D] captured target features of the block
    tape: tape_mod.Tape | None
    summary: mx.array  # (1 + B,): [accepted drafts, tokens...]
    copied: bool = False  # the drafts were a copy proposal (engine/lookup.py), not the model's
    # the next cycle's draft, queued behind this verify on the bet that all its drafts are
    # accepted (engine/generate.py, run-ahead); the draft's context already holds this block
    ahead: mx.array | None = None
    rows: int = 1  # proposals verified in this pass; > 1: summary ends with the kept row's index
    whole_block: bool = False  # drafted whole, the window then chosen by the draft's confidence


def greedy_accept(drafts: mx.array, greedy: mx.array) -> mx.array:
    """Length of the longest prefix where drafts[..., i] == greedy[..., i] (the target's own
    choice), per row when drafts has rows."""
    match = (drafts == greedy[..., : drafts.shape[-1]]).astype(mx.int32)
    return mx.cumprod(match, axis=-1).sum(axis=-1)


def verify(
    target: TargetModel,
    caches: list[Any],
    anchor: mx.array,
    drafts: mx.array,
    record_tape: bool,
    sampling: SamplingParams | None = None,
    key: mx.array | None = None,
    q: mx.array | None = None,
    forced: mx.array | None = None,
    process: Callable[[mx.array, mx.array], mx.array] | None = None,
) -> Verified:
    """Run the target once over [anchor, drafts...] and queue acceptance; does not sync.

    Greedy when `sampling` is None; otherwise `key` drives the draws and `q` (k, V) holds the
    probs the drafts were drawn from (None: a deterministic drafter, q one-hot at the drafts).
    Greedy drafts [R, k-1] with R > 1: see `verify_rows`. `forced` (k,), greedy only: where
    >= 0, a teacher's ids stand in for the target's choices (generate.py's `teacher`: timing
    runs on a fixed text; the target's pass and argmax still run, so the cost is a real cycle's).
    `process(logits (k, V), block (k,))`: the logits processors, bound to the history before the
    anchor (engine/processors.py); one draft row only.
    """
    if forced is not None and sampling is not None:  # before the pass: the caches stay as they were
        raise ValueError("a teacher's ids stand in for greedy choices only")
    if drafts.ndim == 2:
        if sampling is not None or record_tape:
            raise ValueError("several draft rows are verified greedily over KV caches only")
        if drafts.shape[0] > 1:
            if process is not None:
                raise ValueError("several draft rows are verified without logits processors")
            return verify_rows(target, caches, anchor, drafts, forced)
        drafts = drafts[0]
    plain = drafts.shape[0] == 0  # a plain decode step: nothing to accept, no ops spent on it
    anchor = anchor.reshape(1).astype(mx.int32)
    drafts = drafts.astype(mx.int32)
    block = (anchor if plain else mx.concatenate([anchor, drafts]))[None]
    tp = tape_mod.Tape() if record_tape else None
    with tape_mod.recording(tp):
        logits, features = target.forward(block, caches, eager=not plain)
    logits = logits[0] if process is None else process(logits[0], block[0])
    accepted = mx.array(0, mx.int32)  # what a plain step accepts
    if sampling is None:
        tokens = taught(sampling_mod.greedy_ids(logits), forced)
        if not plain:
            accepted = greedy_accept(drafts, tokens)
    elif plain:  # one draw from p
        tokens = sampling_mod.sample(logits, sampling, key)
    else:
        p = sampling_mod.probs(logits, sampling)
        accepted, tokens = sampling_mod.accept(p, drafts, q, key)
    summary = mx.concatenate([accepted.reshape(1).astype(mx.int32), tokens])
    mx.async_eval(summary, features)
    return Verified(block.shape[1], tokens, features, tp, summary)


def taught(greedy: mx.array, forced: mx.array | None) -> mx.array:
    """The target's greedy ids, or the teacher's where it has one (>= 0; past its end: none)."""
    if forced is None:
        return greedy
    short = greedy.shape[-1] - forced.shape[0]
    if short > 0:
        forced = mx.concatenate([forced, mx.full((short,), -1, mx.int32)])
    return mx.where(forced >= 0, forced, greedy)


def verify_rows(target: TargetModel, caches: list[Any], anchor: mx.array, drafts: mx.array,
                forced: mx.array | None = None) -> Verified:
    """Greedy verify of R draft rows [R, k-1] after one anchor in one batched pass; keeps the
    row accepted furthest (caches, tokens, features), all lazily on the device."""
    rows, width = drafts.shape[0], drafts.shape[1] + 1
    anchor = mx.broadcast_to(anchor.reshape(1, 1).astype(mx.int32), (rows, 1))
    block = mx.concatenate([anchor, drafts.astype(mx.int32)], axis=1)
    rollback.tile_rows(caches, rows)
    logits, features = target.forward(block, caches, eager=True)
    greedy = taught(sampling_mod.greedy_ids(logits), forced)  # [R, k]
    accepted = greedy_accept(block[:, 1:], greedy)  # [R]
    best = mx.argmax(accepted).astype(mx.int32)  # the first of the longest: row 0 on ties
    rollback.keep_row(caches, best)
    tokens = greedy[best]
    features = mx.take(features, best.reshape(1), axis=0)
    summary = mx.concatenate([accepted[best].reshape(1), tokens, best.reshape(1)])
    mx.async_eval(summary, features)
    return Verified(width, tokens, features, None, summary, rows=rows)
