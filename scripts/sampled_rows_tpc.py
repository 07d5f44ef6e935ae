"""Tokens a cycle that several sampled draft rows buy (DFLASH_SAMPLED_ROWS=1), per row count.

    python scripts/sampled_rows_tpc.py --model models/SmolLM2-135M-Instruct [--rows 1,4,8] \
        [--temperature 0.7] [--prompts 16] [--max-tokens 96] [--out F]

What rows cost is the device's (a GPU verifies 8 rows for ~1.05-1.3x one row's time on the
default pair, docs/benchmark.md); what they buy is tokens a cycle, which does not depend on the
device: the same pair, the same fp32 maths. So this decodes the held-out prompts (the ones the
draft never trained on, through the chat template) sampled, every cycle verifying the whole
block (verify window "full", so each row count is measured on the same kind of cycle), once per
row count, with the same seed per prompt, and reports tokens a cycle (all cycles' emitted
tokens over their count) and acceptance. `--temperature 0` measures greedy rows the same way. The texts
differ between row counts (different draws), so the means are over many prompts; the spread of
the per-prompt values says how far to trust a difference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from dflash.engine import accel, branches
from dflash.engine.generate import Finished, stream_dflash_generate
from dflash.engine.loading import load_pair
from dflash.engine.prompting import build_prompt, prompt_lines

HERE = Path(__file__).resolve().parent.parent


def decode(pair, ids: list[int], rows: int, args: argparse.Namespace, seed: int) -> dict:
    final = None
    for ev in stream_dflash_generate(pair.target, pair.drafter, pair.tokenizer, ids, args.max_tokens,
                                     verify_window="full", branches=rows, temperature=args.temperature,
                                     top_p=args.top_p, seed=seed):
        if isinstance(ev, Finished):
            final = ev
    s = final.stats
    return {"tokens": s.generated_tokens, "cycles": s.cycles, "emitted": s.accepted_drafts + s.cycles, "tokens_per_cycle": round(s.tokens_per_cycle, 4),
            "acceptance": round(s.acceptance, 4), "rows_kept_other_than_0": s.branch_wins,
            "row_cycles": s.branch_cycles}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts (of 48), in file order")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    accel.maybe_reexec()
    os.environ[branches.SAMPLED_ENV] = "1"
    row_counts = [int(r) for r in args.rows.split(",")]
    if not row_counts or not all(1 <= r <= branches.MAX_ROWS for r in row_counts):
        ap.error(f"--rows: counts from 1 to {branches.MAX_ROWS}")
    pair = load_pair(args.model, args.draft)
    held = [q for _, q in prompt_lines((HERE / "engine/training/heldout_prompts.jsonl").read_text())]
    prompts = [build_prompt(pair.tokenizer, q) for q in held[: args.prompts]]
    runs: dict[str, list[dict]] = {str(r): [] for r in row_counts}
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        for r in row_counts:
            runs[str(r)].append(decode(pair, ids, r, args, seed=1000 + i))
        print(f"[{i + 1}/{len(prompts)}] " + ", ".join(
            f"R={r} {runs[str(r)][-1]['tokens_per_cycle']:.2f}" for r in row_counts), flush=True)
    summary = {}
    for r, rs in runs.items():
        emitted, cycles = sum(x["emitted"] for x in rs), sum(x["cycles"] for x in rs)
        summary[r] = {"tokens_per_cycle": round(emitted / cycles, 4),
                      "mean_of_prompts": round(statistics.mean(x["tokens_per_cycle"] for x in rs), 4),
                      "acceptance": round(statistics.mean(x["acceptance"] for x in rs), 4)}
    one = summary.get("1", {}).get("tokens_per_cycle")
    for r, s in summary.items():
        s["vs_one_row"] = round(s["tokens_per_cycle"] / one, 4) if one else None
        print(f"R={r}: {s['tokens_per_cycle']:.3f} tokens a cycle (x{s['vs_one_row']}), acceptance {s['acceptance']:.3f}")
    report = {"what": "tokens a sampled cycle emits by draft rows (DFLASH_SAMPLED_ROWS=1), verify window full",
              "args": vars(args), "accel": accel.describe(), "seconds": round(time.perf_counter() - t0, 1),
              "summary": summary, "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
