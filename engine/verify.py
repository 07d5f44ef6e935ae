"""The verify step: the target scores a whole block in one pass; greedy acceptance on device.

Acceptance is computed with MLX ops so the cycle needs a single host read (the summary array:
accepted count + the target's greedy ids) and nothing scales with the vocabulary in Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from . import tape as tape_mod
from .target import TargetModel


@dataclass
class Verified:
    """One verify pass, still lazy until `summary` is read."""

    block_len: int
    greedy: mx.array  # (B,) target argmax after each block position
    features: mx.array  # [1, B, K*D] captured target features of the block
    tape: tape_mod.Tape | None
    summary: mx.array  # (1 + B,): [accepted drafts, greedy ids...]


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
) -> Verified:
    """Run the target once over [anchor, drafts...] and queue acceptance; does not sync."""
    block = mx.concatenate([anchor.reshape(1).astype(mx.int32), drafts.astype(mx.int32)])[None]
    tp = tape_mod.Tape() if record_tape else None
    with tape_mod.recording(tp):
        logits, features = target.forward(block, caches)
    greedy = mx.argmax(logits[0], axis=-1).astype(mx.int32)
    accepted = greedy_accept(drafts, greedy)
    summary = mx.concatenate([accepted.reshape(1).astype(mx.int32), greedy])
    mx.async_eval(summary, features)
    return Verified(block.shape[1], greedy, features, tp, summary)
