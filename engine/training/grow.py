"""Growth: a trained draft with more layers or wider MLPs that starts out proposing exactly what it did.

The campaign's held-out tau stopped moving at ~3.27 (H200, 256 tokens) from session 8 on, over
14M more blocks and 60K fresh sequences; a draft of 5 layers may simply be too small to follow
the target further. Training a deeper draft from scratch would throw away ~84M blocks of
training, so `train-draft --resume DIR --grow-layers N` appends N layers whose output projections
(attention o_proj, MLP down_proj) are zero: each adds nothing to the residual stream, the grown
draft's proposals equal the old one's, and training moves them from there (their other matrices
get gradients once the output projections leave zero, after the first step).

Width (`--grow-mlp W`) is the same idea inside each layer: the MLPs' intermediate size becomes W,
the new gate/up rows start random and the new down_proj columns zero, so the MLPs' outputs are
unchanged. Depth buys launches on a GPU (the 8-layer draft's pass was ~40% dearer on the H200,
session 12); a wider MLP keeps the draft's kernel count.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
from mlx.utils import tree_flatten

from ..draft import DFlashDraft

ZEROED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def grow(draft: DFlashDraft, extra: int = 0, mlp_width: int | None = None) -> DFlashDraft:
    """`draft` with `extra` identity layers after its own and/or every MLP widened to `mlp_width`
    (its weights copied, not shared); either way it computes what `draft` computes."""
    old_n, old_w = draft.config.num_hidden_layers, draft.config.intermediate_size
    width = mlp_width or old_w
    if extra < 0 or width < old_w or (extra == 0 and width == old_w):
        raise ValueError(f"grow by at least one layer or to a wider MLP (got {extra} layers, "
                         f"MLP {old_w} -> {width})")
    cfg = dataclasses.replace(draft.config, num_hidden_layers=old_n + extra,
                              intermediate_size=width, extra=dict(draft.config.extra))
    grown = DFlashDraft(cfg)
    dtype = draft.fc.weight.dtype
    weights = {k: v.astype(dtype) for k, v in tree_flatten(grown.parameters())}
    for k, v in tree_flatten(draft.parameters()):
        if width > old_w and ".mlp.down_proj." in k:  # [hidden, W]: the new columns read nothing
            v = mx.concatenate([v, mx.zeros((v.shape[0], width - old_w), v.dtype)], axis=1)
        elif width > old_w and (".mlp.gate_proj." in k or ".mlp.up_proj." in k):  # [W, hidden]
            v = mx.concatenate([v, weights[k][old_w:]], axis=0)
        weights[k] = v
    for i in range(old_n, old_n + extra):
        for name in ZEROED:
            key = f"layers.{i}.{name}"
            weights[key] = mx.zeros_like(weights[key])
    grown.load_weights(list(weights.items()))
    mx.eval(grown.parameters())
    return grown
