"""`dflash train-draft`: train a DFlash draft for any mlx-lm target, offline, in MLX.

Recipe (DFlash paper): responses regenerated greedily by the target; per sequence a batch of
random anchors inside the response, each starting a block [anchor, MASK x (B-1)] at absolute
positions anchor..anchor+B-1 that sees the target's context features strictly before the anchor
plus its own block (bidirectionally), never other blocks; position-decayed cross-entropy
w_k = exp(-(k-1)/gamma) on block positions 1..B-1; AdamW, cosine schedule with 4% warmup, grad
clip 1.0; the target's embedding and LM head stay frozen (only the draft's parameters train).

All blocks of a batch run in ONE pass: queries [S, A*B], keys [context (L) ; all blocks (A*B)]
per sequence with a sparse boolean mask, so context K/V are computed once per sequence.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .draft import DFlashDraft, DraftConfig, load_draft, save_draft
from .target import TargetModel, default_layer_ids

Log = Callable[[str], None]
_MASK_NAMES = ("<|mask|>", "<mask>", "[MASK]", "<mask_token>")


def default_gamma(block_size: int) -> float:
    """The paper's decay: 7 for B=16, 5 for B=10, 4 for B=8 (about B/2.2 in between)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size / 2.2))


def pick_mask_token(tokenizer: Any) -> int:
    """A token id that normal text never produces, for the draft's MASK slots.

    A dedicated mask token if the vocabulary has one; else the highest-id special/added token
    that is not BOS/EOS/PAD/UNK and does not appear in the chat template (SmolLM2: id 16,
    `<empty_output>`, a StarCoder-era special that chat never emits).
    """
    vocab = tokenizer.get_vocab()
    for name in _MASK_NAMES:
        if name in vocab:
            return int(vocab[name])
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    used = {getattr(hf, a, None) for a in ("bos_token", "eos_token", "pad_token", "unk_token")}
    template = getattr(tokenizer, "chat_template", None) or ""
    specials = [t for t in getattr(hf, "all_special_tokens", []) or []]
    added = getattr(hf, "added_tokens_decoder", {}) or {}
    specials += [str(t) for t in added.values()]
    cands = sorted(
        {vocab[t] for t in specials if t in vocab and t not in used and t not in template}
    )
    if not cands:
        raise ValueError("no unused special token for MASK: pass --mask-token-id")
    return int(cands[-1])


def draft_config_for(
    target: TargetModel, num_layers: int, block_size: int, mask_token_id: int,
    layer_ids: list[int] | None = None, num_capture: int = 5,
) -> DraftConfig:
    """A draft shaped like one of the target's layers (same hidden, heads, MLP width, rope)."""
    a = target.args
    get = lambda k, d=None: getattr(a, k, d)  # noqa: E731
    heads = get("num_attention_heads")
    rope = get("rope_theta") or (get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return DraftConfig(
        hidden_size=target.hidden_size,
        num_hidden_layers=num_layers,
        intermediate_size=get("intermediate_size") or 4 * target.hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=get("num_key_value_heads") or heads,
        head_dim=get("head_dim") or target.hidden_size // heads,
        vocab_size=target.vocab_size,
        target_layer_ids=list(layer_ids or default_layer_ids(target.num_layers, num_capture)),
        mask_token_id=int(mask_token_id),
        block_size=block_size,
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope),
        num_target_layers=target.num_layers,
    )


# --- the training forward ----------------------------------------------------------------------
def block_hidden(
    draft: DFlashDraft, target: TargetModel, feats: mx.array, anchor_ids: mx.array,
    anchors: mx.array,
) -> mx.array:
    """Draft hidden states [S, A, B, D] for A blocks per sequence, all in one pass.

    feats [S, L, K*D] are the target features of each (padded) sequence; block a of sequence s
    is [anchor_ids[s,a], MASK...] at positions anchors[s,a] + 0..B-1. Uses the draft's own
    modules, so it computes exactly what DFlashDraft.__call__ computes at inference.
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


def block_loss(
    draft: DFlashDraft, target: TargetModel, weights_k: mx.array, feats: mx.array,
    anchor_ids: mx.array, anchors: mx.array, labels: mx.array, valid: mx.array,
) -> tuple[mx.array, mx.array, mx.array]:
    """(weighted CE, top-1 accuracy at block position 1, mean accepted length per block)."""
    h = block_hidden(draft, target, feats, anchor_ids, anchors)[:, :, 1:]
    head_dt = target.inner.embed_tokens.weight.dtype
    if head_dt in (mx.float32, mx.bfloat16, mx.float16):
        h = h.astype(head_dt)  # the big LM-head matmul runs in the target's dtype
    logits = target.lm_head(h).astype(mx.float32)
    ce = nn.losses.cross_entropy(logits, labels, reduction="none")
    w = valid.astype(mx.float32) * weights_k
    loss = (ce * w).sum() / mx.maximum(w.sum(), 1.0)
    correct = (mx.argmax(logits, axis=-1) == labels) & valid
    acc1 = correct[..., 0].sum() / mx.maximum(valid[..., 0].sum(), 1)
    accept_len = mx.cumprod(correct.astype(mx.float32), axis=-1).sum(-1).mean()
    return loss, mx.stop_gradient(acc1), mx.stop_gradient(accept_len)


# --- options and the loop ----------------------------------------------------------------------
@dataclass
class TrainOptions:
    target: str
    out: str
    data_dir: str | None = None
    layers: int = 1
    block_size: int = 16
    num_capture: int = 5
    layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    steps: int = 1000
    time_budget_s: float | None = None
    lr: float = 6e-4
    warmup: float = 0.04
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float | None = None
    seqs_per_batch: int = 8
    anchors_per_seq: int = 16
    max_len: int = 512
    dtype: str | None = None
    compile: bool = True
    seed: int = 0
    prompts: str | None = None
    num_prompts: int = 600
    derive_prompts: int = 0
    heldout_per_kind: int = 8
    max_new_tokens: int = 256
    gen_batch_size: int = 64
    eval_max_tokens: int = 128
    eval_prompts: int | None = None
    log_every: int = 10
    ckpt_every: int = 200
    resume: bool = False
    init_from_target: bool = False
    extra: dict = field(default_factory=dict)


def _schedule(opts: TrainOptions, progress: float) -> float:
    if progress < opts.warmup:
        return opts.lr * max(progress / opts.warmup, 1e-3)
    p = (progress - opts.warmup) / max(1.0 - opts.warmup, 1e-9)
    lo = opts.lr * opts.min_lr_ratio
    return lo + (opts.lr - lo) * 0.5 * (1.0 + math.cos(math.pi * min(p, 1.0)))


def _init_from_target(draft: DFlashDraft, target: TargetModel) -> int:
    """Copy same-shaped projections from the target's last layers (a warm start)."""
    n = 0
    for dst, src in zip(draft.layers, target.layers[-len(draft.layers):]):
        for mod, name in [("self_attn", p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")] + [
            ("mlp", p) for p in ("gate_proj", "up_proj", "down_proj")
        ]:
            d = getattr(getattr(dst, mod), name)
            s = getattr(getattr(src, mod, None), name, None)
            if s is None or isinstance(s, nn.QuantizedLinear) or s.weight.shape != d.weight.shape:
                continue
            d.weight = s.weight.astype(d.weight.dtype)
            n += 1
    return n


def train_draft(opts: TrainOptions, log: Log = print) -> dict[str, Any]:
    """The whole pipeline: data -> training (target features per batch) -> save -> held-out evaluation."""
    from mlx.utils import tree_flatten, tree_unflatten
    import mlx.optimizers as optim
    from mlx_lm import load as mlx_load

    from . import traindata as td

    t_begin = time.perf_counter()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    data_dir = Path(opts.data_dir) if opts.data_dir else out / "data"
    ckpt = out / "checkpoint"
    on_gpu = mx.default_device() == mx.gpu
    dtype = opts.dtype or ("bfloat16" if on_gpu else "float32")
    mx.random.seed(opts.seed)

    model, tokenizer = mlx_load(opts.target)
    model.set_dtype(getattr(mx, dtype))
    if opts.resume and (ckpt / "config.json").is_file():
        draft = load_draft(ckpt)
        log(f"[train] resuming from {ckpt}")
    else:
        probe = TargetModel(model, [0])
        mask_id = opts.mask_token_id if opts.mask_token_id is not None else pick_mask_token(tokenizer)
        cfg = draft_config_for(probe, opts.layers, opts.block_size, mask_id, opts.layer_ids,
                               opts.num_capture)
        draft = DFlashDraft(cfg)
    cfg = draft.config
    target = TargetModel(model, cfg.target_layer_ids)
    if opts.init_from_target and not (opts.resume and (ckpt / "config.json").is_file()):
        log(f"[train] warm start: {_init_from_target(draft, target)} matrices from the target")
    mx.eval(draft.parameters())
    n_params = sum(v.size for _, v in tree_flatten(draft.parameters()))
    log(f"[train] target {opts.target} ({target.num_layers} layers, hidden {target.hidden_size}, "
        f"{dtype}) | draft {cfg.num_hidden_layers} layers, {n_params / 1e6:.1f}M params, "
        f"block {cfg.block_size}, capture {cfg.target_layer_ids}, mask id {cfg.mask_token_id}")

    # data: prompts (file / built-in + derived by the target) -> responses (cached, resumable)
    data_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    prompts = td.load_prompt_file(opts.prompts) if opts.prompts else td.builtin_prompts(opts.num_prompts, opts.seed)
    derived = td.cached_derived_prompts(model, tokenizer, opts.derive_prompts, data_dir / "derived_prompts.jsonl",
                                        opts.seed, opts.gen_batch_size, log)
    n_derived = len(derived)
    prompts = prompts + derived
    splits = td.split_heldout(prompts, opts.heldout_per_kind, opts.seed)
    train_prompts = [p for p, s in zip(prompts, splits) if s == "train"]
    heldout = [td.Sample(k, p, td.chat_ids(tokenizer, p), [], "heldout")
               for (k, p), s in zip(prompts, splits) if s == "heldout"]
    (data_dir / "heldout.jsonl").write_text("".join(json.dumps(asdict(s)) + "\n" for s in heldout))
    samples = td.generate_responses(model, tokenizer, train_prompts, ["train"] * len(train_prompts),
                                    data_dir / "responses.jsonl", opts.max_new_tokens,
                                    opts.gen_batch_size, log)
    t_gen = time.perf_counter() - t0
    store = td.TokenStore.from_samples(samples, opts.max_len)
    log(f"[data] {store.num_sequences} training sequences, {store.num_tokens} tokens "
        f"(prompts + responses in {t_gen:.0f}s)")

    # optimiser, state, resume
    optimizer = optim.AdamW(learning_rate=opts.lr, weight_decay=opts.weight_decay)
    optimizer.init(draft.trainable_parameters())
    step, elapsed = 0, 0.0
    if opts.resume and (ckpt / "trainer.json").is_file():
        st = json.loads((ckpt / "trainer.json").read_text())
        step, elapsed = st["step"], st["elapsed_s"]
        saved = mx.load(str(ckpt / "optimizer" / "state.safetensors"))
        optimizer.state = tree_unflatten(list(saved.items()))
        log(f"[train] resumed at step {step}, {elapsed:.0f}s of training done")

    gamma = opts.gamma or default_gamma(cfg.block_size)
    weights_k = mx.exp(-mx.arange(cfg.block_size - 1, dtype=mx.float32) / gamma)
    loss_and_grad = nn.value_and_grad(
        draft, lambda *a: block_loss(draft, target, weights_k, *a)
    )
    state = [draft.state, optimizer.state]

    def features(tokens: mx.array) -> mx.array:
        """The target's captured hidden states for a batch, computed on the fly (never trained)."""
        return mx.stop_gradient(target.forward(tokens, None, last_only=True)[1])

    def step_fn(feats, anchor_ids, anchors, labels, valid):
        (loss, acc1, alen), grads = loss_and_grad(feats, anchor_ids, anchors, labels, valid)
        grads, gnorm = optim.clip_grad_norm(grads, opts.grad_clip)
        optimizer.update(draft, grads)
        return loss, acc1, alen, gnorm

    if opts.compile:
        step_fn = mx.compile(step_fn, inputs=state, outputs=state)

    def progress(s: int, el: float) -> float:
        p = s / max(opts.steps, 1)
        if opts.time_budget_s:
            p = max(p, el / opts.time_budget_s)
        return p

    def save_checkpoint() -> None:
        save_draft(draft, ckpt)
        # in a subfolder: load_draft reads every *.safetensors next to config.json
        (ckpt / "optimizer").mkdir(exist_ok=True)
        mx.save_safetensors(str(ckpt / "optimizer" / "state.safetensors"), dict(tree_flatten(optimizer.state)))
        (ckpt / "trainer.json").write_text(json.dumps({"step": step, "elapsed_s": elapsed}))

    rng = np.random.default_rng(opts.seed * 1_000_003 + step)
    batches = td.iter_batches(store, opts.seqs_per_batch, opts.anchors_per_seq, cfg.block_size, rng)
    history: list[dict[str, float]] = []
    window: list[tuple[mx.array, ...]] = []
    block_tokens = opts.seqs_per_batch * opts.anchors_per_seq * cfg.block_size
    t_mark, s_mark = time.perf_counter(), step
    t_last = time.perf_counter()
    log_file = (out / "train_log.jsonl").open("a")
    while progress(step, elapsed) < 1.0:
        optimizer.learning_rate = _schedule(opts, progress(step, elapsed))
        batch = next(batches)
        res = step_fn(features(batch["tokens"]), batch["anchor_ids"], batch["anchors"], batch["labels"], batch["valid"])
        mx.async_eval(res, draft.state, optimizer.state)
        window.append(res)
        step += 1
        now = time.perf_counter()
        elapsed += now - t_last
        t_last = now
        if step % opts.log_every == 0 or progress(step, elapsed) >= 1.0:
            vals = np.array([[float(x.item()) for x in r] for r in window])
            mx.eval(draft.state)
            now = time.perf_counter()
            elapsed += now - t_last
            t_last = now
            dt = now - t_mark
            tps = (step - s_mark) * block_tokens / max(dt, 1e-9)
            p = progress(step, elapsed)
            eta = (elapsed / max(p, 1e-9)) * (1 - p)
            rec = {"step": step, "loss": float(vals[:, 0].mean()), "acc1": float(vals[:, 1].mean()),
                   "accept_len": float(vals[:, 2].mean()), "grad_norm": float(vals[:, 3].mean()),
                   "lr": float(optimizer.learning_rate.item()), "tokens_per_s": tps,
                   "elapsed_s": elapsed}
            history.append(rec)
            log_file.write(json.dumps(rec) + "\n")
            log_file.flush()
            log(f"[train] step {step} | loss {rec['loss']:.4f} | acc@1 {rec['acc1']:.3f} | "
                f"accept-len {rec['accept_len']:.2f} | lr {rec['lr']:.2e} | {tps:,.0f} block tok/s | "
                f"{elapsed:.0f}s, ETA {eta:.0f}s")
            window, t_mark, s_mark = [], now, step
        if opts.ckpt_every and step % opts.ckpt_every == 0:
            save_checkpoint()
    log_file.close()
    mx.eval(draft.state)
    save_checkpoint()
    draft.eval()
    save_draft(draft, out)
    t_train = elapsed

    # held-out evaluation with the real decoding loop
    t0 = time.perf_counter()
    eval_set = heldout[: opts.eval_prompts] if opts.eval_prompts else heldout
    report = evaluate(target, draft, tokenizer, eval_set, opts.eval_max_tokens, log)
    t_eval = time.perf_counter() - t0
    summary = {
        "target": opts.target, "draft_dir": str(out), "steps": step,
        "train_time_s": t_train, "generation_time_s": t_gen,
        "eval_time_s": t_eval, "total_time_s": time.perf_counter() - t_begin,
        "train_sequences": store.num_sequences, "train_tokens": store.num_tokens,
        "derived_prompts": n_derived, "heldout_prompts": len(eval_set), "final": history[-1] if history else {},
        "heldout": report, "config": cfg.to_dict(), "device": str(mx.default_device()),
        "options": {k: v for k, v in asdict(opts).items() if k != "extra"}, "dtype": dtype,
    }
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_model_card(out, summary)
    return summary


def evaluate(
    target: TargetModel, draft: DFlashDraft, tokenizer: Any, samples: list[Any],
    max_tokens: int = 128, log: Log = print,
) -> dict[str, Any]:
    """Acceptance and tokens per cycle of `draft` on prompts, overall and per prompt kind."""
    from .drafters import DFlashDrafter
    from .generate import Finished, stream_dflash_generate

    drafter = DFlashDrafter(draft, target)
    sums: dict[str, list[float]] = {}
    for s in samples:
        final = None
        for ev in stream_dflash_generate(
            target, drafter, tokenizer, s.prompt_ids, max_tokens, verify_window="full"
        ):
            if isinstance(ev, Finished):
                final = ev
        st = final.stats
        for key in (s.kind, "overall"):
            acc = sums.setdefault(key, [0, 0, 0, 0])
            acc[0] += 1
            acc[1] += st.generated_tokens
            acc[2] += st.accepted_drafts
            acc[3] += st.cycles
    report = {
        k: {"prompts": int(v[0]), "generated_tokens": int(v[1]),
            "acceptance": v[2] / max(v[1], 1), "tau": (v[2] + v[3]) / max(v[3], 1)}
        for k, v in sums.items()
    }
    for k, r in sorted(report.items()):
        log(f"[eval] {k:8s} {r['prompts']:3d} prompts | acceptance {r['acceptance']:.1%} | "
            f"tau {r['tau']:.2f} tokens/cycle")
    return report


def write_model_card(out: Path, s: dict[str, Any]) -> None:
    """README.md next to the draft: what it is, how it was trained, what it achieves."""
    c = s["config"]
    rows = "\n".join(
        f"| {k} | {r['prompts']} | {r['acceptance']:.1%} | {r['tau']:.2f} |"
        for k, r in sorted(s["heldout"].items())
    )
    o = s["options"]
    f = s.get("final") or {}
    text = f"""# DFlash draft for `{Path(s['target']).name}`

A block-diffusion speculative-decoding draft (DFlash) trained with `dflash train-draft`.
Load it with `dflash generate --model TARGET --draft {out.name}` or `load_pair(target, draft)`.
Output is always the target's own greedy text; the draft only sets the speed.

## Architecture
- {c['num_hidden_layers']} draft layers, hidden {c['hidden_size']}, {c['num_attention_heads']} heads /
  {c['num_key_value_heads']} KV heads, head_dim {c['head_dim']}, MLP {c['intermediate_size']}
- block size {c['block_size']}, mask token id {c['dflash_config']['mask_token_id']}
- target layers captured: {c['dflash_config']['target_layer_ids']} of {c['num_target_layers']}

## Training data
- {s['train_sequences']} prompts ({'file ' + str(o['prompts']) if o['prompts'] else 'built-in prompt set: chat, code, math, story, explain'}{f" + {s['derived_prompts']} written by the target itself (sampled user turns)" if s.get('derived_prompts') else ''}),
  responses regenerated greedily by the target (up to {o['max_new_tokens']} new tokens),
  {s['train_tokens']} tokens in all (prompt + response, cut at {o['max_len']})
- held-out prompts ({s['heldout_prompts']}) were never trained on

## Training
- {s['steps']} steps, {o['seqs_per_batch']} sequences x {o['anchors_per_seq']} random anchors per step
- AdamW lr {o['lr']}, cosine, {o['warmup']:.0%} warmup, grad clip {o['grad_clip']},
  loss decay gamma {o['gamma'] or default_gamma(c['block_size'])}; embedding and LM head frozen
- final loss {f.get('loss', float('nan')):.4f}, block accuracy@1 {f.get('acc1', float('nan')):.3f}
- device {s['device']}, target dtype {s['dtype']}; time: data {s['generation_time_s']:.0f}s,
  training {s['train_time_s']:.0f}s (target features computed per batch), evaluation {s['eval_time_s']:.0f}s

## Held-out acceptance (greedy, `stream_dflash_generate`, up to {o['eval_max_tokens']} tokens)
| prompt kind | prompts | acceptance | tokens per cycle (tau) |
|---|---|---|---|
{rows}
"""
    (out / "README.md").write_text(text)


# --- CLI -----------------------------------------------------------------------------------------
def _cli():
    import click

    @click.command("train-draft")
    @click.option("--target", required=True, help="Target model directory (mlx-lm format).")
    @click.option("--out", required=True, help="Output draft directory (published DFlash format).")
    @click.option("--data-dir", default=None, help="Cache of prompts + responses (default OUT/data).")
    @click.option("--layers", default=1, show_default=True, type=click.IntRange(1))
    @click.option("--block-size", default=16, show_default=True, type=click.IntRange(2))
    @click.option("--num-capture", default=5, show_default=True, help="Target layers captured (K).")
    @click.option("--mask-token-id", default=None, type=int, help="Default: an unused special token.")
    @click.option("--steps", default=1000, show_default=True, type=click.IntRange(1))
    @click.option("--time-budget-s", default=None, type=float, help="Stop training after this long (then save + eval).")
    @click.option("--lr", default=6e-4, show_default=True)
    @click.option("--seqs-per-batch", default=8, show_default=True)
    @click.option("--anchors-per-seq", default=16, show_default=True)
    @click.option("--max-len", default=512, show_default=True, help="Cut sequences here.")
    @click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default=None, help="Target dtype (default: bf16 on GPU, fp32 on CPU).")
    @click.option("--no-compile", is_flag=True)
    @click.option("--seed", default=0, show_default=True)
    @click.option("--prompts", default=None, help="Prompt file (JSONL with prompt/kind, or one per line).")
    @click.option("--num-prompts", default=600, show_default=True, help="Built-in prompts to use.")
    @click.option("--derive-prompts", default=0, show_default=True, help="Extra prompts the target writes itself (sampled user turns).")
    @click.option("--heldout-per-kind", default=8, show_default=True)
    @click.option("--max-new-tokens", default=256, show_default=True)
    @click.option("--gen-batch-size", default=64, show_default=True)
    @click.option("--eval-max-tokens", default=128, show_default=True)
    @click.option("--ckpt-every", default=200, show_default=True)
    @click.option("--log-every", default=10, show_default=True)
    @click.option("--resume", is_flag=True, help="Continue from OUT/checkpoint.")
    @click.option("--init-from-target", is_flag=True, help="Warm-start draft layers from the target's last layers.")
    def train_draft_command(**kw):
        """Train a DFlash draft for TARGET on its own greedy responses; writes OUT + README.md."""
        kw["compile"] = not kw.pop("no_compile")
        try:
            train_draft(TrainOptions(**kw), log=lambda s: click.echo(s, err=True))
        except (ValueError, FileNotFoundError) as e:
            raise click.ClickException(str(e)) from e

    return train_draft_command


train_draft_command = _cli()
