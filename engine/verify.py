"""The verify step: the target scores a whole block in one pass; acceptance on device.

Greedy (no sampling params): a draft is kept while it equals the target's argmax. Sampling:
speculative sampling (engine/sampling.py), exact for any draft. Either way acceptance is MLX
ops, so the cycle needs a single host read (the summary array: accepted count + the emitted
ids) and nothing scales with the vocabulary in Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

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


def greedy_accept(drafts: mx.array, greedy: mx.array) -> mx.array:
    """Length of the longest prefix where drafts[i] == greedy[i] (the target's own choice)."""
    match = (drafts == greedy[: drafts.shape[0]]).astype(mx.int32)
    return mx.cumprod(match).sum()


def verify(
    target: TargetModel,
    caches: list[Any],
    anchor: mx.array,
    drafts: mx.array,
    record_tape: bool,
    sampling: SamplingParams | None = None,
    key: mx.array | None = None,
    q: mx.array | None = None,
) -> Verified:
    """Run the target once over [anchor, drafts...] and queue acceptance; does not sync.

    Greedy when `sampling` is None; otherwise `key` drives the draws and `q` (k, V) holds the
    probs the drafts were drawn from (None: a deterministic drafter, q one-hot at the drafts).
    """
    plain = drafts.shape[0] == 0  # a plain decode step: nothing to accept, no ops spent on it
    anchor = anchor.reshape(1).astype(mx.int32)
    drafts = drafts.astype(mx.int32)
    block = (anchor if plain else mx.concatenate([anchor, drafts]))[None]
    tp = tape_mod.Tape() if record_tape else None
    with tape_mod.recording(tp):
        logits, features = target.forward(block, caches, eager=not plain)
    accepted = mx.array(0, mx.int32)  # what a plain step accepts
    if sampling is None:
        tokens = mx.argmax(logits[0], axis=-1).astype(mx.int32)
        if not plain:
            accepted = greedy_accept(drafts, tokens)
    elif plain:  # one draw from p
        tokens = sampling_mod.sample(logits[0], sampling, key)
    else:
        p = sampling_mod.probs(logits[0], sampling)
        accepted, tokens = sampling_mod.accept(p, drafts, q, key)
    summary = mx.concatenate([accepted.reshape(1).astype(mx.int32), tokens])
    mx.async_eval(summary, features)
    return Verified(block.shape[1], tokens, features, tp, summary)
