"""What a training step computes: the target's features, the draft's block hidden states, the loss.

All blocks of a batch run in ONE pass: queries [S, A*B], keys [context (L) ; all blocks (A*B)] per
sequence with a sparse boolean mask (a block sees the context strictly before its anchor and its
own block, bidirectionally; never another block), so context K/V are computed once per sequence.

Loss per block position k = 1..B-1 (predicting the token at anchor+k), weighted
w_k = exp(-(k-1)/gamma) and averaged over valid positions:
    (1 - a) * CE(label)  +  a * KL(target || draft)
where the target's distribution for position k is the target's own logits at row anchor+k-1 (the
data are the target's greedy outputs, so CE is the hard-label limit of the same signal). The label
is the data's token, or with `argmax_labels` the target's own argmax at that row: what a greedy
verify checks the draft against, also where the data's answer was sampled (about half the cache;
28.5% of sampled tokens are not the target's argmax, scripts/label_agreement.py).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..draft import DFlashDraft
from ..target import TargetModel


def default_gamma(block_size: int) -> float:
    """The paper's decay: 7 for B=16, 5 for B=10, 4 for B=8 (about B/2.2 in between)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size / 2.2))


def position_weights(block_size: int, gamma: float | None = None) -> mx.array:
    g = gamma or default_gamma(block_size)
    return mx.exp(-mx.arange(block_size - 1, dtype=mx.float32) / g)


def target_pass(
    target: TargetModel, tokens: mx.array, rows: mx.array | None = None
) -> tuple[mx.array, mx.array | None]:
    """The frozen target over a batch [S, L]: (captured features [S, L, K*D], and when `rows`
    [S, A, R] is given the target's final hidden states at those rows [S, A, R, D]).

    Only the needed rows ever reach the LM head (inside the loss), never all L of them.
    """
    h, feats = target.capture(lambda: target.inner(tokens))
    feats = mx.stop_gradient(feats)
    if rows is None:
        return feats, None
    S, A, R = rows.shape
    hr = mx.take_along_axis(h, rows.reshape(S, A * R, 1), axis=1)
    return feats, mx.stop_gradient(hr.reshape(S, A, R, h.shape[-1]))


def block_hidden(
    draft: DFlashDraft, target: TargetModel, feats: mx.array, anchor_ids: mx.array,
    anchors: mx.array, block_lens: mx.array | None = None,
) -> mx.array:
    """Draft hidden states [S, A, B, D] for A blocks per sequence, all in one pass.

    feats [S, L, K*D] are the target features of each (padded) sequence; block a of sequence s
    is [anchor_ids[s,a], MASK...] at positions anchors[s,a] + 0..B-1. Uses the draft's own
    modules, so it computes exactly what DFlashDraft.__call__ computes at inference. Runs in the
    dtype of the draft's weights (the trainer hands it bf16 copies of fp32 masters on a GPU).

    block_lens [S, A] (None: all B): block a is [anchor, MASK x (len-1)], a block cut short as
    inference runs it for a short verify window (--short-block-frac): its rows see only its first
    len rows, so rows 0..len-1 are what a len-row block computes (the rest are never read).
    """
    cfg = draft.config
    S, A = anchors.shape
    B, D, H, Hkv, hd = (cfg.block_size, cfg.hidden_size, cfg.num_attention_heads,
                        cfg.num_key_value_heads, cfg.head_dim)
    dt = draft.fc.weight.dtype
    masks = mx.full((S, A, B - 1), cfg.mask_token_id, mx.int32)
    blocks = mx.concatenate([anchor_ids[..., None].astype(mx.int32), masks], axis=-1)
    h = target.embed(blocks).astype(dt).reshape(S, A * B, D)
    ctx = draft.project(feats.astype(dt))
    L = ctx.shape[1]
    # context row j is visible to block a iff j < anchor; block rows see only their own block
    ctx_ok = mx.arange(L)[None, None, :] < anchors[:, :, None]
    ctx_ok = mx.broadcast_to(ctx_ok[:, :, None, :], (S, A, B, L)).reshape(S, A * B, L)
    blk = mx.arange(A * B) // B
    blk_ok = mx.broadcast_to((blk[:, None] == blk[None, :])[None], (S, A * B, A * B))
    if block_lens is not None:  # a key row past its block's length does not exist
        blk_ok = blk_ok & ((mx.arange(A * B) % B)[None, :] < block_lens[:, blk])[:, None, :]
    mask = mx.concatenate([ctx_ok, blk_ok], axis=-1)[:, None]
    offs = anchors.reshape(S * A)

    def per_seq(t: mx.array, heads: int) -> mx.array:  # [S*A, h, B, hd] -> [S, h, A*B, hd]
        return t.reshape(S, A, heads, B, hd).transpose(0, 2, 1, 3, 4).reshape(S, heads, A * B, hd)

    for layer in draft.layers:
        at = layer.self_attn
        x = layer.input_layernorm(h)
        xb = x.reshape(S * A, B, D)
        q = at.q_norm(at.q_proj(xb).reshape(S * A, B, H, hd)).transpose(0, 2, 1, 3)
        q = at.rope(q, offset=offs)
        kb, vb = at._kv(xb, offs)
        kc, vc = at._kv(ctx, 0)
        k = mx.concatenate([kc, per_seq(kb, Hkv)], axis=2)
        v = mx.concatenate([vc, per_seq(vb, Hkv)], axis=2)
        o = mx.fast.scaled_dot_product_attention(per_seq(q, H), k, v, scale=at.scale, mask=mask)
        h = h + at.o_proj(o.transpose(0, 2, 1, 3).reshape(S, A * B, H * hd))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return draft.norm(h).reshape(S, A, B, D)


def _head(target: TargetModel, h: mx.array) -> mx.array:
    """The target's LM head in the target's dtype (the big matmul), logits back in fp32."""
    head_dt = target.inner.embed_tokens.weight.dtype
    if head_dt in (mx.float32, mx.bfloat16, mx.float16):
        h = h.astype(head_dt)
    return target.lm_head(h).astype(mx.float32)


def block_loss(
    draft: DFlashDraft, target: TargetModel, weights_k: mx.array, feats: mx.array,
    anchor_ids: mx.array, anchors: mx.array, labels: mx.array, valid: mx.array,
    block_lens: mx.array | None = None, target_hidden: mx.array | None = None,
    kl_weight: float = 0.0,
    argmax_labels: bool = False,
) -> tuple[mx.array, ...]:
    """(loss, top-1 accuracy at block position 1, mean accepted length per block, CE, KL,
    accepted drafts per block [S, A]).

    target_hidden [S, A, B-1, D]: the target's final hidden states at rows anchor+k-1 (see
    target_pass); needed when kl_weight > 0 or with argmax_labels. KL is 0 when it is not
    computed. argmax_labels: `labels` are replaced by the target's argmax at those rows (the
    accuracy and accepted lengths then count against it too).
    block_lens: see block_hidden; `valid` must already be False past each block's length.
    """
    h = block_hidden(draft, target, feats, anchor_ids, anchors, block_lens)[:, :, 1:]
    logits = _head(target, h)
    w = valid.astype(mx.float32) * weights_k
    denom = mx.maximum(w.sum(), 1.0)
    kl = mx.array(0.0)
    if (kl_weight > 0 or argmax_labels) and target_hidden is None:
        raise ValueError("KL and argmax labels need the target's hidden states at the block rows")
    t_logits = (_head(target, mx.stop_gradient(target_hidden))
                if kl_weight > 0 or argmax_labels else None)
    if argmax_labels:
        labels = mx.stop_gradient(mx.argmax(t_logits, axis=-1)).astype(labels.dtype)
    if kl_weight > 0:
        d_logp = nn.log_softmax(logits, axis=-1)  # once, for both terms
        ce = (-mx.take_along_axis(d_logp, labels[..., None], axis=-1)[..., 0] * w).sum() / denom
        t_logp = nn.log_softmax(t_logits, axis=-1)
        kl_pos = (mx.exp(t_logp) * (t_logp - d_logp)).sum(-1)
        kl = (kl_pos * w).sum() / denom
        loss = (1.0 - kl_weight) * ce + kl_weight * kl
    else:
        ce = (nn.losses.cross_entropy(logits, labels, reduction="none") * w).sum() / denom
        loss = ce
    correct = (mx.argmax(logits, axis=-1) == labels) & valid
    acc1 = correct[..., 0].sum() / mx.maximum(valid[..., 0].sum(), 1)
    accepted = mx.cumprod(correct.astype(mx.float32), axis=-1).sum(-1)  # [S, A]
    sg = mx.stop_gradient
    return loss, sg(acc1), sg(accepted.mean()), sg(ce), sg(kl), sg(accepted)


def cast_tree(tree: Any, dtype: mx.Dtype) -> Any:
    from mlx.utils import tree_map

    return tree_map(lambda p: p if p.dtype == dtype else p.astype(dtype), tree)
