"""The target side of DFlash: any mlx-lm model, with hidden-state capture.

mlx-lm models return only logits. DFlash needs the outputs of a few decoder layers as the
draft's context features, so `TargetModel` swaps the class of those layer instances for a
subclass that records the layer's output. The instance, its parameters and the logits stay
exactly as they were: only a side channel is added.

The same hook starts a verify on the device in parts (`pipelined`, GPU only): MLX builds a
graph in Python and runs it at eval, so a whole 16-token verify left the GPU idle while its 36
layers were built (a synced decode step of the 8B shape costs 10.7 ms on the H200, pipelined by
mlx-lm 6.6 ms). Queuing each captured layer's output (mx.async_eval) as soon as it is built lets
the GPU run the first layers while Python builds the next ones.

    DFLASH_PIPELINE=auto  (default) on a GPU;  =1 always;  =0 never

Pipelined targets also run ahead (engine/generate.py): when a cycle's drafts are likely all
accepted, the next cycle's draft is queued behind its verify before the verify is read, so
the device goes from one verify to the next draft without waiting for the host.
DFLASH_RUNAHEAD=0 turns that part off (for A/B measurements).
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from . import branches, cpufast, fuse, rowpad, tape, verifyattn

_CAPTURE_CLASSES: dict[type, type] = {}
PIPELINE_ENV = "DFLASH_PIPELINE"
RUNAHEAD_ENV = "DFLASH_RUNAHEAD"


class _Sink(list):
    """Captured layer outputs of one pass; `eager`: queue each on the device once captured."""

    eager = False


def pipelined_default() -> bool:
    """DFLASH_PIPELINE: whether verifies start on the device layer group by layer group."""
    mode = os.environ.get(PIPELINE_ENV, "").strip().lower() or "auto"
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"{PIPELINE_ENV}={mode!r}: expected auto, 1 or 0")
    return mode == "1" or (mode == "auto" and mx.default_device() == mx.gpu)


def _capturing_class(cls: type) -> type:
    """A subclass of a decoder-layer class whose call also records its output."""
    if cls not in _CAPTURE_CLASSES:

        def __call__(self, *args, **kwargs):
            out = cls.__call__(self, *args, **kwargs)
            sink = self.__dict__.get("_dflash_sink")
            if sink is not None:
                sink.append(out)
                if sink.eager:  # the layers so far start on the device while later ones build
                    mx.async_eval(out)
            return out

        _CAPTURE_CLASSES[cls] = type(f"Captured{cls.__name__}", (cls,), {"__call__": __call__})
    return _CAPTURE_CLASSES[cls]


def _find_text_model(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """Return (outer, inner): outer owns the LM head, inner owns embed_tokens and layers."""
    outer = model
    for _ in range(3):
        if "language_model" in outer:
            outer = outer["language_model"]
    inner = outer["model"] if "model" in outer else outer
    if "embed_tokens" not in inner or "layers" not in inner:
        raise ValueError(
            f"unsupported target {type(model).__module__}: no embed_tokens/layers found"
        )
    return outer, inner


def default_layer_ids(num_layers: int, count: int = 5) -> list[int]:
    """Evenly spread capture layers from 1 to N-3 (the published drafts' rule)."""
    lo, hi = (1, num_layers - 3) if num_layers >= 5 else (0, num_layers - 1)
    if count == 1:
        return [hi]
    return sorted({round(lo + i * (hi - lo) / (count - 1)) for i in range(count)})


class TargetModel:
    """An mlx-lm causal LM plus what DFlash needs around it: capture, embedding, LM head."""

    def __init__(self, model: nn.Module, layer_ids: list[int]):
        self.model = model
        self.outer, self.inner = _find_text_model(model)
        self.layers = self.inner.layers
        self.num_layers = len(self.layers)
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(
                f"capture layer ids {bad} (the draft's target_layer_ids) are out of range for a "
                f"target with {self.num_layers} layers: is the draft made for another model?"
            )
        self.layer_ids = list(layer_ids)
        emb = self.inner.embed_tokens
        self.vocab_size, self.hidden_size = _embedding_shape(emb)
        self.args = getattr(self.outer, "args", None) or getattr(model, "args", None)
        self.model_type = str(getattr(model, "model_type", getattr(self.args, "model_type", "")))
        self._sink: list[mx.array] = []
        for i in self.layer_ids:
            layer = self.layers[i]
            if not type(layer).__name__.startswith("Captured"):
                layer.__class__ = _capturing_class(type(layer))
            layer.__dict__["_dflash_sink"] = None
        tape.install(self.layers)
        # DFLASH_VERIFY_ATTN, read here (a bad value fails at load): "mlx", "kernel" or "fastexp"
        self.verify_attention = verifyattn.configure()
        self.pipelined = pipelined_default()  # DFLASH_PIPELINE, read once at load
        self.run_ahead = self.pipelined and os.environ.get(RUNAHEAD_ENV, "1").strip() != "0"
        self.branches = branches.configure()  # DFLASH_BRANCHES: draft rows per greedy verify
        self.branch_budget = branches.budget()  # the default rows' KV copies, in bytes (None: any)
        if self.branches > 1 and not self.takes_rows():
            if branches.explicit():  # the default falls back quietly (fp32 on a GPU, say)
                warnings.warn(f"{branches.ENV}={self.branches}: this target's verify attention is "
                              "not ours here (a CUDA GPU needs the few-query kernel: bf16/fp16, "
                              "head dim 64 or 128); one row per verify", RuntimeWarning, stacklevel=2)
            self.branches = 1
        # few-row products padded to the row count the BLAS does fastest (CPU + MKL; rowpad.py)
        plans = rowpad.plan(model)
        rowpad.pad_rows(model, plans)
        self.row_plan = rowpad.describe(plans)  # the non-empty plans: what pad_rows applied
        # RoPE / RMSNorm in fewer CPU kernels, bit for bit MLX's (cpufast.py); our forwards only
        self.cpu_fast = cpufast.install(model)
        # q/k/v and gate/up as one product each (fuse.py; a GPU's default); our forwards only
        self.fused = fuse.install(model)

    def takes_rows(self) -> bool:
        """Whether this target's verify attention reads several draft rows right here (any CPU;
        on a CUDA GPU the few-query kernel in bf16/fp16: branches.attention_takes_rows)."""
        return branches.attention_takes_rows(self.verify_attention, weights_dtype(self.model),
                                             *head_shape(self.args))

    @property
    def row_padding(self) -> bool:
        """Whether some of the target's products are padded (rowpad.py)."""
        return bool(self.row_plan)

    # --- shared pieces the draft borrows -------------------------------------------------
    def embed(self, ids: mx.array) -> mx.array:
        """The target's token embedding, with the family's embedding scale."""
        h = self.inner.embed_tokens(ids)
        if self.model_type.startswith("gemma"):
            # Gemma scales embeddings by sqrt(hidden), rounded through bf16 like the model does.
            h = h * mx.array(self.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
        return h

    @property
    def head_module(self) -> Any:
        """The module whose weight rows are the LM head: lm_head, or the tied embedding."""
        return self.outer.lm_head if "lm_head" in self.outer else self.inner.embed_tokens

    def lm_head(self, h: mx.array) -> mx.array:
        """The target's LM head (or tied embedding), with logit soft-capping if it has one."""
        head = self.head_module
        with rowpad.active():
            logits = head(h) if head is not self.inner.embed_tokens else head.as_linear(h)
        return self.cap_logits(logits)

    def cap_logits(self, logits: mx.array) -> mx.array:
        """The family's final logit soft-capping (Gemma), else the logits as they are."""
        cap = getattr(self.args, "final_logit_softcapping", None)
        return mx.tanh(logits / cap) * cap if cap else logits

    # --- forward ----------------------------------------------------------------------------
    def make_cache(self) -> list[Any]:
        return make_prompt_cache(self.model)

    def forward(
        self, tokens: mx.array, cache: list[Any], last_only: bool = False, eager: bool = False
    ) -> tuple[mx.array, mx.array]:
        """Run the target on `tokens` [1, L]; return (logits [1, L, V], features [1, L, K*D]).

        `last_only` (prefill): logits of the last position only, [1, 1, V]; the LM head over a
        whole prompt chunk is most of a small model's prefill and only its last row is used.
        `eager` (a verify): start the pass on the device in parts as it is built, if `pipelined`.
        """
        eager = eager and self.pipelined
        with rowpad.active(), verifyattn.active(), cpufast.active(), fuse.active():
            if last_only:
                return self.capture(lambda: self.lm_head(self.inner(tokens, cache=cache)[:, -1:]))
            return self.capture(lambda: self.model(tokens, cache=cache), eager)

    def capture(self, run: Callable[[], mx.array], eager: bool = False) -> tuple[mx.array, mx.array]:
        """(run(), the captured layers' outputs concatenated [.., L, K*D]) for a pass of the model
        that `run` makes (inference with caches, or training's cache-free batch pass, never
        `eager`: no evaluation may start inside a traced function)."""
        sink = _Sink()
        sink.eager = eager
        for i in self.layer_ids:
            self.layers[i].__dict__["_dflash_sink"] = sink
        try:
            out = run()
        finally:
            for i in self.layer_ids:
                self.layers[i].__dict__["_dflash_sink"] = None
        if len(sink) != len(self.layer_ids):
            raise RuntimeError(f"captured {len(sink)} layer outputs, expected {len(self.layer_ids)}")
        return out, mx.concatenate(sink, axis=-1)


def _embedding_shape(emb: nn.Module) -> tuple[int, int]:
    if "scales" in emb:  # QuantizedEmbedding: weight is packed
        return emb.num_embeddings, emb.dims
    return tuple(emb.weight.shape)  # type: ignore[return-value]


def weights_dtype(model: nn.Module) -> mx.Dtype:
    """The floating dtype holding most of the target's weights (loading.main_dtype)."""
    from .loading import main_dtype  # loading imports this module

    return getattr(mx, main_dtype(model) or "float32")


def head_shape(args: Any) -> tuple[int | None, int | None, int | None]:
    """(query heads, KV heads, head dim) from a model's args; None where it does not say."""
    heads = getattr(args, "num_attention_heads", None)
    kv = getattr(args, "num_key_value_heads", None) or heads
    dim = getattr(args, "head_dim", None)
    if dim is None and heads and getattr(args, "hidden_size", None):
        dim = args.hidden_size // heads
    return heads, kv, dim
