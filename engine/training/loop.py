"""`dflash train-draft`: train a DFlash draft for any mlx-lm target, offline, in MLX.

Recipe (DFlash paper): responses regenerated greedily by the target; per sequence a batch of
random anchors inside the response, each starting a block [anchor, MASK x (B-1)] that sees the
target's context features strictly before the anchor plus its own block; position-decayed loss
(objective.py); AdamW with grad clip 1.0; the target's embedding and LM head stay frozen.

What this trainer is built around (issue #10):
- FIXED batch shapes ([S, seq_len] tokens, A anchors per sequence): the compiled step traces
  once; the first --compile-steps steps (trace + kernel JIT) run before the time budget starts.
- A STEP-based schedule (schedule.py): lr is a function of the campaign's global step only;
  --max-steps / --time-budget-s stop this session, never bend the cosine.
- fp32 master weights; the draft's maths in --compute-dtype (bf16 on a GPU): inside the loss the
  masters are cast and loaded into the draft, so gradients flow back to fp32 through the cast.
- Checkpoints of bf16 weights in <= 15 MB parts + trainer.json (checkpoint.py): small enough to
  bring back from a lent GPU; --resume DIR continues the campaign (re-warm-up when the optimiser
  moments were not kept), --init-draft PATH starts a new campaign from a draft's weights.
- Data parallel over MLX's distributed group (`mlx.launch --backend nccl -n 2 scripts/train_dist.py`):
  each rank generates its shard of the responses and trains on its shard of every global batch;
  gradients are averaged before the optimiser step; rank 0 logs, checkpoints and evaluates.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import draftvocab
from ..draft import DFlashDraft, DraftConfig, save_draft
from ..drafters import check_fit
from ..launch import stops_once
from ..target import TargetModel, default_layer_ids
from . import checkpoint as ck
from .checks import ARCH_OPTIONS, DATA_OPTIONS, campaign_data_options, preflight
from . import data as td
from .budget import Budget
from .grow import grow
from .memory import StepShape, check_step_memory
from .objective import block_loss, cast_tree, default_gamma, position_weights, target_pass
from .report import EvalInterrupted, evaluate, write_model_card
from .vocab import rank_samples
from .schedule import Schedule, warmup_steps_for

Log = Callable[[str], None]
_MASK_NAMES = ("<|mask|>", "<mask>", "[MASK]", "<mask_token>")


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
    cfg = DraftConfig(
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
    # the target's context length and RoPE scaling, where DraftConfig carries them (the draft's
    # positions are the target's)
    for k in ("max_position_embeddings", "rope_scaling", "tie_word_embeddings"):
        if hasattr(cfg, k) and get(k) is not None:
            setattr(cfg, k, get(k))
    return cfg


# --- options -------------------------------------------------------------------------------------
@dataclass
class TrainOptions:
    target: str
    out: str
    data_dir: str | None = None
    # the draft
    layers: int = 1
    block_size: int = 16
    num_capture: int = 5
    layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    init_draft: str | None = None  # start a new campaign from this draft's weights
    init_from_target: bool = False
    # the campaign's schedule (a function of the global step)
    total_steps: int | None = None  # default: --max-steps, else 10000; a resume keeps its own
    lr: float = 6e-4
    warmup: float = 0.04  # fraction of total_steps (< 1) or steps (>= 1)
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    # this session
    max_steps: int | None = None
    time_budget_s: float | None = None  # training time, counted after the compile steps
    compile_steps: int = 2
    resume: str | None = None  # a checkpoint folder
    rewarmup_steps: int = 200
    grow_layers: int = 0  # with --resume / --init-draft: append this many identity layers (grow.py)
    grow_mlp: int = 0  # with --resume / --init-draft: widen every MLP to this intermediate size (grow.py)
    grow_taps: list[int] = field(default_factory=list)  # with --resume / --init-draft: capture these target layers too
    restart_lr: float | None = None  # on --resume: a warm restart, a new cosine from this lr
    # the step
    gamma: float | None = None
    kl_weight: float = 0.0
    argmax_labels: bool = False  # labels: the target's argmax at each block row, not the data's token
    miss_anchor_frac: float = 0.0
    early_anchor_frac: float = 0.0
    early_anchor_window: int = 128
    short_block_frac: float = 0.0  # share of blocks cut short, as short verify windows run them
    short_block_max: int = 4  # their lengths: 2..this (anchor + 1..this-1 masks)
    seqs_per_batch: int = 16  # per rank
    anchors_per_seq: int = 64
    max_len: int = 640
    dtype: str | None = None  # the target's (default bf16 on GPU, fp32 on CPU)
    compute_dtype: str | None = None  # the draft's maths (default bf16 on GPU, fp32 on CPU)
    compile: bool = True
    seed: int = 0
    # data
    prompts: str | None = None
    num_prompts: int = 600
    derive_prompts: int = 0
    exclude_prompts: str | None = None  # prompts (file) NOT trained on this session
    heldout_file: str | None = None
    max_new_tokens: int = 256
    sampled_responses: float = 0.0  # share of prompts answered by sampling (data.is_sampled)
    response_temperature: float = 0.7
    train_responses: str = "all"  # which cached answers are trained on: all, greedy, sampled
    gen_batch_size: int = 64
    data_only: bool = False
    # evaluation, logs, checkpoints
    eval_max_tokens: int = 128
    eval_prompts: int | None = None  # None: all held-out prompts; 0: no evaluation
    log_every: int = 10
    ckpt_every: int = 500
    part_mb: float = 15.0
    save_optimizer: bool = False


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




# --- the distributed group -----------------------------------------------------------------------
class Dist:
    """MLX's distributed group (size 1 without a launcher); rank 0 is the one that writes."""

    def __init__(self) -> None:
        self.group = mx.distributed.init()
        self.rank, self.size = self.group.rank(), self.group.size()
        self.main = self.rank == 0

    def barrier(self) -> None:
        if self.size > 1:
            mx.eval(mx.distributed.all_sum(mx.array([1.0]), group=self.group))

    def any(self, flag: bool) -> bool:
        """True on every rank when any rank says so (a collective: call it at the same step)."""
        if self.size == 1:
            return flag
        return float(mx.distributed.all_sum(mx.array([float(flag)]), group=self.group).item()) > 0

    def share(self, value: float, flag: bool) -> tuple[float, bool]:
        """Rank 0's `value` and whether any rank's `flag` is set, on every rank (a collective)."""
        if self.size == 1:
            return value, flag
        both = mx.array([value if self.main else 0.0, float(flag)])
        got, anyone = mx.distributed.all_sum(both, group=self.group).tolist()
        return got, anyone > 0



class CtrlC:
    """While training: the first Ctrl-C, or SIGTERM (`timeout`, `kill`, a service manager), asks
    the loop to stop after the step in flight and save its checkpoint (a KeyboardInterrupt in
    the middle of a step would lose every step since the last periodic checkpoint); a second
    one interrupts at once. Off outside the main thread."""

    SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}

    def __init__(self, say: Log) -> None:
        self.say, self.pressed, self._old = say, False, {}

    def __enter__(self) -> "CtrlC":
        if threading.current_thread() is threading.main_thread():
            self._old = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True
        name = self.SIGNALS.get(signum, "a signal")
        self.say(f"[train] {name}: stopping after this step and saving the checkpoint "
                 f"({name} again to quit without saving it)")


def _sources(opts: TrainOptions) -> str:
    """Where this run's prompts come from, in the words of its flags (for error lines)."""
    parts = [f"--prompts {opts.prompts}" if opts.prompts else f"--num-prompts {opts.num_prompts}"]
    if opts.derive_prompts:
        parts.append(f"--derive-prompts {opts.derive_prompts}")
    return " + ".join(parts)


def _dtype(name: str | None, on_gpu: bool) -> mx.Dtype:
    return getattr(mx, name or ("bfloat16" if on_gpu else "float32"))


_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


def _step_shape(opts: TrainOptions, cfg: DraftConfig, target: TargetModel, model: nn.Module,
                draft: DFlashDraft, seq_len: int, tdt: mx.Dtype, cdt: mx.Dtype) -> StepShape:
    """One step's shapes (memory.StepShape) for this run, its data `seq_len` tokens long."""
    from mlx.utils import tree_flatten

    args = target.args
    # a dense target's MLP width (a mixture of experts runs narrower rows per token: not counted)
    moe = any(getattr(args, k, None) for k in _MOE_KEYS)
    size = getattr(args, "intermediate_size", None) or 0
    size = max(size) if isinstance(size, (list, tuple)) and size else size  # some give one per layer
    width = 0 if moe or not isinstance(size, int) else size
    return StepShape(
        seqs=opts.seqs_per_batch, seq_len=seq_len, anchors=opts.anchors_per_seq,
        block_size=cfg.block_size, hidden=target.hidden_size, vocab=target.vocab_size,
        num_capture=len(cfg.target_layer_ids), target_intermediate=width,
        draft_layers=cfg.num_hidden_layers, draft_intermediate=cfg.intermediate_size,
        heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        target_weight_bytes=sum(v.nbytes for _, v in tree_flatten(model.parameters())),
        draft_params=sum(v.size for _, v in tree_flatten(draft.trainable_parameters())),
        target_bytes=tdt.size, compute_bytes=cdt.size,
        target_logits=opts.kl_weight > 0)


# --- the pipeline --------------------------------------------------------------------------------
def train_draft(opts: TrainOptions, log: Log = print,
                explicit_arch: dict[str, Any] | None = None) -> dict[str, Any]:
    """Data -> training (target features per batch) -> checkpoint + draft -> held-out evaluation.

    `explicit_arch`: the architecture options a user typed, refused when a resume contradicts them.
    Before training (loading, tokenising, deriving prompts, answering them) Ctrl-C or SIGTERM
    raises KeyboardInterrupt at once (launch.stops_once; every finished batch is cached); while
    training, CtrlC stops after the step in flight."""
    with ExitStack() as before_training:
        before_training.enter_context(stops_once())
        return _train_draft(opts, log, explicit_arch, before_training.close)


def _train_draft(opts: TrainOptions, log: Log, explicit_arch: dict[str, Any] | None,
                 training_starts: Callable[[], None]) -> dict[str, Any]:
    """train_draft's work; `training_starts()` gives the signals back before CtrlC takes them."""
    from mlx.utils import tree_flatten, tree_unflatten
    import mlx.optimizers as optim

    from ..loading import load_target, resolve_model

    notes = preflight(opts, explicit_arch)  # before any model load or write
    t_begin = time.perf_counter()
    dist = Dist()
    say: Log = log if dist.main else (lambda s: None)
    for note in notes:
        say(f"[train] {note}")
    out = Path(opts.out)
    data_dir = Path(opts.data_dir) if opts.data_dir else out / "data"
    ckpt_dir = out / "checkpoint"
    on_gpu = mx.default_device() == mx.gpu
    tdt, cdt = _dtype(opts.dtype, on_gpu), _dtype(opts.compute_dtype, on_gpu)
    mx.random.seed(opts.seed)

    model, tokenizer = load_target(resolve_model(opts.target), opts.target)  # damage said in one line
    model.set_dtype(tdt)
    model.eval()

    # --- the draft: resumed, seeded from a draft, or new ---------------------------------------
    trainer: dict[str, Any] | None = None
    saved_opt = None
    grown = ""  # what --grow-* did, recorded in the session (a cut-short session is not grown twice)
    if opts.resume:
        trainer = ck.load_trainer(opts.resume)
        if trainer is None:
            raise FileNotFoundError(f"--resume {opts.resume}: no trainer.json (not a training checkpoint)")
        draft = ck.load_draft_any(opts.resume, mx.float32)
        saved_opt = ck.load_optimizer(opts.resume)
    elif opts.init_draft:
        draft = ck.load_draft_any(opts.init_draft, mx.float32)
    else:
        probe = TargetModel(model, [0])
        if opts.layer_ids is None and opts.num_capture > probe.num_layers:
            raise ValueError(f"--num-capture {opts.num_capture} is over the target's {probe.num_layers} layers")
        if opts.layers > probe.num_layers:  # --layers 100000 was killed for memory, without a word
            raise ValueError(f"--layers {opts.layers} is over the target's {probe.num_layers} layers: a draft "
                             "that deep costs more than the target's own pass, so it cannot speed it up")
        mask_id = opts.mask_token_id if opts.mask_token_id is not None else pick_mask_token(tokenizer)
        draft = DFlashDraft(draft_config_for(probe, opts.layers, opts.block_size, mask_id,
                                             opts.layer_ids, opts.num_capture))
    if opts.grow_layers or opts.grow_mlp or opts.grow_taps:
        if not (opts.resume or opts.init_draft):
            raise ValueError("--grow-layers / --grow-mlp / --grow-taps need a trained draft to grow "
                             "(--resume or --init-draft)")
        n_old, w_old = draft.config.num_hidden_layers, draft.config.intermediate_size
        taps_old = list(draft.config.target_layer_ids)
        draft = grow(draft, opts.grow_layers, opts.grow_mlp or None, opts.grow_taps)
        saved_opt = None  # the moments and masters of the old shape: re-warm-up instead
        grown = (f"{n_old} -> {draft.config.num_hidden_layers} layers, MLP {w_old} -> "
                 f"{draft.config.intermediate_size}, capture {taps_old} -> {draft.config.target_layer_ids}")
        say(f"[train] grown: {grown} (the new parts start as the identity: same proposals as before)")
    cfg = draft.config
    if cfg.block_size > opts.max_len:  # --block-size 100000 crashed the process (SIGSEGV) in the first step
        raise ValueError(f"block size {cfg.block_size} is over --max-len {opts.max_len}: a block longer than a "
                         "training sequence has nothing to learn past its end")
    if opts.short_block_frac > 0:  # inference may cut blocks this short (drafters.short_block_max)
        dc = cfg.extra.setdefault("dflash_config", {})
        dc["short_block_max"] = max(int(dc.get("short_block_max", 0)), opts.short_block_max)
    target = TargetModel(model, cfg.target_layer_ids)
    check_fit(draft, target)  # the drafter's own check, before any data or training work

    def step_shape(seq_len: int) -> StepShape:
        return _step_shape(opts, cfg, target, model, draft, seq_len, tdt, cdt)

    # one step's memory, before any data: the shortest sequences the data can give (32 tokens, or
    # --max-len) already rule out --seqs-per-batch 100000 or --block-size 100000; checked again
    # with the data's own length before the first step (memory.py)
    if not opts.data_only:
        check_step_memory(step_shape(min(opts.max_len, 32)), mx, length_known=False)
    if opts.init_from_target and not (opts.resume or opts.init_draft):
        say(f"[train] warm start: {_init_from_target(draft, target)} matrices from the target")
    master = cast_tree(draft.trainable_parameters(), mx.float32)
    if saved_opt is not None:
        master = tree_unflatten(list(saved_opt[1].items()))
    master = nn.average_gradients(master, dist.group)  # every rank starts from the same weights
    mx.eval(master)
    n_params = sum(v.size for _, v in tree_flatten(master))
    say(f"[train] target {opts.target} ({target.num_layers} layers, hidden {target.hidden_size}, "
        f"{str(tdt).split('.')[-1]}) | draft {cfg.num_hidden_layers} layers, {n_params / 1e6:.1f}M params (fp32 masters, "
        f"{str(cdt).split('.')[-1]} compute), block {cfg.block_size}, capture {cfg.target_layer_ids}, mask id "
        f"{cfg.mask_token_id} | {dist.size} rank(s) | "
        + (f"resumed from {opts.resume} at step {trainer['step']}" if trainer else
           f"initialised from {opts.init_draft}" if opts.init_draft else "new draft"))

    # --- data: prompts -> responses (cached; each rank its shard) ------------------------------
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)  # only now: a bad target or draft leaves nothing behind
    data_dir.mkdir(parents=True, exist_ok=True)
    td.check_answerer(data_dir, td.answerer_record(model, tokenizer, opts.max_new_tokens), say, write=dist.main)
    heldout_pairs = td.load_heldout(opts.heldout_file)
    held_text = {p for _, p in heldout_pairs}
    # --exclude-prompts: earlier sessions' prompts still count for deriving new ones (their number
    # seeds the draw) but are not trained on, so a session can spend its generation time on fresh
    # prompts only instead of regenerating responses the draft has already seen several times.
    if opts.exclude_prompts:
        td.check_exclude_file(opts.exclude_prompts, data_dir, dist.size)
    skip = {p for _, p in td.load_prompt_file(opts.exclude_prompts)} if opts.exclude_prompts else set()
    prompts = td.load_prompt_file(opts.prompts) if opts.prompts else td.builtin_prompts(opts.num_prompts, opts.seed)
    derived = td.cached_derived_prompts(model, tokenizer, opts.derive_prompts, data_dir, opts.seed,
                                        opts.gen_batch_size, say, dist.rank, dist.size, dist.barrier)
    seen: set[str] = set()
    train_prompts = []
    for k, p in prompts + derived:
        if p not in held_text and p not in skip and p not in seen:
            seen.add(p)
            train_prompts.append((k, p))
    if not train_prompts:
        raise ValueError(f"no prompts to train on: {_sources(opts)} gave {len(prompts) + len(derived)}, "
                         "none left after removing held-out and excluded ones")
    samples = td.collect_responses(model, tokenizer, train_prompts, data_dir, opts.max_new_tokens,
                                   opts.gen_batch_size, say, dist.rank, dist.size, dist.barrier,
                                   opts.sampled_responses, opts.response_temperature)
    t_gen = time.perf_counter() - t0
    n_all, samples = len(samples), td.responses_of_kind(samples, opts.train_responses)
    if opts.train_responses != "all":
        say(f"[data] {opts.train_responses} answers only: {len(samples)} of {n_all} cached responses")
    if not samples:
        raise ValueError(f"no responses to train on in {data_dir}")
    td.check_token_ids(samples, target.vocab_size, data_dir)
    longest = max(len(s.ids) for s in samples)
    seq_len = int(min(opts.max_len, -(-longest // 32) * 32))
    store = td.TokenStore.from_samples(samples, seq_len)
    say(f"[data] {store.num_sequences} training sequences, {store.num_tokens} tokens, sequence "
        f"length {seq_len} ({len(train_prompts)} prompts, {len(derived)} derived by the target; "
        f"{len(heldout_pairs)} held out; {len(skip)} excluded; {t_gen:.0f}s)")
    if opts.data_only:
        return {"data_only": True, "train_sequences": store.num_sequences,
                "train_tokens": store.num_tokens, "generation_time_s": t_gen}
    check_step_memory(step_shape(seq_len), mx)  # the sequences' real length: before any compile

    # --- schedule + optimiser --------------------------------------------------------------------
    if trainer:
        step = int(trainer["step"])
        sched = Schedule.from_dict(trainer["schedule"])
        if opts.total_steps and opts.total_steps != sched.total_steps:
            say(f"[train] total steps {sched.total_steps} -> {opts.total_steps} (the cosine is re-stretched)")
            sched.total_steps = opts.total_steps
        if opts.restart_lr:
            sched.restart(step, opts.restart_lr)
            say(f"[train] warm restart at step {step}: cosine from lr {opts.restart_lr:.2e} to "
                f"{opts.restart_lr * sched.min_lr_ratio:.2e} at step {sched.total_steps}")
        if saved_opt is None:
            sched.rewarmup_from, sched.rewarmup_steps = step, opts.rewarmup_steps
            say(f"[train] optimiser moments not in the checkpoint: fresh AdamW, lr re-warmed over "
                f"{opts.rewarmup_steps} steps (steps {step + 1}..{step + opts.rewarmup_steps})")
    else:
        step = 0
        total = opts.total_steps or opts.max_steps or 10000
        sched = Schedule(opts.lr, total, warmup_steps_for(opts.warmup, total), opts.min_lr_ratio)
    optimizer = optim.AdamW(learning_rate=sched(step + 1), weight_decay=opts.weight_decay)
    optimizer.init(master)
    if saved_opt is not None:
        optimizer.state = tree_unflatten(list(saved_opt[0].items()))
        optimizer.init(master)  # keeps the restored moments; marks the optimiser initialised
        say(f"[train] optimiser moments restored (AdamW step {int(optimizer.state['step'].item())})")

    # --- the step: fixed shapes, compiled once ----------------------------------------------------
    weights_k = position_weights(cfg.block_size, opts.gamma)
    kl_w = float(opts.kl_weight)
    holder = {"params": master}
    traces = [0]

    def loss_of(params, *batch):
        draft.update(cast_tree(params, cdt))  # bf16 copies; grads flow back through the cast
        return block_loss(draft, target, weights_k, *batch, kl_weight=kl_w,
                          argmax_labels=opts.argmax_labels)

    value_and_grad = mx.value_and_grad(loss_of)

    def step_fn(*batch):
        traces[0] += 1  # Python runs here only while tracing (compiled) or every step (not)
        (loss, acc1, alen, ce, kl, accepted), grads = value_and_grad(holder["params"], *batch)
        if dist.size > 1:
            grads = nn.average_gradients(grads, dist.group)
        grads, gnorm = optim.clip_grad_norm(grads, opts.grad_clip)
        holder["params"] = optimizer.apply_gradients(grads, holder["params"])
        metrics = mx.stack([loss, acc1, alen, ce, kl, gnorm.astype(mx.float32)])
        if dist.size > 1:
            metrics = mx.distributed.all_sum(metrics, group=dist.group) / dist.size
        return metrics, accepted

    state = [holder, optimizer.state]
    if opts.compile:
        step_fn = mx.compile(step_fn, inputs=state, outputs=state)

    batches = td.FixedBatches(store, opts.seqs_per_batch, opts.anchors_per_seq, cfg.block_size,
                              seq_len, opts.seed, dist.rank, dist.size,
                              opts.early_anchor_frac, opts.early_anchor_window,
                              opts.short_block_frac, opts.short_block_max)
    need_rows = kl_w > 0 or opts.argmax_labels
    misses = td.MissMemory(opts.miss_anchor_frac) if opts.miss_anchor_frac > 0 else None
    pending: list[tuple[dict, mx.array]] = []  # (batch, accepted per block) for the miss memory
    n_from_misses = [0]

    def run_step(u: int) -> mx.array:
        """Global update u (1-based); returns the step's metrics."""
        b = batches.batch(u - 1, misses)
        feats, rows_h = target_pass(target, b["tokens"], b["rows"] if need_rows else None)
        optimizer.learning_rate = sched(u)
        args = [feats, b["anchor_ids"], b["anchors"], b["labels"], b["valid"], b["block_lens"]]
        if need_rows:
            args.append(rows_h)
        metrics, accepted = step_fn(*args)
        if misses is not None:
            pending.append((b["np"], accepted))
            n_from_misses[0] += b["np"]["from_misses"]
        return metrics

    def drain_misses() -> None:
        for nb, acc in pending:
            misses.record(nb, np.array(acc))
        pending.clear()

    prev_time = float((trainer or {}).get("train_time_s", 0.0))
    sessions = list((trainer or {}).get("sessions", []))
    ema = (trainer or {}).get("running_loss")
    session = {"start_step": step, "world_size": dist.size, "device": str(mx.default_device()),
               "seqs_per_batch": opts.seqs_per_batch, "anchors_per_seq": opts.anchors_per_seq,
               "kl_weight": kl_w, "argmax_labels": opts.argmax_labels, "miss_anchor_frac": opts.miss_anchor_frac,
               "early_anchor_frac": opts.early_anchor_frac, "early_anchor_window": opts.early_anchor_window,
               "short_block_frac": opts.short_block_frac, "short_block_max": opts.short_block_max, "compute_dtype": str(cdt).split(".")[-1],
               # how the session began and ended (None: still running, the checkpoint is periodic):
               # checks.check_resume_again reads them
               "grown": grown or None, "restart_lr": opts.restart_lr if trainer else None, "stopped": None}
    blocks_per_step = opts.seqs_per_batch * opts.anchors_per_seq * dist.size
    history: list[dict[str, Any]] = []
    log_file = None
    if dist.main:  # records past this session's first step are of steps it runs again (a kill)
        if dropped := ck.trim_log(out / "train_log.jsonl", step):
            say(f"[train] train_log.jsonl: {dropped} record(s) past step {step} dropped (this session "
                "runs those steps again)")
        log_file = (out / "train_log.jsonl").open("a")
    t_train = 0.0

    def trainer_state() -> dict[str, Any]:
        s = dict(session, end_step=step, time_s=round(t_train, 1))
        return {
            "format": "dflash-trainer/1", "step": step, "schedule": sched.to_dict(),
            "seed": opts.seed, "target": opts.target, "seq_len": seq_len,
            "epoch": batches.epoch_at(step), "running_loss": ema,
            "last": history[-1] if history else (trainer or {}).get("last"),
            "train_time_s": round(prev_time + t_train, 1),
            "data": {"sequences": store.num_sequences, "tokens": store.num_tokens,
                     "max_new_tokens": opts.max_new_tokens},
            "data_options": {k: getattr(opts, k) for k in DATA_OPTIONS},  # a resume keeps them
            "sessions": sessions + [s],
        }

    def save() -> None:
        # a diverged run must not replace the last good checkpoint with NaN weights (nor publish
        # them); every rank checks (their weights are the same), so all stop together
        flat = [v for _, v in tree_flatten(holder["params"])]
        if not mx.all(mx.stack([mx.all(mx.isfinite(v)) for v in flat])).item():
            raise ValueError(f"the draft's weights are not finite at step {step}: the training diverged "
                             f"(a lower --lr?); {ckpt_dir} is left as it was")
        if not dist.main:
            return
        ost = dict(tree_flatten(optimizer.state)) if opts.save_optimizer else None
        ck.save_checkpoint(ckpt_dir, cfg.to_dict(), dict(tree_flatten(holder["params"])),
                           trainer_state(), int(opts.part_mb * 1e6), optimizer_state=ost)

    start_step = step
    last_step = sched.total_steps
    if opts.max_steps:
        last_step = min(last_step, start_step + opts.max_steps)
    ctrl = CtrlC(say)
    budget = Budget(opts.time_budget_s, dist.size, dist.share)

    def interrupted(at_log: bool) -> bool:
        """Ctrl-C was pressed (on any rank: checked collectively, at log steps only)."""
        return ctrl.pressed if dist.size == 1 else at_log and dist.any(ctrl.pressed)

    training_starts()  # SIGINT and SIGTERM as they were, for CtrlC to take over
    with ctrl:  # Ctrl-C: stop after the step in flight, keep the checkpoint
        # compile + warm-up steps: real updates, timed apart, before the budget clock starts
        t0 = time.perf_counter()
        n_warm = 0
        while step < last_step and n_warm < max(opts.compile_steps, 0) and not interrupted(False):
            res = run_step(step + 1)
            mx.eval(res, holder["params"], optimizer.state)
            step += 1
            n_warm += 1
            history_vals = np.array(res)
        t_compile = time.perf_counter() - t0
        if n_warm:
            say(f"[train] compile + warm-up: {n_warm} steps in {t_compile:.1f}s (traced {traces[0]}x; "
                f"not counted in the time budget); loss {float(history_vals[0]):.4f}")
        window: list[mx.array] = []
        t_mark = t_start = time.perf_counter()
        s_mark = step
        budget.start(step)
        stop_reason = ""
        while step < last_step:
            if interrupted(step % opts.log_every == 0):
                stop_reason = "interrupted"
                break
            res = run_step(step + 1)
            mx.async_eval(res, holder["params"], optimizer.state)
            window.append(res)
            step += 1
            out_of_time = budget.over(step)  # every step; the same on every rank
            if step % opts.log_every == 0 or step == last_step or out_of_time:
                vals = np.array(mx.stack(window))
                if misses is not None:
                    drain_misses()
                now = time.perf_counter()
                t_train = now - t_start
                dt = max(now - t_mark, 1e-9)
                n = step - s_mark
                mean = vals.mean(axis=0)
                ema = float(mean[0]) if ema is None else 0.8 * ema + 0.2 * float(mean[0])
                rec = {"step": step, "loss": float(mean[0]), "acc1": float(mean[1]),
                       "accept_len": float(mean[2]), "ce": float(mean[3]), "kl": float(mean[4]),
                       "grad_norm": float(mean[5]), "lr": sched(step),
                       "blocks_per_s": n * blocks_per_step / dt,
                       "block_tokens_per_s": n * blocks_per_step * cfg.block_size / dt,
                       "epoch": round(batches.epoch_at(step), 4), "elapsed_s": round(t_train, 2)}
                if misses is not None:
                    rec["miss_anchor_share"] = n_from_misses[0] / max(n * opts.seqs_per_batch * opts.anchors_per_seq, 1)
                    n_from_misses[0] = 0
                history.append(rec)
                if log_file:
                    log_file.write(json.dumps(rec) + "\n")
                    log_file.flush()
                left = ""
                if opts.time_budget_s:
                    left = f", {max(opts.time_budget_s - t_train, 0):.0f}s left"
                kl_txt = f", kl {rec['kl']:.4f}" if kl_w else ""
                if misses is not None:
                    kl_txt += f"; {rec['miss_anchor_share']:.0%} miss anchors"
                say(f"[train] step {step}/{sched.total_steps} | loss {rec['loss']:.4f} "
                    f"(ce {rec['ce']:.4f}{kl_txt}) | "
                    f"acc@1 {rec['acc1']:.3f} | accept-len {rec['accept_len']:.2f} | lr {rec['lr']:.2e} | "
                    f"{rec['blocks_per_s']:,.0f} blocks/s ({rec['block_tokens_per_s']:,.0f} block tok/s) | "
                    f"epoch {rec['epoch']:.2f} | {t_train:.0f}s{left}")
                window, t_mark, s_mark = [], now, step
                if out_of_time or (opts.time_budget_s and dist.any(t_train >= opts.time_budget_s)):
                    stop_reason = "time budget"
                    break
            if opts.ckpt_every and step % opts.ckpt_every == 0 and step < last_step:
                save()
        else:
            stop_reason = "total steps" if step >= sched.total_steps else "max steps"
        if window:
            mx.eval(window)
        t_train = time.perf_counter() - t_start
        mx.eval(holder["params"])
        if log_file:
            log_file.close()
        session["compile_s"] = round(t_compile, 2)
        session["stopped"] = stop_reason
        save()
        say(f"[train] stopped at step {step} ({stop_reason}); this session {step - start_step} steps, "
            f"{t_train:.0f}s + {t_compile:.0f}s compile; checkpoint {ckpt_dir}")
    if stop_reason == "interrupted":
        again = " and ".join(f for f, on in (("--grow-*", grown), ("--restart-lr", session["restart_lr"])) if on)
        say(f"[train] interrupted: the checkpoint at step {step} is saved in {ckpt_dir} (it loads as a "
            f"draft); continue with --resume {ckpt_dir}" + (f" and without {again} (applied already)" if again else ""))

    # --- the draft in the published format, then the held-out evaluation (rank 0) -----------------
    draft.update(cast_tree(holder["params"], tdt))
    draft.eval()
    mx.eval(draft.parameters())
    summary: dict[str, Any] = {
        "target": opts.target, "draft_dir": str(out), "steps": step, "session_steps": step - start_step,
        "stop_reason": stop_reason, "compile_traces": traces[0], "compile_time_s": t_compile,
        "train_time_s": t_train, "generation_time_s": t_gen, "seq_len": seq_len,
        "train_sequences": store.num_sequences, "train_tokens": store.num_tokens,
        "derived_prompts": len(derived), "world_size": dist.size, "schedule": sched.to_dict(),
        "final": history[-1] if history else {}, "history": history,
        "config": cfg.to_dict(), "device": str(mx.default_device()), "dtype": str(tdt).split(".")[-1],
        "compute_dtype": str(cdt).split(".")[-1],
        "options": asdict(opts),
    }
    if not dist.main or stop_reason == "interrupted":  # interrupted: no draft, no evaluation
        return summary
    save_draft(draft, out)
    # which tokens the draft proposes by default on the CPU: its answers' most frequent ones
    ranked, counted = rank_samples(samples)
    draftvocab.write(out, ranked, draftvocab.DEFAULT_SIZE,
                     f"{len(samples)} training responses of {data_dir}", counted)
    t0 = time.perf_counter()
    n_eval = len(heldout_pairs) if opts.eval_prompts is None else opts.eval_prompts
    eval_set = [td.Sample(k, p, td.chat_ids(tokenizer, p), [], "heldout")
                for k, p in heldout_pairs[:n_eval]]
    try:  # Ctrl-C or SIGTERM here: the draft is saved; the finished prompts are reported
        with stops_once():
            report = evaluate(target, draft, tokenizer, eval_set, opts.eval_max_tokens, log) if eval_set else {}
    except EvalInterrupted as e:
        report = e.report
        summary["eval_interrupted"] = True
        say(f"[train] held-out evaluation stopped after {e.done} of {len(eval_set)} prompts; the "
            f"draft ({out}) and the checkpoint ({ckpt_dir}) are saved")
        eval_set = eval_set[:e.done]
    summary.update(heldout=report, heldout_prompts=len(eval_set), heldout_excluded=len(heldout_pairs),
                   eval_time_s=time.perf_counter() - t0,
                   total_time_s=time.perf_counter() - t_begin)
    (out / "train_summary.json").write_text(
        json.dumps({k: v for k, v in summary.items() if k != "history"}, indent=2) + "\n")
    write_model_card(out, summary)
    return summary


# --- CLI -----------------------------------------------------------------------------------------
def _cli():
    import click

    from ..bench.cli import finite_option  # nan passes click's float ranges, inf is no budget

    def _layer_list(ctx, param, value: str) -> list[int]:
        try:
            return [int(x) for x in value.split(",") if x.strip()]
        except ValueError:
            raise click.BadParameter(f"expected layer numbers separated by commas, got {value!r}") from None

    def _os_error(e: OSError) -> str:
        """`PATH: reason` for an OSError (the errno prefix and Python's quoting left out)."""
        where = f"{e.filename}: " if e.filename else ""
        return f"{where}{e.strerror or e}"

    def _typed(ctx: click.Context, kw: dict) -> set[str]:
        """The options typed on the command line (not left at their defaults)."""
        from click.core import ParameterSource

        return {k for k in kw if ctx.get_parameter_source(k) not in (ParameterSource.DEFAULT, None)}

    def _explicit(ctx: click.Context, kw: dict) -> dict:
        """The architecture options typed on the command line."""
        return {k: kw[k] for k in ARCH_OPTIONS if k in _typed(ctx, kw)}

    @click.command("train-draft")
    @click.option("--target", required=True, help="Target model directory (mlx-lm format).")
    @click.option("--out", required=True, help="Output folder: draft (published format), checkpoint/, logs, README.md.")
    @click.option("--data-dir", default=None, help="Cache of prompts + responses (default OUT/data).")
    @click.option("--layers", default=1, show_default=True, type=click.IntRange(1))
    @click.option("--block-size", default=16, show_default=True, type=click.IntRange(2))
    @click.option("--num-capture", default=5, show_default=True, type=click.IntRange(1), help="Target layers captured (K).")
    @click.option("--mask-token-id", default=None, type=int, help="Default: an unused special token.")
    @click.option("--init-draft", default=None, help="Start a new campaign from this draft's weights (published format or a checkpoint).")
    @click.option("--init-from-target", is_flag=True, help="Warm-start draft layers from the target's last layers.")
    @click.option("--resume", default=None, help="Continue the campaign of this checkpoint folder (OUT/checkpoint of a previous run).")
    @click.option("--total-steps", default=None, type=click.IntRange(1), help="The campaign's length: the cosine ends here (default --max-steps, else 10000; a resume keeps its own unless given).")
    @click.option("--max-steps", default=None, type=click.IntRange(1), help="Stop THIS session after this many steps.")
    @click.option("--time-budget-s", default=None, callback=finite_option, type=click.FloatRange(min=0, min_open=True), help="Stop THIS session after this much training time (compile steps not counted).")
    @click.option("--compile-steps", default=2, show_default=True, type=click.IntRange(0), help="First steps timed apart (trace + kernel JIT), before the budget clock.")
    @click.option("--grow-mlp", default=0, show_default=True, type=click.IntRange(0), help="With --resume or --init-draft: widen every MLP to this intermediate size (the new down_proj columns zero: same proposals; engine/training/grow.py); the optimiser re-warms up.")
    @click.option("--grow-taps", default="", callback=_layer_list, help="With --resume or --init-draft: also capture these target layers (comma-separated), fc's new columns zero: same proposals (engine/training/grow.py); the optimiser re-warms up.")
    @click.option("--grow-layers", default=0, show_default=True, type=click.IntRange(0), help="With --resume or --init-draft: append this many layers that start as the identity (output projections zero; engine/training/grow.py); the optimiser re-warms up.")
    @click.option("--rewarmup-steps", default=200, show_default=True, type=click.IntRange(0), help="On --resume without optimiser moments: lr ramps from 0 over this many steps.")
    @click.option("--restart-lr", default=None, callback=finite_option, type=click.FloatRange(min=0, min_open=True), help="With --resume and --total-steps: a warm restart, a new cosine from this lr at the resume step to the new total.")
    @click.option("--lr", default=6e-4, show_default=True, callback=finite_option, type=click.FloatRange(min=0, min_open=True))
    @click.option("--warmup", default=0.04, show_default=True, callback=finite_option, type=click.FloatRange(0), help="Warm-up: a fraction of --total-steps (< 1) or a number of steps.")
    @click.option("--min-lr-ratio", default=0.05, show_default=True, callback=finite_option, type=click.FloatRange(0, 1), help="The cosine ends at lr x this.")
    @click.option("--weight-decay", default=0.01, show_default=True, callback=finite_option, type=click.FloatRange(0))
    @click.option("--grad-clip", default=1.0, show_default=True, callback=finite_option, type=click.FloatRange(min=0, min_open=True))
    @click.option("--gamma", default=None, callback=finite_option, type=click.FloatRange(min=0, min_open=True), help="Loss decay over block positions (default 7 for B=16).")
    @click.option("--kl-weight", default=0.0, show_default=True, callback=finite_option, type=click.FloatRange(0, 1), help="loss = (1-a) CE + a KL(target || draft).")
    @click.option("--argmax-labels", is_flag=True, help="Train on the target's own argmax at every block row (what a greedy verify checks) instead of the data's token (a sampled answer's token is not the argmax 28.5% of the time).")
    @click.option("--miss-anchor-frac", default=0.0, show_default=True, callback=finite_option, type=click.FloatRange(0, 1), help="Share of anchors placed where the draft's next block would start after a miss (data.MissMemory).")
    @click.option("--early-anchor-frac", default=0.0, show_default=True, callback=finite_option, type=click.FloatRange(0, 1), help="Share of anchors placed inside the first --early-anchor-window response tokens (where answers start; the rest stay uniform).")
    @click.option("--early-anchor-window", default=128, show_default=True, type=click.IntRange(1), help="Response tokens counted as an answer's start for --early-anchor-frac.")
    @click.option("--short-block-frac", default=0.0, show_default=True, callback=finite_option, type=click.FloatRange(0, 1), help="Share of blocks trained cut short, [anchor, MASK x (n-1)] with n in 2..--short-block-max: the block a short verify window runs, so its draft pass is cheaper (the draft's config records it; engine/drafters.py).")
    @click.option("--short-block-max", default=4, show_default=True, type=click.IntRange(2), help="The longest cut block for --short-block-frac.")
    @click.option("--seqs-per-batch", default=16, show_default=True, type=click.IntRange(1), help="Sequences per step and rank.")
    @click.option("--anchors-per-seq", default=64, show_default=True, type=click.IntRange(1), help="Blocks per sequence and step.")
    @click.option("--max-len", default=640, show_default=True, type=click.IntRange(1), help="Sequences cut here; every batch is padded to min(this, longest rounded up to 32).")
    @click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default=None, help="Target dtype (default: bf16 on GPU, fp32 on CPU).")
    @click.option("--compute-dtype", type=click.Choice(["float32", "bfloat16"]), default=None, help="The draft's maths (fp32 masters always; default bf16 on GPU, fp32 on CPU).")
    @click.option("--no-compile", is_flag=True)
    @click.option("--seed", default=0, show_default=True)
    @click.option("--prompts", default=None, help="Prompt file (JSONL with prompt/kind, or one per line).")
    @click.option("--num-prompts", default=600, show_default=True, type=click.IntRange(0), help="Built-in prompts to use (0: none, when --prompts or --derive-prompts give the data).")
    @click.option("--derive-prompts", default=0, show_default=True, type=click.IntRange(0), help="Extra prompts the target writes itself (sampled user turns).")
    @click.option("--exclude-prompts", default=None, help="Prompt file whose prompts are not trained on (e.g. earlier sessions' derived prompts: they still seed the new draws, see docs/training.md).")
    @click.option("--heldout-file", default=None, help="Held-out prompts (default: the committed engine/training/heldout_prompts.jsonl).")
    @click.option("--max-new-tokens", default=256, show_default=True, type=click.IntRange(1))
    @click.option("--sampled-responses", default=0.0, show_default=True, callback=finite_option, type=click.FloatRange(0, 1), help="Share of prompts answered by sampling at --response-temperature instead of greedily (which prompts: a hash of their text; cached responses are kept as they are).")
    @click.option("--train-responses", default="all", show_default=True, type=click.Choice(["all", "greedy", "sampled"]), help="Which cached answers are trained on: greedy ones match what greedy decoding verifies at every block position; sampled ones (--sampled-responses) what sampling meets.")
    @click.option("--response-temperature", default=0.7, show_default=True, callback=finite_option, type=click.FloatRange(min=0, min_open=True), help="Temperature of the sampled responses.")
    @click.option("--gen-batch-size", default=64, show_default=True, type=click.IntRange(1))
    @click.option("--data-only", is_flag=True, help="Generate (or complete) the data cache, then stop.")
    @click.option("--eval-max-tokens", default=128, show_default=True, type=click.IntRange(1))
    @click.option("--eval-prompts", default=None, type=click.IntRange(0), help="Held-out prompts to evaluate (default all; 0: none).")
    @click.option("--ckpt-every", default=500, show_default=True, type=click.IntRange(0), help="Checkpoint every this many steps (0: only at the end).")
    @click.option("--log-every", default=10, show_default=True, type=click.IntRange(1))
    @click.option("--part-mb", default=15.0, show_default=True, callback=finite_option, type=click.FloatRange(min=0, min_open=True), help="Checkpoint weight files at most this big (MB).")
    @click.option("--save-optimizer", is_flag=True, help="Also keep AdamW moments + fp32 masters (too big to bring back from a lent GPU).")
    @click.pass_context
    def train_draft_command(ctx: click.Context, **kw):
        """Train a DFlash draft for the --target model on its own responses (greedy, or a
        --sampled-responses share sampled); writes the draft, OUT/checkpoint/ and OUT/README.md.

        Ctrl-C (or SIGTERM) stops after the step in flight and saves the checkpoint (exit 130);
        --resume OUT/checkpoint continues the campaign. Before training it stops at once (exit
        130), keeping the data cached so far for the rerun. See docs/training.md."""
        import sys

        kw["compile"] = not kw.pop("no_compile")
        if kw["resume"]:
            kept, line = campaign_data_options(kw["resume"], _typed(ctx, kw), kw)
            kw.update(kept)
            if line:
                click.echo(f"[train] {line}", err=True)
        data_dir = kw["data_dir"] or str(Path(kw["out"]) / "data")
        try:
            summary = train_draft(TrainOptions(**kw), log=lambda s: click.echo(s, err=True),
                                  explicit_arch=_explicit(ctx, kw))
        except KeyboardInterrupt:  # before training (load, data) or a second Ctrl-C
            click.echo(f"cancelled; the data cached so far stays in {data_dir} (a rerun continues "
                       "from it)", err=True)
            sys.exit(130)
        except (ValueError, FileNotFoundError) as e:
            raise click.ClickException(str(e)) from e
        except OSError as e:  # disk full, no permission, a file where a folder goes: one line
            raise click.ClickException(_os_error(e)) from e
        if "heldout" in summary:  # the draft was saved (not interrupted, rank 0): say where, last
            click.echo(f"[train] draft written to {summary['draft_dir']}", err=True)
        if summary.get("stop_reason") == "interrupted" or summary.get("eval_interrupted"):
            sys.exit(130)

    return train_draft_command


train_draft_command = _cli()
