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

Taps (`--grow-taps 4,11,...`) widen what the draft reads rather than what it computes: more target
layers are captured as context features. Depth and width (sessions 12, 17) each bought a few
hundredths of tau; both give the draft more compute over the same five target layers, while the
target's other 25 layers' states never reach it. `fc` gets one zero column block per new layer, in
the target's layer order (the capture concatenates layers in the order the forward runs them), so
the grown draft projects exactly the context it did. On a GPU the extra taps cost no launch (one
wider fc product); on a CPU a context row's fc grows by the new taps' columns.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

from ..draft import DFlashDraft

ZEROED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def grow(draft: DFlashDraft, extra: int = 0, mlp_width: int | None = None,
         taps: Sequence[int] = ()) -> DFlashDraft:
    """`draft` with `extra` identity layers after its own, every MLP widened to `mlp_width`
    and/or the target layers `taps` captured too (its weights copied, not shared); either way
    it computes what `draft` computes."""
    old_n, old_w = draft.config.num_hidden_layers, draft.config.intermediate_size
    width = mlp_width or old_w
    old_ids = list(draft.config.target_layer_ids)
    new_taps = sorted(set(taps) - set(old_ids))
    again = sorted(set(taps) & set(old_ids))
    if again:
        raise ValueError(f"--grow-taps {again}: already captured "
                         f"(the draft reads layers {old_ids})")
    n_target = draft.config.num_target_layers
    bad = [i for i in new_taps if i < 0 or (n_target and i >= n_target)]
    if bad:
        raise ValueError(f"--grow-taps {bad}: out of range for a target of {n_target} layers")
    if extra < 0 or width < old_w or (extra == 0 and width == old_w and not new_taps):
        raise ValueError(f"grow by at least one layer, to a wider MLP or by a tap (got {extra} "
                         f"layers, MLP {old_w} -> {width}, taps {list(taps)})")
    ids = sorted(old_ids + new_taps)
    cfg = dataclasses.replace(draft.config, num_hidden_layers=old_n + extra,
                              intermediate_size=width, target_layer_ids=ids,
                              extra=dict(draft.config.extra))
    grown = DFlashDraft(cfg)
    dtype = draft.fc.weight.dtype
    weights = {k: v.astype(dtype) for k, v in tree_flatten(grown.parameters())}
    for k, v in tree_flatten(draft.parameters()):
        if width > old_w and ".mlp.down_proj." in k:  # [hidden, W]: the new columns read nothing
            v = mx.concatenate([v, mx.zeros((v.shape[0], width - old_w), v.dtype)], axis=1)
        elif width > old_w and (".mlp.gate_proj." in k or ".mlp.up_proj." in k):  # [W, hidden]
            v = mx.concatenate([v, weights[k][old_w:]], axis=0)
        elif k == "fc.weight" and new_taps:  # [hidden, K*hidden]: each old layer's block moves
            v = _fc_with_taps(v, old_ids, ids)  # to its layer's slot, the new ones read nothing
        weights[k] = v
    for i in range(old_n, old_n + extra):
        for name in ZEROED:
            key = f"layers.{i}.{name}"
            weights[key] = mx.zeros_like(weights[key])
    grown.load_weights(list(weights.items()))
    mx.eval(grown.parameters())
    return grown


def _fc_with_taps(w: mx.array, old_ids: list[int], ids: list[int]) -> mx.array:
    """fc's weight for captures `ids` (sorted), holding the blocks it had for `old_ids` (sorted)
    and zeros for the rest: the same projection of the old layers' features."""
    d = w.shape[1] // len(old_ids)
    zero = mx.zeros((w.shape[0], d), w.dtype)
    blocks = {i: w[:, j * d : (j + 1) * d] for j, i in enumerate(sorted(old_ids))}
    return mx.concatenate([blocks.get(i, zero) for i in ids], axis=1)
