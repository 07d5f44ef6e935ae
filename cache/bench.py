"""Benchmark (not a test): time to first token on a revisited long prompt, cold vs L1 vs L2 hit.

    python -m dflash.cache.bench --model DIR --draft DIR --tokens 4096 --out FILE.json

In-process, with the real PrefixCache and a real cache process (diskcache in a temp dir):
- cold_no_cache: no prefix cache at all (the baseline);
- cold_capture: an empty cache, so the run also takes and writes its snapshots;
- l1_hit: the same prompt again (whole-prompt snapshot restored from RAM);
- l2_hit: a fresh PrefixCache (what a restarted worker has: empty L1), the hit comes from L2.
TTFT is measured around `stream_dflash_generate` up to its first token. Medians of repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from .client import CacheClient
from .l2 import start_cache_process
from .tiers import PrefixCache


def _ttft(pair: Any, ids: list[int], cache: Any) -> dict[str, float]:
    from dflash.engine.generate import Finished, stream_dflash_generate

    t0 = time.perf_counter()
    first = None
    for ev in stream_dflash_generate(pair.target, pair.drafter, pair.tokenizer, ids, 2, prefix_cache=cache):
        if first is None:
            first = time.perf_counter()
        if isinstance(ev, Finished):
            return {"ttft_ms": (first - t0) * 1000, "cached_tokens": ev.stats.cached_prompt_tokens,
                    "token": ev.token_ids[0]}
    raise RuntimeError("no Finished event")


def _hardware() -> dict[str, Any]:
    import mlx.core as mx

    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"platform": platform.platform(), "machine": platform.machine(), "cpu": cpu, "cpus": os.cpu_count(),
            "mlx": mx.__version__, "device": str(mx.default_device()),
            "ld_preload": os.environ.get("LD_PRELOAD", ""), "mkl_threading": os.environ.get("MKL_THREADING_LAYER", "")}


def run(model: str, draft: str, tokens: int, repeats: int, every: int, dtype: str | None) -> dict[str, Any]:
    from dflash.daemon.caching import pair_identity
    from dflash.engine.loading import load_pair
    from dflash.engine.prefix import Snapshot

    pair = load_pair(model, draft, dtype=dtype)
    rng = random.Random(0)
    vocab = int(pair.target.vocab_size)
    ids = [rng.randrange(10, vocab) for _ in range(tokens)]
    ident = pair_identity(pair, dtype)
    tmp = Path(tempfile.mkdtemp(prefix="dfcb", dir="/tmp"))
    endpoint = f"ipc://{tmp / 'cache.sock'}"
    proc = start_cache_process(tmp / "store", endpoint)

    made: list[PrefixCache] = []  # each is closed at the end: its writer thread and sockets

    def fresh() -> PrefixCache:
        made.append(PrefixCache(ident, Snapshot.decode, CacheClient(endpoint, timeout_s=30.0),
                                l1_max_bytes=16 << 30, l1_max_entries=256, every=every))
        return made[-1]

    try:
        deadline = time.monotonic() + 30
        while not fresh().flush():
            made.pop().close()
            if time.monotonic() > deadline:
                raise RuntimeError("cache process did not start")
            time.sleep(0.2)
        _ttft(pair, ids[: min(256, tokens)], None)  # warm-up (kernels, allocator)
        rows: dict[str, list[dict]] = {k: [] for k in ("cold_no_cache", "cold_capture", "l1_hit", "l2_hit")}
        sizes: dict[str, Any] = {}
        for _ in range(repeats):
            rows["cold_no_cache"].append(_ttft(pair, ids, None))
            pc = fresh()
            pc.l2.clear()
            rows["cold_capture"].append(_ttft(pair, ids, pc))
            pc.flush()  # every write-behind put has landed in L2
            rows["l1_hit"].append(_ttft(pair, ids, pc))
            sizes = pc.stats(remote=True)
            rows["l2_hit"].append(_ttft(pair, ids, fresh()))
        ref = {r["token"] for v in rows.values() for r in v}
        if len(ref) != 1:
            raise RuntimeError(f"first tokens differ between scenarios: {ref}")
        out = {k: {"ttft_ms_median": round(statistics.median(r["ttft_ms"] for r in v), 2),
                   "ttft_ms": [round(r["ttft_ms"], 2) for r in v], "cached_tokens": v[0]["cached_tokens"]}
               for k, v in rows.items()}
    finally:
        try:
            for pc in made:
                pc.close(timeout=10)
        finally:  # the cache process goes whatever a close() did
            proc.terminate()
            proc.wait(30)
            shutil.rmtree(tmp, ignore_errors=True)
    base = out["cold_no_cache"]["ttft_ms_median"]
    return {
        "model": model, "draft": draft, "dtype": dtype, "prompt_tokens": tokens, "snapshot_every": every,
        "repeats": repeats, "results": out,
        "speedup_vs_cold": {k: round(base / max(v["ttft_ms_median"], 1e-9), 1) for k, v in out.items()},
        "cache": {"l1_bytes": sizes["l1"]["bytes"], "l1_entries": sizes["l1"]["entries"],
                  "l2_bytes": sizes["l2"]["bytes"], "l2_entries": sizes["l2"]["entries"]},
        "hardware": _hardware(),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m dflash.cache.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--every", type=int, default=1024, help="snapshot interval (tokens)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--out", default=None, help="JSON file (printed too)")
    args = ap.parse_args(argv)
    if argv is None:  # as a program: the fast CPU BLAS, like `dflash benchmark` ($DFLASH_BLAS=none: off)
        from dflash.engine.accel import maybe_reexec

        maybe_reexec(module="dflash.cache.bench")
    res = run(args.model, args.draft, args.tokens, args.repeats, args.every, args.dtype)
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
