"""Peak GPU memory of the training data's batched generation at the campaign's size.

Session 34's data phase ran an 80 GB H100 out of memory at 2,048 rows (the H200's 141 GB had
held it). The fix (engine/training/data.py) allocates each batch's KV cache once at its whole
length, hands it back between batches and cuts batches to fit the GPU's memory; `--old-growth`
replays the 256-slot growth it replaced, to show the difference on the same machine. Random
weights of the target's shape (no stop token: every row decodes all --max-new tokens, the worst
case), so only the MLX wheels need staging:

    python3 scripts/genmem_probe.py --config /tmp/stage/files/smoltok/config.json --out $OUT/genmem.json
    python3 scripts/genmem_probe.py --config ... --old-growth --out $OUT/genmem_old.json

Session 50: each decode step is scheduled only once the last one has finished (mx.synchronize in
batch_generate), so its slice updates write the cache buffers in place; `--no-sync` replays the
loop before that (each step scheduled while the last ran: every layer's buffer copied per step in
flight; session 35's probe: 2.6x the KV on an H200). Each batch's row gives peak_over_kv and a
hash of its tokens, which must be the same either way.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache
from mlx.utils import tree_map
from mlx_lm.models import llama

from dflash.engine.training import data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="the target's config.json (a Llama-shaped model)")
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--max-new", type=int, default=512)
    ap.add_argument("--widths", default="48,64", help="prompt widths, one batch each, in order")
    ap.add_argument("--old-growth", action="store_true", help="the 256-slot growth, no clear_cache")
    ap.add_argument("--no-sync", action="store_true",
                    help="schedule each step while the last one runs (the loop before session 50)")
    ap.add_argument("--ragged", action="store_true",
                    help="prompts of a quarter of the width up to the width (left padding, as the data "
                         "phase has; session 50: 2,048 such rows of 81 peaked at 2.9x the KV)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    mx.random.seed(0)  # the same random weights every run: the token hashes compare across runs
    model = llama.Model(llama.ModelArgs.from_dict(json.load(open(a.config))))
    model.update(tree_map(lambda p: p.astype(mx.bfloat16), model.parameters()))
    mx.eval(model.parameters())
    if a.old_growth:
        class Growing(mlx_cache.BatchKVCache):
            def __setattr__(self, k: str, v: object) -> None:
                if k != "step":  # the fix sets step to the whole length: keep 256
                    super().__setattr__(k, v)
        mlx_cache.BatchKVCache = Growing
    if a.no_sync:  # batch_generate's mx.synchronize() a no-op: the pipelined loop it replaced
        class _NoSync:
            def __getattr__(self, name: str) -> object:
                return getattr(mx, name)

            @staticmethod
            def synchronize(*args: object, **kwargs: object) -> None:
                return None

        data.mx = _NoSync()
    per_token, base = data.kv_bytes_per_token(model), mx.get_active_memory()
    report = {"device": mx.device_info(), "rows": a.rows, "max_new": a.max_new,
              "old_growth": a.old_growth, "no_sync": a.no_sync, "ragged": a.ragged, "kv_bytes_per_token": per_token,
              "kv_budget_gib": round(data.kv_budget_bytes() / 2**30, 2), "batches": []}
    for width in (int(w) for w in a.widths.split(",")):
        lengths = [width - (i * 13) % (3 * width // 4) if a.ragged else width for i in range(a.rows)]
        prompts = [[(i * 7 + j) % 4000 + 1 for j in range(n)] for i, n in enumerate(lengths)]
        mx.reset_peak_memory()
        t0, error, tokens = time.perf_counter(), None, None
        try:
            out = data.batch_generate(model, prompts, a.max_new, [])
            tokens = hashlib.blake2b(json.dumps(out).encode(), digest_size=8).hexdigest()
        except RuntimeError as e:  # the OOM this probes for
            error = str(e)[:300]
        peak = mx.get_peak_memory() - base
        kv = a.rows * (width + a.max_new) * per_token
        if not a.old_growth:
            mx.clear_cache()  # as generate_responses does between batches
        row = {"width": width, "kv_gib": round(kv / 2**30, 2),
               "peak_above_model_gib": round(peak / 2**30, 2),
               "peak_over_kv": round(peak / kv, 3) if kv else None, "tokens": tokens,
               "cache_gib_after": round(mx.get_cache_memory() / 2**30, 2),
               "seconds": round(time.perf_counter() - t0, 1), "error": error}
        report["batches"].append(row)
        print(json.dumps(row), flush=True)
        if error:
            break
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
