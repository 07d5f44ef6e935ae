"""Check engine/fewq.py's CUDA kernel on a CUDA GPU: its output against fewq.reference (fp32 ops)
and its time against MLX's attention for the same call, per shape, as JSON.

    python scripts/fewq_check.py [OUT.json]

Shapes: the Qwen3-8B layer (32 query / 8 KV heads, head dim 128) and SmolLM2-135M (9 / 3, 64);
keys 300, 1,040 and 8,208 (slices of a longer buffer, as a KV cache hands them over); 16, 7 and
4 queries; causal (a verify) and not (a draft block). Times: median of 30 synced calls after 3
warm-ups, the same call each time (cuDNN attention off, so MLX builds no per-shape graph).
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import sys
import time

import mlx.core as mx

from dflash.engine import fewq


def timed(fn, reps: int = 30) -> float:
    for _ in range(3):
        mx.eval(fn())
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main() -> None:
    rows = []
    for name, hq, hkv, d in (("qwen3-8b", 32, 8, 128), ("smollm2-135m", 9, 3, 64)):
        for n in (1040, 8208, 300):
            for m in (16, 7, 4):
                for causal in (True, False):
                    keys = mx.random.normal((1, hkv, n + 256, d)).astype(mx.bfloat16)
                    vals = mx.random.normal((1, hkv, n + 256, d)).astype(mx.bfloat16)
                    k, v = keys[:, :, :n, :], vals[:, :, :n, :]
                    q = mx.random.normal((1, m, hq, d)).astype(mx.bfloat16).transpose(0, 2, 1, 3)
                    scale = 1 / math.sqrt(d)
                    got = fewq.attention(q, k, v, scale, causal).astype(mx.float32)
                    want = fewq.reference(q, k, v, scale, causal).astype(mx.float32)
                    row = {"shape": name, "keys": n, "queries": m, "causal": causal,
                           "max_abs_err": mx.abs(got - want).max().item()}
                    if n != 300 and m in (16, 4):
                        mask = "causal" if causal else None
                        row["kernel_ms"] = timed(lambda: fewq.attention(q, k, v, scale, causal))
                        row["mlx_ms"] = timed(lambda: mx.fast.scaled_dot_product_attention(
                            q, k, v, scale=scale, mask=mask))
                        q1 = q[:, :, :1, :]
                        row["mlx_one_query_ms"] = timed(lambda: mx.fast.scaled_dot_product_attention(
                            q1, k, v, scale=scale))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    worst = max(r["max_abs_err"] for r in rows)
    result = {"what": "engine/fewq.py kernel vs fp32 reference and MLX attention, bf16",
              "device": str(mx.default_device()), "mlx": mx.__version__, "host": platform.node(),
              "timing": "median of 30 synced calls after 3 warm-ups; MLX_CUDA_USE_CUDNN_SDPA=0",
              "max_abs_err": worst, "rows": rows}
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f, indent=1)
    print(f"worst max abs error {worst:.4f} over {len(rows)} cases")
    if worst > 0.02:
        sys.exit(1)


if __name__ == "__main__":
    main()
