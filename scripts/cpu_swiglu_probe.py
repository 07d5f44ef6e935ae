"""What the CPU's fast-exp SwiGLU (engine/fastexp.py) saves in a real target's forwards.

    python scripts/cpu_swiglu_probe.py [--model models/SmolLM2-135M-Instruct] [--context 300] [--out probe.json]

Loads the target as dflash does (fp32, DFLASH_VERIFY_ATTN's default: the fast-exp attention on
the CPU), prefills `--context` tokens, then times forwards of 1, 4, 8 and 16 tokens at that cache
length (the cache trimmed back after each), with the SwiGLU routed to fastexp.swiglu and to
mlx-lm's own, interleaved round by round so the VM's drift hits both; medians. A prefill of the
whole context is timed both ways too (after one untimed). The decode step (1 token) never takes
the fast path, so its two columns should agree: their gap is this VM's noise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx

from dflash.engine import accel, verifyattn
from dflash.engine.loading import load_pair


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    accel.maybe_reexec()  # MKL on the CPU, as dflash's commands run (without it: the BLAS trap)

    pair = load_pair(args.model, None, dtype="float32")
    target = pair.target
    text = "The quick brown fox jumps over the lazy dog, and then it rests for a while. " * 400
    ids = mx.array(pair.tokenizer.encode(text)[: args.context])[None]
    routed = verifyattn._fast_swiglu
    arms = {"fastexp": routed, "mlx": lambda gate, up: False}
    times: dict[str, dict[str, list[float]]] = {arm: {} for arm in arms}

    def run(arm: str, key: str, fn) -> None:
        verifyattn._fast_swiglu = arms[arm]
        t0 = time.perf_counter()
        fn()
        times[arm].setdefault(key, []).append((time.perf_counter() - t0) * 1e3)

    cache = target.make_cache()
    mx.eval(target.forward(ids, cache, last_only=True))  # warm-up (kernels compiled), not timed
    for _ in range(3):
        for arm in arms:
            cache = target.make_cache()
            run(arm, "prefill", lambda: mx.eval(target.forward(ids, cache, last_only=True)))
    for _ in range(args.rounds):
        for arm in arms:
            for m in (1, 4, 8, 16):
                for r in range(4):
                    x = mx.array([[17 + r] * m])
                    if r == 0:  # a first call at this width per round: not timed
                        mx.eval(target.forward(x, cache))
                    else:
                        run(arm, str(m), lambda: mx.eval(target.forward(x, cache)))
                    for c in cache:
                        c.trim(m)
    verifyattn._fast_swiglu = routed
    result = {
        "model": args.model, "context": args.context, "attention": target.verify_attention,
        "device": str(mx.default_device()), "statistic": "median ms",
        "ms": {arm: {k: statistics.median(v) for k, v in t.items()} for arm, t in times.items()},
    }
    for key in ("prefill", "1", "4", "8", "16"):
        print(f"{key:>8} tokens: mlx-lm's SwiGLU {result['ms']['mlx'][key]:8.1f} ms | "
              f"fast-exp {result['ms']['fastexp'][key]:8.1f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
