"""Are DFlash's answers the target's own? Every emitted token checked against a one-token step.

    python scripts/text_check.py --model MODEL [--draft DRAFT] [--dtype bfloat16] [--heldout 11]
        [--max-tokens 256] [--windows full,auto] [--out check.json]

In fp32 DFlash's greedy ids equal mlx-lm's (tests/test_lossless.py). In bf16 on a GPU a 16-token
verify and mlx-lm's 1-token step round differently, so answers part at near-ties, and then decode
different texts; arms_ab found the whole-block window's bf16 texts far more predictable than
mlx-lm's (5.3 against ~3 tokens a cycle on the same prompts). Rounding cannot be told from a
wrong token by the ids alone; this tells them apart. For each prompt (the 5 chat questions, then
`--heldout` held-out prompts) it decodes mlx-lm's greedy answer and DFlash's with each window,
then replays every answer through the target one token at a time, exactly as mlx-lm decodes
(teacher-forced: the answer's own tokens fed back), and at each position compares the answer's
token with that step's argmax. A mismatch's deficit is the step's top logit minus the logit of
the token the answer has there: a rounding tie leaves a deficit of a bf16 rounding or two (~0.1
at these logits' size), a token the target would not have chosen leaves a large one.
mlx-lm's own answers replay with no mismatch (the control that the replay is mlx-lm's decoding).
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
import numpy as np

from dflash.engine import accel
from dflash.engine.bench.environment import hardware_info, versions
from dflash.engine.bench.timing import run_baseline, run_dflash
from dflash.engine.loading import load_pair


def replay(model, prompt: list[int], answer: list[int]) -> dict:
    """Feed prompt + answer through `model` one token at a time (mlx-lm's decode); per answer
    position the step's argmax against the answer's token."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)[0, -1]
    deficits, gaps = [], []
    for i, tok in enumerate(answer):
        row = np.array(logits.astype(mx.float32))
        top = int(row.argmax())
        if top != tok:
            deficits.append({"pos": i, "deficit": round(float(row[top] - row[tok]), 4)})
        srt = np.sort(row)
        gaps.append(float(srt[-1] - srt[-2]))
        logits = model(mx.array([[tok]]), cache=cache)[0, -1]
    return {"tokens": len(answer), "mismatches": len(deficits), "deficits": deficits,
            "max_deficit": max((d["deficit"] for d in deficits), default=0.0),
            "median_top2_gap": round(float(np.median(gaps)), 4) if gaps else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--heldout", type=int, default=11)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--windows", default="full,auto")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    accel.maybe_reexec()  # MKL on the CPU, as dflash's commands run (without it: the BLAS trap)
    from arms_ab import questions  # the 5 chat questions + held-out prompts, as arms_ab draws them

    pair = load_pair(a.model, a.draft, dtype=a.dtype)
    rows = []
    for qi, q in enumerate(questions(a.heldout)):
        prompt = pair.tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                    add_generation_prompt=True)
        # the answers as the benchmark decodes them (to EOS, which neither keeps)
        texts = {"mlx-lm": run_baseline(pair, prompt, a.max_tokens)[0]}
        for w in a.windows.split(","):
            texts[f"dflash-{w}"] = run_dflash(pair, pair.drafter, prompt, a.max_tokens, window=w)[0]
        row = {"question": qi}
        for name, ids in texts.items():
            r = replay(pair.target.model, prompt, ids)
            part = next((i for i, (x, y) in enumerate(zip(ids, texts["mlx-lm"])) if x != y), None)
            row[name] = {**r, "parts_from_mlx_lm_at": part}
        rows.append(row)
        print(qi, {n: (v["tokens"], v["mismatches"], v["max_deficit"], v["parts_from_mlx_lm_at"])
                   for n, v in row.items() if n != "question"}, flush=True)
    summary = {}
    for name in rows[0]:
        if name == "question":
            continue
        defs = [d["deficit"] for r in rows for d in r[name]["deficits"]]
        summary[name] = {"answers": len(rows), "tokens": sum(r[name]["tokens"] for r in rows),
                         "mismatches": len(defs), "max_deficit": max(defs, default=0.0),
                         "median_deficit": float(np.median(defs)) if defs else 0.0,
                         "answers_equal_to_mlx_lm": sum(r[name]["parts_from_mlx_lm_at"] is None
                                                        for r in rows)}
    print(json.dumps(summary, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "summary": summary, "rows": rows,
                       "machine": hardware_info(), "versions": versions(),
                       "method": "each answer replayed through the target one token at a time "
                                 "(mlx-lm's decode, teacher-forced); deficit = the step's top "
                                 "logit minus the answer token's, at each mismatch"}, f, indent=1)


if __name__ == "__main__":
    main()
