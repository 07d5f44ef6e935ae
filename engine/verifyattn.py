"""Which attention the cycle's few-query forwards use: MLX's, or our own (fewq.py, cpuattn.py);
on the CPU also which SwiGLU the target's and the draft's MLPs use (fastexp.py).

A verify is one target forward of up to 16 tokens over the whole cache, and a draft pass is 16
block queries over the context; MLX 0.32 on CUDA runs those (4 or more queries, cuDNN off) as
unfused matmul + mask + softmax + matmul, most of what a verify costs beyond a decode step
(fewq.py), and on the CPU its exp makes the softmax most of a few-query attention (cpuattn.py).
The setting:

    DFLASH_VERIFY_ATTN=auto     (default) the kernel on a CUDA GPU where a first small call of it
                                matches the plain maths (else a warning and MLX's); the fast-exp
                                attention on the CPU
    DFLASH_VERIFY_ATTN=mlx      MLX's attention, as mlx-lm calls it
    DFLASH_VERIFY_ATTN=kernel   the CUDA kernel (a CUDA GPU is required: an error at load otherwise)
    DFLASH_VERIFY_ATTN=fastexp  the fast-exp attention (fp32 calls; meant for the CPU)

With fastexp (so by default on the CPU) the MLPs' SwiGLU of 2 or more rows (a verify, the draft's
block, a prefill chunk) runs fastexp.swiglu too: mlx-lm's models call the `swiglu` of their own
module, which `configure()` wraps the way it wraps MLX's attention; a decode step's one row stays
MLX's, as mlx-lm computes it.

It acts only inside `active()`, which the target's own forwards enter (engine/target.py), and in
the draft's attention (`attention()`), so mlx-lm running the same model (the benchmark's
baseline) is untouched. Shapes ours do not take (fewq.supported: under 4 or over 16 queries,
other head dims; cpuattn.supported: under 2 or over 16 queries, not fp32; masks other than
causal/none) go to MLX as before.

Measured and dropped: an explicit boolean causal mask instead of MLX's "causal" path (faster for
one layer at 1K keys, 0.17 against 0.32 ms, but the whole 1K oracle fell from 4.73x to 3.79x on
the H200; docs/benchmark.md).
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from . import cpuattn, fastexp, fewq
from .scope import Scope

ENV = "DFLASH_VERIFY_ATTN"
MODES = ("auto", "mlx", "kernel", "fastexp")
active = Scope()  # the target's own forwards are inside (TargetModel enters it)
_MLX_SDPA = mx.fast.scaled_dot_product_attention  # MLX's own, as this module found it
_real_sdpa = None  # what configure() wrapped (None: MLX's own)
_chosen = "mlx"  # as of the last configure(): read once per model load, not per attention call
_works: bool | None = None  # the auto mode's one check of the kernel, once per process
_MLX_SWIGLU = None  # mlx-lm's activations.swiglu, once wrapped (None: never wrapped)


def cuda() -> bool:
    """Whether MLX runs on a CUDA GPU here."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def kernel_works() -> bool:
    """One small causal call of the kernel against fewq.reference: False (with a warning) if it
    fails to build or run here, e.g. on a GPU without bf16 tensor cores."""
    global _works
    if _works is None:
        try:
            q, k, v = (mx.random.normal(s, key=mx.random.key(i)).astype(mx.bfloat16)
                       for i, s in enumerate(((1, 4, 16, 64), (1, 1, 80, 64), (1, 1, 80, 64))))
            got = fewq.attention(q, k, v, 0.125, True).astype(mx.float32)
            _works = mx.allclose(got, fewq.reference(q, k, v, 0.125, True).astype(mx.float32),
                                 atol=2e-2).item()
            reason = "its output differs from the plain maths"
        except Exception as e:  # noqa: BLE001 - any build or launch failure means: do not use it
            _works, reason = False, f"{type(e).__name__}: {e}"
        if not _works:
            warnings.warn(f"{ENV}=auto: the few-query attention kernel is off here ({reason}); "
                          "MLX's attention is used", RuntimeWarning, stacklevel=2)
    return _works


def mode() -> str:
    """The setting, resolved: "mlx", "kernel" or "fastexp" (a bad value or an impossible one
    raises)."""
    value = os.environ.get(ENV, "auto").strip() or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(MODES)}")
    if value == "kernel" and not cuda():
        raise ValueError(f"{ENV}=kernel needs MLX on a CUDA GPU (this is {mx.default_device()})")
    if value == "auto":
        if cuda():
            return "kernel" if kernel_works() else "mlx"
        return "fastexp" if mx.default_device() == mx.cpu else "mlx"
    return value


def _ours(q: mx.array, k: mx.array, v: mx.array, mask: Any) -> str | None:
    """Which of ours takes this call ("kernel", "fastexp"), or None: MLX's."""
    if _chosen == "kernel":
        plain_mask = mask is None or (isinstance(mask, str) and mask == "causal")
        return "kernel" if plain_mask and fewq.supported(q, k, v) else None
    if _chosen == "fastexp":
        return "fastexp" if cpuattn.supported(q, k, v, mask) else None
    return None


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any = None) -> mx.array:
    """Scaled dot-product attention: ours inside `active()` where it applies, else MLX's
    (training's differentiated passes stay outside: the kernel has no gradient)."""
    which = _ours(q, k, v, mask) if active else None
    if which == "kernel":
        return fewq.attention(q, k, v, scale, causal=mask is not None)
    if which == "fastexp":
        return cpuattn.attention(q, k, v, scale, causal=mask is not None)
    return (_real_sdpa or _MLX_SDPA)(q, k, v, scale=scale, mask=mask)


def _sdpa(q: mx.array, k: mx.array, v: mx.array, *args: Any, **kwargs: Any) -> mx.array:
    """mx.fast.scaled_dot_product_attention as mlx-lm's models call it: a call of the plain form
    (scale, mask, sinks=None) goes through `attention`; any other straight to MLX."""
    plain = (not args and "scale" in kwargs and set(kwargs) <= {"scale", "mask", "sinks"}
             and kwargs.get("sinks") is None)  # mlx-lm passes sinks=None
    if active and plain:
        return attention(q, k, v, kwargs["scale"], kwargs.get("mask"))
    return (_real_sdpa or _MLX_SDPA)(q, k, v, *args, **kwargs)


def _fast_swiglu(gate: mx.array, up: mx.array) -> bool:
    """Whether fastexp.swiglu takes this call: inside `active()` with fastexp chosen, fp32, 2 or
    more rows (a decode step's one row stays as mlx-lm computes it)."""
    return (bool(active) and _chosen == "fastexp" and gate.dtype == mx.float32
            and up.dtype == mx.float32 and gate.ndim >= 2 and gate.shape[-2] >= 2
            and gate.shape == up.shape)


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """The draft's MLP activation, silu(gate) * up: fastexp's where it applies, else the plain
    maths (training's differentiated passes are never inside `active()`)."""
    return fastexp.swiglu(gate, up) if _fast_swiglu(gate, up) else nn.silu(gate) * up


def _target_swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """What the wrapped mlx-lm modules call instead of activations.swiglu."""
    return fastexp.swiglu(gate, up) if _fast_swiglu(gate, up) else _MLX_SWIGLU(gate, up)


def _wrap_swiglu() -> None:
    """Point every loaded mlx-lm model module's `swiglu` (imported from activations.py) at
    `_target_swiglu`; the target's own module is loaded by now. Idempotent."""
    global _MLX_SWIGLU
    from mlx_lm.models import activations

    if _MLX_SWIGLU is None:
        _MLX_SWIGLU = activations.swiglu
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and getattr(module, "swiglu", None) is _MLX_SWIGLU:
            module.swiglu = _target_swiglu


def configure() -> str:
    """Read the setting (a bad value raises here, at load) and, the first time it picks one of
    ours, wrap mx.fast.scaled_dot_product_attention (mlx-lm's models look it up at every call);
    outside `active()`, or with the setting back at mlx, the wrapper only passes through."""
    global _real_sdpa, _chosen
    chosen = _chosen = mode()
    if chosen != "mlx" and mx.fast.scaled_dot_product_attention is not _sdpa:  # never wrap twice
        _real_sdpa = mx.fast.scaled_dot_product_attention
        mx.fast.scaled_dot_product_attention = _sdpa
    if chosen == "fastexp":
        _wrap_swiglu()
    return chosen
