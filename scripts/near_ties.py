"""Where a target's greedy answer has near-ties: the gap between its top two logits, token by token.

    python scripts/near_ties.py [--model models/SmolLM2-135M-Instruct] [--max-tokens 130] [--below 0.05]

A GPU benchmark in bf16 (or fp32, where the GPU's matmuls round differently) may report "DFlash ids
differ from the baseline's at token k": a 16-token verify and mlx-lm's 1-token step compute the
same logits through different kernels, and where the top two are nearly tied the rounding decides.
This replays mlx-lm's own greedy decode of the benchmark's chat questions (`dflash benchmark
--chat`) in fp32 on the CPU and prints, per question, the gap at the first token and every
position whose gap is below `--below`: a reported mismatch at one of those positions is a
rounding tie, not a wrong token (docs/benchmark.md, "Lossless on a GPU").
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from dflash.engine import accel
from dflash.engine.bench.setup import CHAT_QUESTIONS
from dflash.engine.prompting import build_prompt


def greedy_with_gaps(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy decode as mlx-lm runs it (prefill, then one token a step): the ids, and the top-1
    minus top-2 logit at every generated position."""
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)[0, -1]
    ids, gaps = [], []
    for _ in range(max_tokens):
        row = np.array(logits.astype(mx.float32))
        first, second = np.argsort(-row)[:2]
        ids.append(int(first))
        gaps.append(float(row[first] - row[second]))
        logits = model(mx.array([[int(first)]]), cache=cache)[0, -1]
    return ids, gaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    ap.add_argument("--max-tokens", type=int, default=130)
    ap.add_argument("--below", type=float, default=0.05, help="Report positions with a smaller gap.")
    ap.add_argument("--out", default=None, help="Also write the result as JSON here.")
    args = ap.parse_args()
    accel.maybe_reexec()  # fp32 CPU speed (the BLAS trap): MKL, as dflash's own commands use
    model, tokenizer = load(args.model)
    rows = []
    for q in CHAT_QUESTIONS:
        prompt = build_prompt(tokenizer, q)
        _, gaps = greedy_with_gaps(model, prompt, args.max_tokens)
        near = [i for i, g in enumerate(gaps) if g < args.below]
        rows.append({"question": q, "prompt_tokens": len(prompt), "gap_first_token": round(gaps[0], 4),
                     "near_ties": near, "min_gap": round(min(gaps), 4), "min_gap_at": gaps.index(min(gaps))})
        print(f"{len(prompt):4d} {q[:40]:40s} | gap at token 0 {gaps[0]:.4f} | "
              f"gap < {args.below} at {near} | min {min(gaps):.4f} at {gaps.index(min(gaps))}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "dtype": "float32", "device": "cpu",
                       "max_tokens": args.max_tokens, "below": args.below, "questions": rows}, f, indent=2)


if __name__ == "__main__":
    main()
