#!/usr/bin/env python3
"""Check engine/skinny.py's few-row product kernel on a CUDA GPU, and time its host cost.

    python scripts/skinny_check.py [--out RESULT.json]

1. Correctness: the kernel against `skinny.reference` (fp32 sums, one rounding) for 2..16 rows,
   bf16 and fp16, with and without bias, the shapes of SmolLM2's and an 8B's layer products, an
   odd width (the kernel's scalar path) and an input at an unaligned offset. Worst |error| over
   each output's scale; cuBLAS's own error against the same reference beside it.
2. Cost: 200 independent products in one graph, synced: seconds per product for cuBLASLt (MLX's
   path for 2+ rows), the kernel, and a one-row gemv (MLX's decode path), medians of 5.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from dflash.engine import skinny

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (576, 2880), (6144, 512),
          (40, 70)]  # (N, K): SmolLM2's q/k/v, o, gate/up, down, the draft's fc; odd K


def _err(got: mx.array, ref: mx.array) -> float:
    scale = max(mx.abs(ref).max().item(), 1e-6)
    return mx.abs(got.astype(mx.float32) - ref.astype(mx.float32)).max().item() / scale


def correctness() -> dict:
    rows = []
    worst = 0.0
    for dtype in (mx.bfloat16, mx.float16):
        for n, k in SHAPES:
            w = (mx.random.normal((n, k), key=mx.random.key(n + k)) * k ** -0.5).astype(dtype)
            b = mx.random.normal((n,), key=mx.random.key(7)).astype(dtype)
            for m in (2, 5, 8, 15, 16):
                base = mx.random.normal((1, m + 1, k), key=mx.random.key(m)).astype(dtype)
                for offset in (False, True):
                    x = base[:, 1:] if offset else base[:, :m]
                    for bias in (None, b):
                        ref = skinny.reference(x, w, bias)
                        got = skinny.matmul(x, w, bias)
                        blas = x @ w.T + (bias if bias is not None else 0)
                        e, eb = _err(got, ref), _err(blas, ref)
                        worst = max(worst, e)
                        rows.append({"dtype": str(dtype), "n": n, "k": k, "m": m,
                                     "offset": offset, "bias": bias is not None,
                                     "err": e, "cublas_err": eb})
    return {"cases": len(rows), "worst_rel_err": worst,
            "worst_cublas_rel_err": max(r["cublas_err"] for r in rows), "rows": rows}


def cost(n: int = 960, k: int = 576, calls: int = 200, rounds: int = 5) -> dict:
    w = (mx.random.normal((n, k)) * k ** -0.5).astype(mx.bfloat16)
    xs16 = [mx.random.normal((1, 16, k), key=mx.random.key(i)).astype(mx.bfloat16) for i in range(calls)]
    xs1 = [mx.random.normal((1, 1, k), key=mx.random.key(i)).astype(mx.bfloat16) for i in range(calls)]
    mx.eval(w, xs16, xs1)
    ways = {
        "cublas_16rows": lambda: [x @ w.T for x in xs16],
        "skinny_16rows": lambda: [skinny.matmul(x, w) for x in xs16],
        "gemv_1row": lambda: [x @ w.T for x in xs1],
    }
    out = {}
    for name, f in ways.items():
        mx.eval(f())  # warm-up: JIT, plans
    for name, f in ways.items():
        times = []
        for _ in range(rounds):
            t = time.perf_counter()
            ys = f()
            t_build = time.perf_counter() - t
            mx.eval(ys)
            times.append((time.perf_counter() - t, t_build))
        out[name] = {"us_per_product": 1e6 * statistics.median(a for a, _ in times) / calls,
                     "build_us_per_product": 1e6 * statistics.median(b for _, b in times) / calls}
    return {"n": n, "k": k, "calls_per_graph": calls, "rounds": rounds, **out}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not (mx.default_device() == mx.gpu and mx.cuda.is_available()):
        sys.exit("skinny_check: needs MLX on a CUDA GPU")
    print("works():", skinny.works())
    res = {"device": str(mx.default_device()), "mlx": mx.__version__,
           "correctness": correctness(), "cost": cost(), "cost_8b": cost(n=4096, k=4096)}
    c = res["correctness"]
    print(f"correctness: {c['cases']} cases, worst relative error {c['worst_rel_err']:.2e} "
          f"(cuBLAS against the same reference: {c['worst_cublas_rel_err']:.2e})")
    for key in ("cost", "cost_8b"):
        print(key, json.dumps({k: v for k, v in res[key].items() if isinstance(v, dict)}))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
