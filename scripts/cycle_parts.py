"""What each part of a draft cycle costs, synced, in plain steps: the target's pass over M tokens
(with the feature capture a verify makes), the draft's pass for n rows, and feeding the draft n
context rows. For a machine where the compute is the cycle (a CPU: scripts/cycle_profile.py
finds the host phases there tiny), this says which verify windows can pay at all.

    python scripts/cycle_parts.py --model models/SmolLM2-135M-Instruct --dtype float32 [--rounds 15]

Every part runs once a round, interleaved (the VM's speed drifts), at one cache length (the
prompt plus `--context` tokens; each pass is trimmed off again); medians. Synced one by one,
so a plain step here costs more than the pipelined steps of a real run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from dflash.engine import accel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--prompt", default="Write a short story about a robot who learns to paint.")
    ap.add_argument("--context", type=int, default=300, help="tokens after the prompt in the caches")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    accel.maybe_reexec()  # MKL on x86-64 Linux, as `dflash generate` runs

    import mlx.core as mx

    from dflash.engine import generate as gen
    from dflash.engine.bench.environment import hardware_info, versions
    from dflash.engine.loading import load_pair
    from dflash.engine.prompting import build_prompt

    pair = load_pair(args.model, args.draft, dtype=args.dtype)
    target, drafter = pair.target, pair.drafter
    ids = build_prompt(pair.tokenizer, args.prompt) + list(range(1000, 1000 + args.context))
    caches = target.make_cache()
    drafter.reset()
    gen._prefill(target, drafter, caches, ids, 512)
    pos, anchor = len(ids), mx.array(5, mx.int32)

    def target_pass(m: int) -> float:
        t0 = time.perf_counter()
        logits, features = target.forward(mx.array([[5] * m], mx.int32), caches, eager=m > 1)
        mx.eval(mx.argmax(logits[0], axis=-1), features)
        dt = time.perf_counter() - t0
        for c in caches:
            c.trim(m)
        return dt

    def draft_pass(n: int) -> float:
        t0 = time.perf_counter()
        mx.eval(drafter.propose(anchor, pos, n))
        return time.perf_counter() - t0

    def feed(n: int) -> float:
        _, features = target.forward(mx.array([[5] * n], mx.int32), caches)
        mx.eval(features)
        for c in caches:
            c.trim(n)
        t0 = time.perf_counter()
        drafter.add_context(features)
        mx.eval([c.state for c in drafter.cache])
        dt = time.perf_counter() - t0
        drafter.trim(n)
        return dt

    parts = {**{f"target_{m}": (target_pass, m) for m in (1, 2, 3, 4, 8, 16)},
             **{f"draft_{n}": (draft_pass, n) for n in (1, 3, drafter.block_size - 1)},
             **{f"feed_{n}": (feed, n) for n in (1, 4, 16)}}
    times: dict[str, list[float]] = {k: [] for k in parts}
    for r in range(args.rounds):
        for k, (fn, n) in parts.items():
            times[k].append(fn(n))
    ms = {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()}
    step = ms["target_1"]
    out = {"what": "synced ms of a cycle's parts; medians of interleaved rounds", "model": args.model,
           "draft": str(pair.draft_path), "dtype": args.dtype, "cache_tokens": pos, "rounds": args.rounds,
           "accel": accel.describe(), "ms": ms, "plain_steps": {k: round(v / step, 2) for k, v in ms.items()},
           "hardware": hardware_info(), "versions": versions()}
    print(json.dumps({"ms": out["ms"], "plain_steps": out["plain_steps"]}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
