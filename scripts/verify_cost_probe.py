"""Where a 16-token verify's extra cost goes, one transformer layer's parts at a time (issue #11, item 4).

    python scripts/verify_cost_probe.py [--contexts 1024,8192] [--out probe.json]   # Qwen3-8B shape, bf16

t(verify 16) / t(step 1) is 1.6 (1K) to 2.2 (8K) for the 8B shape on an H200 (README), while the
weights a step reads are the same for 1 and 16 tokens. This times, for M = 1 and M = 16 query
tokens at each cache length L: the layer's matmuls (q/k/v/o projections and the MLP, x @ W with
x [M, hidden]), and attention over L + M keys in three ways: MLX's fused SDPA with the causal
mask (what a verify runs), the same with an explicit boolean mask, and M single-query SDPA calls
(the decode kernel, each at its own length). Every timed call runs at a cache length not used
before in this process (L + i for repeat i), after warm-up calls at other lengths; medians.
The sums say which part to attack (a specialised kernel through mx.fast.cuda_kernel, or another
attention path) before writing one. Where the parts' sums do not add up to what a whole verify
costs, the whole-layer rows do: one mlx-lm Qwen3 block (norms, RoPE, cache write, projections,
attention, MLP) over a KV cache at a new length per call, with MLX's attention (`layer_ms`) and,
on a CUDA GPU, with engine/fewq.py's kernel as the cycle runs it (`layer_fewq_ms`, and the
kernel's attention alone, `sdpa_fewq_ms`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3 import ModelArgs, TransformerBlock

try:  # the repository's engine, for the few-query kernel rows (run from the repo root)
    from dflash.engine import fewq, verifyattn
except ImportError:  # pragma: no cover - the probe runs without it, minus those rows
    fewq = verifyattn = None


def timed(fn, repeats: int) -> float:
    """Median ms of fn(i) for i = 0..repeats-1, each call synced; fn(-1 - k) warms up."""
    for k in range(3):
        mx.eval(fn(-1 - k))
    out = []
    for i in range(repeats):
        t = time.perf_counter()
        mx.eval(fn(i))
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def probe(args: argparse.Namespace) -> dict:
    dt = getattr(mx, args.dtype)
    H, KV, D, hidden, inter = args.heads, args.kv_heads, args.head_dim, args.hidden, args.intermediate
    mats = {"q_proj": (hidden, H * D), "k_proj": (hidden, KV * D), "v_proj": (hidden, KV * D),
            "o_proj": (H * D, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}
    weights = {k: (mx.random.normal(s) * 0.02).astype(dt) for k, s in mats.items()}
    mx.eval(weights)
    block = TransformerBlock(ModelArgs(
        model_type="qwen3", hidden_size=hidden, num_hidden_layers=1, intermediate_size=inter,
        num_attention_heads=H, rms_norm_eps=1e-6, vocab_size=32, num_key_value_heads=KV,
        max_position_embeddings=1 << 20, head_dim=D, tie_word_embeddings=True, rope_theta=1e6))
    block.set_dtype(dt)
    mx.eval(block.parameters())
    kernel = (fewq is not None and verifyattn.cuda()
              and verifyattn.configure() == "kernel")  # wraps MLX's attention inside active()
    scale = D ** -0.5
    rows = []
    for L in args.contexts:
        span = L + 2 * args.repeats + 64  # room for every length this context visits
        keys = (mx.random.normal((1, KV, span, D)) * 0.5).astype(dt)
        vals = (mx.random.normal((1, KV, span, D)) * 0.5).astype(dt)
        mx.eval(keys, vals)
        for M in args.tokens:
            x = mx.random.normal((M, hidden)).astype(dt)
            inp = {k: (x if s[0] == hidden else mx.random.normal((M, s[0])).astype(dt)) for k, s in mats.items()}
            q = (mx.random.normal((1, H, M, D)) * 0.5).astype(dt)
            mx.eval(x, q, *inp.values())

            def at(i: int) -> int:  # a cache length never used before: warm-ups below L, repeats above
                return L + i if i >= 0 else L - 8 * (-i)

            row = {"context": L, "tokens": M}
            for name, w in weights.items():
                row[f"{name}_ms"] = timed(lambda i, a=inp[name], w=w: a @ w, args.repeats)
            row["matmuls_ms"] = sum(row[f"{n}_ms"] for n in weights)

            def fused(i: int, mask=None) -> mx.array:
                n = at(i) + M
                return mx.fast.scaled_dot_product_attention(q, keys[:, :, :n], vals[:, :, :n], scale=scale,
                                                            mask=mask if mask is not None else ("causal" if M > 1 else None))
            row["sdpa_causal_ms"] = timed(fused, args.repeats)
            if M > 1:
                def explicit(i: int) -> mx.array:
                    n = at(i) + M
                    mask = mx.arange(n)[None, :] <= (mx.arange(M)[:, None] + n - M)
                    return fused(i, mask)
                row["sdpa_bool_mask_ms"] = timed(explicit, args.repeats)

                def one_by_one(i: int) -> mx.array:
                    n0 = at(i)
                    return mx.concatenate([mx.fast.scaled_dot_product_attention(
                        q[:, :, j:j + 1], keys[:, :, :n0 + j + 1], vals[:, :, :n0 + j + 1], scale=scale)
                        for j in range(M)], axis=2)
                row["sdpa_single_queries_ms"] = timed(one_by_one, args.repeats)
                ref = fused(0).astype(mx.float32)  # the three ways compute the same attention
                tol = 1e-4 if dt == mx.float32 else 2e-2
                row["variants_agree"] = all(mx.allclose(ref, f(0).astype(mx.float32), atol=tol).item()
                                            for f in (explicit, one_by_one))
                if kernel and fewq.supported(q, keys, vals):
                    def fewq_attn(i: int) -> mx.array:
                        n = at(i) + M
                        return fewq.attention(q, keys[:, :, :n], vals[:, :, :n], scale, True)
                    row["sdpa_fewq_ms"] = timed(fewq_attn, args.repeats)

            cache = KVCache()
            cache.keys, cache.values = mx.array(keys), mx.array(vals)  # the layer writes its own rows
            xl = x[None]

            def layer(i: int) -> mx.array:
                cache.offset = at(i)  # a new length each call: the rows past it are overwritten
                return block(xl, mask="causal" if M > 1 else None, cache=cache)
            row["layer_ms"] = timed(layer, args.repeats)
            if kernel and M > 1:
                def layer_fewq(i: int) -> mx.array:
                    with verifyattn.active():
                        return layer(i)
                row["layer_fewq_ms"] = timed(layer_fewq, args.repeats)
            rows.append(row)
            print(json.dumps({k: round(v, 3) if type(v) is float else v for k, v in row.items()}), flush=True)
    return {"device": str(mx.default_device()), "mlx": mx.__version__, "dtype": args.dtype,
            "shape": {"heads": H, "kv_heads": KV, "head_dim": D, "hidden": hidden, "intermediate": inter},
            "method": "one layer's parts, then the whole layer; medians of synced calls, each at a cache "
                      "length not used before (L + i), after 3 warm-up calls at other lengths",
            "attention_kernel": bool(kernel), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,8192", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--tokens", default="1,16", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=12288)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = probe(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
