"""Depth growth: a trained draft with more layers that starts out proposing exactly what it did.

The campaign's held-out tau stopped moving at ~3.27 (H200, 256 tokens) from session 8 on, over
14M more blocks and 60K fresh sequences; a draft of 5 layers may simply be too small to follow
the target further. Training a deeper draft from scratch would throw away ~84M blocks of
training, so `train-draft --resume DIR --grow-layers N` appends N layers whose output projections
(attention o_proj, MLP down_proj) are zero: each adds nothing to the residual stream, the grown
draft's proposals equal the old one's, and training moves them from there (their other matrices
get gradients once the output projections leave zero, after the first step).
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
from mlx.utils import tree_flatten

from ..draft import DFlashDraft

ZEROED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def grow(draft: DFlashDraft, extra: int) -> DFlashDraft:
    """`draft` with `extra` identity layers after its own (its weights copied, not shared)."""
    if extra < 1:
        raise ValueError(f"grow by at least one layer (got {extra})")
    old_n = draft.config.num_hidden_layers
    cfg = dataclasses.replace(draft.config, num_hidden_layers=old_n + extra,
                              extra=dict(draft.config.extra))
    grown = DFlashDraft(cfg)
    dtype = draft.fc.weight.dtype
    weights = dict(tree_flatten(grown.parameters()))
    weights = {k: v.astype(dtype) for k, v in weights.items()}
    weights.update(tree_flatten(draft.parameters()))
    for i in range(old_n, old_n + extra):
        for name in ZEROED:
            key = f"layers.{i}.{name}"
            weights[key] = mx.zeros_like(weights[key])
    grown.load_weights(list(weights.items()))
    mx.eval(grown.parameters())
    return grown
