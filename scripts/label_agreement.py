"""How often a training answer's token is the target's own greedy choice (the hard label's noise).

    python scripts/label_agreement.py --model models/SmolLM2-135M-Instruct \
        --responses DATA/responses.jsonl [--per-kind 120] [--max-tokens 256]

The campaign's data cache holds greedy answers (temperature 0) and sampled ones (0.7). A
sampled answer's token is a hard label that greedy decoding would not have chosen wherever it
differs from the target's argmax at that row; this counts those rows for each temperature,
over the first `--max-tokens` answer tokens and over the first 16 (where cycles start).
Prints one line per temperature; fp32 on the CPU (greedy answers were written in bf16 on the
H200, so they agree ~98.5%, not 100%: near-ties rounded differently).
"""

from __future__ import annotations

import argparse
import json
import random

import mlx.core as mx
from mlx_lm import load

from dflash.engine import accel


def agreement(model, rows: list[dict], max_tokens: int) -> tuple[int, float, float]:
    n = agree = n16 = agree16 = 0
    for r in rows:
        prompt, answer = r["prompt_ids"], r["response_ids"][:max_tokens]
        logits = model(mx.array([prompt + answer])[:, :-1])
        greedy = mx.argmax(logits[0, len(prompt) - 1:], axis=-1).tolist()
        for i, (g, t) in enumerate(zip(greedy, answer)):
            n += 1
            agree += g == t
            if i < 16:
                n16 += 1
                agree16 += g == t
    return n, agree / max(n, 1), agree16 / max(n16, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--responses", required=True, help="a data cache's responses.jsonl")
    ap.add_argument("--per-kind", type=int, default=120, help="answers drawn per temperature")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    accel.maybe_reexec()  # MKL on the CPU, as dflash's commands run (without it: the BLAS trap)
    model, _ = load(a.model)
    rows = [json.loads(line) for line in open(a.responses)]
    rng = random.Random(a.seed)
    for temp in sorted({float(r.get("temperature") or 0) for r in rows}):
        pick = [r for r in rows if float(r.get("temperature") or 0) == temp]
        rng.shuffle(pick)
        n, all_rows, first16 = agreement(model, pick[: a.per_kind], a.max_tokens)
        print(f"temperature {temp}: {min(len(pick), a.per_kind)} answers, {n} tokens; data token == "
              f"target argmax {all_rows:.3f}, first 16 answer tokens {first16:.3f}", flush=True)


if __name__ == "__main__":
    main()
