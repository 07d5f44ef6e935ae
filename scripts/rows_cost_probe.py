"""What several draft rows cost a verify, by cache length (the budget in engine/branches.py).

    python scripts/rows_cost_probe.py --model DIR --dtype bfloat16 [--lengths 128,1024] [--out F]
    python scripts/rows_cost_probe.py --random-target qwen3-8b ... [--parts]   # a random-weight shape

A greedy verify of R rows copies the KV cache into every row (`rollback.tile_rows`), runs the
target over [R, 16] tokens, and keeps the best row (`rollback.keep_row`). Session 26's first-time
benchmark on the H200 suggested that this costs more as the cache grows (SmolLM2-135M: one row
6.7 ms a cycle against 12.1 ms with 8, prompts of ~900 tokens), while the default budget
(256 MiB of copies) was set without a measurement. This times exactly that: for each cache
length L, a prompt of L random ids is prefilled, then for each row count R, `warmup` and then
`repeats` verifies of an anchor + 15 random drafts through `engine.verify.verify` (the cycle's
own function: tile, batched pass, argmax, keep one row), each synced, each followed by
`rollback.rewind` to the anchor alone, so the cache grows one token a call and every timed call
runs at a cache length no call ran at before (no flattering reuse of per-shape work). Medians;
the ratio to one row at the same length is what the rows must earn back in tokens a cycle
(8 rows: 1.24x more on the H200 chat benchmark, session 25). `--parts` also times the copy into
the rows, the batched pass and the copy back out, each synced apart: which of them grows with
the cache (session 26: on the Qwen3-8B shape a verify took 10.8 ms with one row and 41.2 ms with
8 at 4,096 tokens, far more than the rows' attention or copies at HBM speed should take).
`--revisit` also times the same verifies at one cache length again and again (rewound after each
call): whether revisiting a length is cheaper than a first-time one, which is what the `--chat`
benchmark (five fixed questions, re-run) leans on with cuDNN attention off.
Session 31 also ran it with the cache kept in rows between verifies (DFLASH_ROWS_KEEP=1,
commit 8ea9c11; the results' "rows_cache" field): on the Qwen3-8B shape 8 rows cost 1.48x /
2.46x of one at 512 / 4,096 tokens against 1.61x / 2.86x copying, lengths past the rows' budget
(~230 tokens there), and SmolLM2-135M end to end was no faster (2.07x of mlx-lm against 2.18x),
so it was removed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import mlx.core as mx

from dflash.engine import branches, rollback
from dflash.engine.target import TargetModel, default_layer_ids
from dflash.engine.verify import greedy_accept, verify

BLOCK = 16


def load_target(args: argparse.Namespace) -> tuple[TargetModel, str]:
    """The target (layer ids: five spread, as a draft would read), and how it was made."""
    dtype = getattr(mx, args.dtype)
    if args.random_target:
        from dflash.engine.bench.setup import random_target

        model, _, _ = random_target(args.random_target, dtype)
        name = f"random {args.random_target}"
    else:
        from mlx_lm import load

        model, _ = load(args.model)
        model.set_dtype(dtype)
        name = args.model
    return TargetModel(model, default_layer_ids(len(model.layers))), name


def time_rows(target: TargetModel, length: int, rows: int, args: argparse.Namespace,
              caches: list, keep: int = 1) -> list[float]:
    """ms of each timed verify of `rows` rows, continuing on `caches`: `keep` tokens of each
    verify stay (1: the cache grows a token a call, every call at a new length; 0: every call at
    the same length, revisited after the first)."""
    vocab = target.vocab_size
    out = []
    for i in range(args.warmup + args.repeats):
        anchor = mx.random.randint(0, vocab, (1,), dtype=mx.int32)
        shape = (rows, BLOCK - 1) if rows > 1 else (BLOCK - 1,)
        drafts = mx.random.randint(0, vocab, shape, dtype=mx.int32)
        mx.eval(anchor, drafts)
        t0 = time.perf_counter()
        cyc = verify(target, caches, anchor, drafts, record_tape=False)
        mx.eval(cyc.summary, cyc.features)
        dt = (time.perf_counter() - t0) * 1e3
        rollback.rewind(caches, target.layers, keep, BLOCK, None)
        if i >= args.warmup:
            out.append(dt)
    return out


def _synced(arrays: list[mx.array]) -> float:
    """ms to evaluate `arrays` (the host waits)."""
    t0 = time.perf_counter()
    mx.eval(arrays)
    return (time.perf_counter() - t0) * 1e3


def time_parts(target: TargetModel, rows: int, args: argparse.Namespace, caches: list) -> dict:
    """Median ms of a several-row verify's three parts, each synced on its own: the cache copied
    into every row (`rollback.tile_rows`), the batched pass with its argmax, and the kept row
    taken back (`rollback.keep_row`). Syncing between them stops MLX from fusing or donating
    across the parts, so their sum can exceed the whole verify; what they show is which part
    grows with the cache."""
    vocab, parts = target.vocab_size, {"tile": [], "forward": [], "keep": []}
    for i in range(args.warmup + args.repeats):
        block = mx.random.randint(0, vocab, (rows, BLOCK), dtype=mx.int32)
        mx.eval(block)
        rollback.tile_rows(caches, rows)
        tile = _synced([a for c in caches for a in (c.keys, c.values)])
        logits, features = target.forward(block, caches, eager=True)
        accepted = greedy_accept(block[:, 1:], mx.argmax(logits, axis=-1))
        best = mx.argmax(accepted).astype(mx.int32)
        forward = _synced([best, features])
        rollback.keep_row(caches, best)
        keep = _synced([a for c in caches for a in (c.keys, c.values)])
        rollback.rewind(caches, target.layers, 1, BLOCK, None)
        if i >= args.warmup:
            for name, ms in (("tile", tile), ("forward", forward), ("keep", keep)):
                parts[name].append(ms)
    return {name: round(statistics.median(v), 3) for name, v in parts.items()}


def probe(args: argparse.Namespace) -> dict:
    target, name = load_target(args)
    row_counts = [int(r) for r in args.rows.split(",")]
    results = []
    for length in [int(n) for n in args.lengths.split(",")]:
        caches = target.make_cache()
        ids = mx.random.randint(0, target.vocab_size, (1, length), dtype=mx.int32)
        mx.eval(target.forward(ids, caches, last_only=True)[0])
        per_token = branches.kv_bytes_per_token(caches)
        row = {"cache_length": length, "kv_bytes_per_token": per_token, "ms": {}, "all_ms": {}}
        for r in row_counts:
            times = time_rows(target, length, r, args, caches)
            row["ms"][str(r)] = round(statistics.median(times), 3)
            row["all_ms"][str(r)] = [round(t, 3) for t in times]
        if args.revisit:  # the same verifies at one length again and again
            row["revisited_ms"] = {str(r): round(statistics.median(
                time_rows(target, length, r, args, caches, keep=0)), 3) for r in row_counts}
        if args.parts:
            row["parts_ms"] = {str(r): time_parts(target, r, args, caches) for r in row_counts if r > 1}
        one = row["ms"].get("1")
        row["ratio_to_one_row"] = {r: round(v / one, 3) for r, v in row["ms"].items()} if one else {}
        row["copies_mib"] = {str(r): round(r * length * per_token / 2**20, 1) for r in row_counts}
        results.append(row)
        print(f"[rows] L={length:5d}: " + ", ".join(
            f"R={r} {row['ms'][str(r)]:.2f} ms" + (f" ({row['ratio_to_one_row'][str(r)]:.2f}x)" if one else "")
            for r in row_counts), flush=True)
        if args.revisit:
            print("        revisited: " + ", ".join(f"R={r} {v:.2f} ms" for r, v in row["revisited_ms"].items()),
                  flush=True)
        for r, part in row.get("parts_ms", {}).items():
            print(f"        R={r} parts: " + ", ".join(f"{k} {v:.2f} ms" for k, v in part.items()), flush=True)
    return {
        "target": name, "dtype": args.dtype, "device": str(mx.default_device()),
        "machine": platform.node(), "mlx": mx.__version__,
        "verify_attention": target.verify_attention, "fused_products": bool(target.fused),
        "revisited": "revisited_ms: the same verifies at one cache length, rewound after each call "
                     "(--revisit)" if args.revisit else None,
        "parts": "tile / forward / keep: a several-row verify's parts, each synced apart (--parts)"
                 if args.parts else None,
        "method": f"per cache length: prefill that many random ids, then per row count {args.warmup} "
                  f"warm-up and {args.repeats} timed verifies of [R, {BLOCK}] random tokens through "
                  "engine.verify.verify (tile rows, batched pass, argmax, keep one row), each synced "
                  "and rewound to its anchor, so the cache grows a token a call and every timed call "
                  "is at a first-time cache length; medians",
        "rows": results,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="an mlx-lm model directory")
    ap.add_argument("--random-target", help="a random-weight shape (bench.setup.RANDOM_SHAPES)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--lengths", default="128,256,512,1024,1536,2048,4096")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--parts", action="store_true",
                    help="also time a several-row verify's copy in, batched pass and copy out apart")
    ap.add_argument("--revisit", action="store_true",
                    help="also time the same verifies at one revisited length (what a benchmark that "
                         "re-runs a prompt measures), beside the first-time ones")
    ap.add_argument("--out")
    args = ap.parse_args()
    if not (args.model or args.random_target):
        ap.error("give --model or --random-target")
    report = probe(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
