"""Few-row products on CUDA in a kernel of ours instead of cuBLASLt (a GPU's verify and draft).

Why: a 135M target's cycle on the H200 is paced by the host (docs/benchmark.md, sessions 20-22),
and MLX 0.32 sends every product of 2 or more rows to cuBLASLt through a new `CublasGemm` per
call, which creates its descriptors and asks cublasLtMatmulAlgoGetHeuristic for an algorithm
every time (mlx/backend/cuda/matmul.cpp, cublas_utils.cpp; nothing is cached between calls).
A decode step's one-row products take MLX's own gemv kernel instead. A 16-token verify of
SmolLM2 makes ~120 such products and a draft pass ~25, so a cycle pays that host cost ~145 times
where mlx-lm's step pays none (fusing q/k/v and gate/up, 90 products fewer a verify, was worth
11%: fuse.py).

How: one launch per product, y[M, N] = x[M, K] @ w[N, K]^T (+ bias), for 2..16 rows: a warp per
output column reads that weight row once (16-byte loads, coalesced) and keeps one fp32 sum per
input row, then reduces across the warp; x (at most 16 x K) stays in the caches. The GPU time is
a few microseconds a product; the host's is one custom-kernel launch. fp32 sums rounded once to
the input dtype, as cuBLAS does, in another order: bf16 results may differ from cuBLAS's in the
last bit, as the verify's already differ from a decode step's (README, losslessness).

It acts only inside `fuse.active()` (the target's own forwards, the draft's), on plain bf16/fp16
nn.Linear products whose weight is at most MAX_WEIGHT elements (a layer's products; an LM head
stays on cuBLAS, where one call a cycle costs little), so mlx-lm running the same model (the
benchmark's baseline) is untouched. The first call in a process is checked against the plain
product; a kernel that fails or disagrees leaves MLX's path in place, with a warning.

    DFLASH_SKINNY=auto  (default) on a CUDA GPU;  =0 never
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from . import fuse

ENV = "DFLASH_SKINNY"
MIN_ROWS, MAX_ROWS = 2, 16  # one row: MLX's own gemv already
MAX_WEIGHT = 4_000_000  # weight elements: a 135M-1B layer's products, not an LM head
DTYPES = (mx.bfloat16, mx.float16)
WARPS = 8  # output columns a block of 256 threads computes
ON = True  # False: every product on MLX's path (scripts/arms_ab.py's skinny=0)
_CLASSES: dict[type, type] = {}
_kernel_obj: Any = None
_works: bool | None = None  # the first call's check, once per process
_no_bias: dict[Any, mx.array] = {}  # a one-element stand-in for the bias input, per dtype

_SOURCE = """
    const int M = x_shape[0], K = x_shape[1], N = w_shape[0];
    const int lane = threadIdx.x & 31;
    const int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (n >= N) return;
    const T* wr = w + (size_t)n * K;
    const bool vec = (K % 8 == 0) && ((reinterpret_cast<size_t>(x) | reinterpret_cast<size_t>(wr)) % 16 == 0);
    float acc[16];
    #pragma unroll
    for (int m = 0; m < 16; ++m) acc[m] = 0.f;
    if (vec) {
      for (int k = lane * 8; k < K; k += 256) {
        const uint4 wv = *reinterpret_cast<const uint4*>(wr + k);
        const T* wp = reinterpret_cast<const T*>(&wv);
        float wf[8];
        #pragma unroll
        for (int j = 0; j < 8; ++j) wf[j] = static_cast<float>(wp[j]);
        #pragma unroll
        for (int m = 0; m < 16; ++m) {
          if (m < M) {
            const uint4 xv = *reinterpret_cast<const uint4*>(x + (size_t)m * K + k);
            const T* xp = reinterpret_cast<const T*>(&xv);
            float s = 0.f;
            #pragma unroll
            for (int j = 0; j < 8; ++j) s += wf[j] * static_cast<float>(xp[j]);
            acc[m] += s;
          }
        }
      }
    } else {
      for (int k = lane; k < K; k += 32) {
        const float wk = static_cast<float>(wr[k]);
        #pragma unroll
        for (int m = 0; m < 16; ++m)
          if (m < M) acc[m] += wk * static_cast<float>(x[(size_t)m * K + k]);
      }
    }
    float mine = 0.f;
    #pragma unroll
    for (int m = 0; m < 16; ++m) {
      float v = acc[m];
      #pragma unroll
      for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffff, v, off);
      if (lane == m) mine = v;
    }
    if (lane < M) {
      if (HAS_BIAS) mine += static_cast<float>(bias[n]);
      out[(size_t)lane * N + n] = static_cast<T>(mine);
    }
"""


def enabled() -> bool:
    """DFLASH_SKINNY: auto (a CUDA GPU) or 0; another value raises, naming the variable."""
    mode = os.environ.get(ENV, "").strip().lower() or "auto"
    if mode not in ("auto", "0"):
        raise ValueError(f"{ENV}={mode!r}: expected auto or 0")
    return mode == "auto" and mx.default_device() == mx.gpu and mx.cuda.is_available()


def _kernel() -> Any:
    global _kernel_obj
    if _kernel_obj is None:
        _kernel_obj = mx.fast.cuda_kernel(
            name="dflash_skinny_mm", input_names=["x", "w", "bias"], output_names=["out"],
            source=_SOURCE, ensure_row_contiguous=True)
    return _kernel_obj


def matmul(x: mx.array, w: mx.array, bias: mx.array | None = None) -> mx.array:
    """x [..., K] @ w[N, K]^T (+ bias) for 2..16 rows in all, by the kernel (CUDA only)."""
    lead, k = x.shape[:-1], x.shape[-1]
    n = w.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if not MIN_ROWS <= m <= MAX_ROWS:
        raise ValueError(f"skinny.matmul takes {MIN_ROWS}..{MAX_ROWS} rows, got {m}")
    has_bias = bias is not None
    if not has_bias and x.dtype not in _no_bias:
        _no_bias[x.dtype] = mx.zeros((1,), dtype=x.dtype)
    out = _kernel()(inputs=[x2, w, bias if has_bias else _no_bias[x.dtype]],
                    template=[("T", x.dtype), ("HAS_BIAS", has_bias)],
                    grid=(-(-n // WARPS) * WARPS * 32, 1, 1), threadgroup=(WARPS * 32, 1, 1),
                    output_shapes=[(m, n)], output_dtypes=[x.dtype])[0]
    return out.reshape(*lead, n)


def reference(x: mx.array, w: mx.array, bias: mx.array | None = None) -> mx.array:
    """The same product in fp32 (any device), rounded once to x's dtype."""
    y = x.astype(mx.float32) @ w.astype(mx.float32).T
    if bias is not None:
        y = y + bias.astype(mx.float32)
    return y.astype(x.dtype)


def works() -> bool:
    """One small product of the kernel against `reference`, once per process: False (with a
    warning) when the kernel fails to build or disagrees, and MLX's path stays."""
    global _works
    if _works is None:
        try:
            w = (mx.random.normal((40, 72), key=mx.random.key(1)) * 0.1).astype(mx.bfloat16)
            x = mx.random.normal((1, 5, 72), key=mx.random.key(2)).astype(mx.bfloat16)
            got = matmul(x, w).astype(mx.float32)
            _works = bool(mx.allclose(got, reference(x, w).astype(mx.float32), atol=0.05, rtol=0.02))
            if not _works:
                warnings.warn("dflash: the few-row product kernel disagrees with the plain "
                              "product here; MLX's products stay", RuntimeWarning, stacklevel=3)
        except Exception as e:  # noqa: BLE001 - any build/launch failure means: not here
            _works = False
            warnings.warn(f"dflash: the few-row product kernel is not usable here ({e}); "
                          "MLX's products stay", RuntimeWarning, stacklevel=3)
    return _works


def takes(module: nn.Module, x: mx.array) -> bool:
    """Whether this call goes to the kernel: inside fuse.active(), 2..16 rows of the weight's
    dtype, and the module eligible (see `eligible`)."""
    if not (ON and fuse.active) or x.ndim < 2 or x.dtype != module.weight.dtype:
        return False
    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    return MIN_ROWS <= rows <= MAX_ROWS


def _skinny_class(cls: type) -> type:
    """A subclass of nn.Linear whose call, where `takes`, is the kernel's product."""
    if cls not in _CLASSES:

        def __call__(self, x):
            if takes(self, x):
                return matmul(x, self.weight, self.get("bias"))
            return cls.__call__(self, x)

        _CLASSES[cls] = type(f"Skinny{cls.__name__}", (cls,), {"__call__": __call__})
    return _CLASSES[cls]


def eligible(module: Any) -> bool:
    """A plain nn.Linear (not quantized) with a bf16/fp16 weight of at most MAX_WEIGHT
    elements."""
    if not isinstance(module, nn.Linear) or type(module) not in (nn.Linear, *_CLASSES.values()):
        return False
    w = module.weight
    return w.ndim == 2 and w.dtype in DTYPES and w.size <= MAX_WEIGHT


def adopt(module: Any) -> bool:
    """Route one eligible module's few-row products through the kernel; whether it was."""
    if not eligible(module):
        return False
    if type(module) not in _CLASSES.values():
        module.__class__ = _skinny_class(type(module))
    return True


def install(model: nn.Module, extra: tuple[Any, ...] = (), force: bool = False) -> int:
    """Adopt every eligible product of `model`: its plain Linear modules, the stacked modules of
    its fused groups (fuse.py), and `extra` modules (a drafter's context K/V stack); returns how
    many. Nothing unless enabled() and the kernel works here, or `force` (tests)."""
    if not (force or (enabled() and works())):
        return 0
    found: dict[int, Any] = {}
    for _, m in model.named_modules():
        shared = m.__dict__.get("_dflash_shared")
        if shared is not None:  # a fused member calls its group's stack inside fuse.active()
            found[id(shared.stacked)] = shared.stacked
        else:
            found[id(m)] = m
    for m in extra:
        found[id(m)] = m
    return sum(adopt(m) for m in found.values())
