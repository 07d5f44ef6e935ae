"""Benchmark (not a test): tokens/s and time to first token through the daemon vs in-process.

    python -m dflash.daemon.bench --model DIR --draft DIR --out FILE.json
        [--variants inproc,daemon]   (also: thread, daemon-nocache; a name given twice runs twice)

Same pair, same prompts, same greedy settings, same BLAS choice (this process re-executes itself
with MKL preloaded when the worker would). In-process timings are taken around
`stream_dflash_generate`; daemon timings around `DFlashClient.stream` in this process, so they
include encoding, the socket hops and the queue. Medians over repeats after one warm-up.

Where a gap comes from, variant by variant: `thread` runs the in-process loop on a thread of its
own that loads the pair itself, as the worker's MLX thread does; `daemon-nocache` starts the
daemon without its prefix cache (no snapshots, no cache process). Every run also records the
engine's own decode clock (`engine_decode_tps`, inside the worker for the daemon) and tokens a
cycle, so a slower engine and a slower delivery read apart. Naming a variant twice
(`inproc,daemon,inproc,daemon`) interleaves them against the host's drift: `passes` keeps each
pass apart in run order, `variants` pools a variant's passes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dflash.engine import accel

PROMPTS = [
    "Explain speculative decoding in two sentences.",
    "Write a short story about a fisherman at dawn.",
    "def fibonacci(n): # explain this function",
    "What is the capital of France, and why?",
]


def _summary(runs: list[dict]) -> dict:
    keys = ("ttft_ms", "decode_tps", "e2e_tps", "tokens", "engine_decode_tps", "tokens_per_cycle")
    return {k: round(statistics.median(r[k] for r in runs), 2) for k in keys} | {"runs": len(runs)}


VARIANTS = ("inproc", "thread", "daemon", "daemon-nocache")


def _timed(events, t0: float) -> dict:
    first = None
    tokens = 0
    for ids in events:
        if ids and first is None:
            first = time.perf_counter()
        tokens += len(ids)
    end = time.perf_counter()
    first = first or end
    return {"ttft_ms": (first - t0) * 1000, "decode_tps": max(tokens - 1, 0) / max(end - first, 1e-9),
            "e2e_tps": tokens / max(end - t0, 1e-9), "tokens": tokens}


def _engine(stats: dict, r: dict) -> dict:
    """The engine's own numbers beside the caller's clock."""
    r.update(engine_decode_tps=stats.get("decode_tps"), tokens_per_cycle=stats.get("tokens_per_cycle"))
    return r


def bench_in_process(model: str, draft: str, max_tokens: int, repeats: int) -> list[dict]:
    from dflash.engine.generate import Finished, TokenDelta, stream_dflash_generate
    from dflash.engine.loading import load_pair
    from dflash.engine.prompting import build_prompt

    pair = load_pair(model, draft)
    runs = []
    for rep in range(repeats + 1):
        for p in PROMPTS:
            t0 = time.perf_counter()
            ids = build_prompt(pair.tokenizer, p)
            final: list[Finished] = []

            def deltas(gen):
                for ev in gen:
                    if isinstance(ev, TokenDelta):
                        yield ev.token_ids
                    elif isinstance(ev, Finished):
                        final.append(ev)

            r = _timed(deltas(stream_dflash_generate(pair.target, pair.drafter, pair.tokenizer, ids,
                                                     max_tokens)), t0)
            if rep:
                runs.append(_engine(final[-1].stats.to_dict(), r))
    return runs


def bench_in_thread(model: str, draft: str, max_tokens: int, repeats: int) -> list[dict]:
    """bench_in_process on a thread of its own that loads the pair too (the worker's way)."""
    import threading

    out: list = []
    t = threading.Thread(target=lambda: out.append(bench_in_process(model, draft, max_tokens, repeats)),
                         name="dflash-mlx")
    t.start()
    t.join()
    if not out:
        raise RuntimeError("the in-thread run failed (its traceback is above)")
    return out[0]


def bench_daemon(model: str, draft: str, max_tokens: int, repeats: int, blas: str,
                 cache: bool = True) -> tuple[list[dict], dict]:
    from dflash.client import DFlashClient

    from .config import DaemonConfig

    tmp = Path(tempfile.mkdtemp(prefix="dfb", dir="/tmp"))
    cfg = DaemonConfig(model=model, draft=draft, runtime_dir=str(tmp / "run"), state_dir=str(tmp / "state"),
                       blas=blas, cache=cache)
    proc = subprocess.Popen([sys.executable, "-m", "dflash.daemon.supervisor", "--config-json", cfg.to_json()],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        with DFlashClient(cfg.resolved_endpoint(), config=cfg, timeout=120) as c:
            while c.stats()["state"] == "loading":
                time.sleep(0.1)
            runs = []
            for rep in range(repeats + 1):
                for p in PROMPTS:
                    t0 = time.perf_counter()
                    stream = c.stream(p, max_tokens=max_tokens)
                    r = _timed((d.token_ids for d in stream), t0)
                    if rep:
                        runs.append(_engine(stream.result.stats, r))
            stats = c.stats()
            c.shutdown()
        proc.wait(30)
        return runs, stats
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash.daemon.bench")
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--blas", default="auto", choices=["auto", "mkl", "none"])
    ap.add_argument("--variants", default="inproc,daemon",
                    help=f"comma-separated, in run order, from {', '.join(VARIANTS)}; "
                         "inproc and daemon are always run")
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.replace(" ", "").split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    variants += [v for v in ("inproc", "daemon") if v not in variants]
    accel.maybe_reexec(args.blas, module="dflash.daemon.bench")  # same BLAS as the worker gets

    passes: list[dict] = []  # in run order; a variant named twice (interleaved) runs twice
    pooled: dict[str, list[dict]] = {}
    stats: dict = {}
    for v in variants:
        if v == "inproc":
            runs = bench_in_process(args.model, args.draft, args.max_tokens, args.repeats)
        elif v == "thread":
            runs = bench_in_thread(args.model, args.draft, args.max_tokens, args.repeats)
        else:
            runs, st = bench_daemon(args.model, args.draft, args.max_tokens, args.repeats, args.blas,
                                    cache=v == "daemon")
            stats = st if v == "daemon" else stats
        n = sum(p["variant"] == v for p in passes) + 1
        passes.append({"variant": v, "pass": n} | _summary(runs))
        pooled.setdefault(v, []).extend(r | {"pass": n} for r in runs)
        print(f"{v}: {json.dumps(_summary(runs))}", flush=True)
    # each variant's medians over all its passes; `passes` keeps every pass apart, in order
    summaries = {v: _summary(runs) | {"passes": sum(p["variant"] == v for p in passes)}
                 for v, runs in pooled.items()}
    inproc, daemon = summaries["inproc"], summaries["daemon"]
    result = {
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
        "accel": accel.describe(),
        "model": args.model,
        "max_tokens": args.max_tokens,
        "prompts": len(PROMPTS),
        "in_process": inproc,
        "daemon": daemon,
        "added_ttft_ms": round(daemon["ttft_ms"] - inproc["ttft_ms"], 2),
        "decode_tps_ratio": round(daemon["decode_tps"] / max(inproc["decode_tps"], 1e-9), 3),
        "e2e_tps_ratio": round(daemon["e2e_tps"] / max(inproc["e2e_tps"], 1e-9), 3),
        "worker_accel": stats.get("accel"),
        "variants": summaries,
        "passes": passes,
        "runs": pooled,
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: x for k, x in result.items() if k != "runs"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
