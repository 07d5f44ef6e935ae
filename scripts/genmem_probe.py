"""Peak GPU memory of the training data's batched generation at the campaign's size.

Session 34's data phase ran an 80 GB H100 out of memory at 2,048 rows (the H200's 141 GB had
held it). The fix (engine/training/data.py) allocates each batch's KV cache once at its whole
length, hands it back between batches and cuts batches to half the GPU's memory; `--old-growth`
replays the 256-slot growth it replaced, to show the difference on the same machine. Random
weights of the target's shape (no stop token: every row decodes all --max-new tokens, the worst
case), so only the MLX wheels need staging:

    python3 scripts/genmem_probe.py --config /tmp/stage/files/smoltok/config.json --out $OUT/genmem.json
    python3 scripts/genmem_probe.py --config ... --old-growth --out $OUT/genmem_old.json
"""

from __future__ import annotations

import argparse
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
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    model = llama.Model(llama.ModelArgs.from_dict(json.load(open(a.config))))
    model.update(tree_map(lambda p: p.astype(mx.bfloat16), model.parameters()))
    mx.eval(model.parameters())
    if a.old_growth:
        class Growing(mlx_cache.BatchKVCache):
            def __setattr__(self, k: str, v: object) -> None:
                if k != "step":  # the fix sets step to the whole length: keep 256
                    super().__setattr__(k, v)
        mlx_cache.BatchKVCache = Growing
    per_token, base = data.kv_bytes_per_token(model), mx.get_active_memory()
    report = {"device": mx.device_info(), "rows": a.rows, "max_new": a.max_new,
              "old_growth": a.old_growth, "kv_bytes_per_token": per_token,
              "kv_budget_gib": round(data.kv_budget_bytes() / 2**30, 2), "batches": []}
    for width in (int(w) for w in a.widths.split(",")):
        prompts = [[(i * 7 + j) % 4000 + 1 for j in range(width)] for i in range(a.rows)]
        mx.reset_peak_memory()
        t0, error = time.perf_counter(), None
        try:
            data.batch_generate(model, prompts, a.max_new, [])
        except RuntimeError as e:  # the OOM this probes for
            error = str(e)[:300]
        if not a.old_growth:
            mx.clear_cache()  # as generate_responses does between batches
        row = {"width": width, "kv_gib": round(a.rows * (width + a.max_new) * per_token / 2**30, 2),
               "peak_above_model_gib": round((mx.get_peak_memory() - base) / 2**30, 2),
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
