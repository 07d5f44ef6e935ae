"""Whole draft blocks against blocks cut to short windows, interleaved in one process.

    python scripts/cut_block_ab.py --model models/SmolLM2-135M-Instruct [--cut 2] \
        [--heldout 7] [--rounds 3] [--max-tokens 128] [--out RESULT.json]

Each chat question (the benchmark's five, then `--heldout` of the 48 held-out prompts, drawn
with a fixed seed) is answered greedily by every arm in a shuffled order, round after round:
"whole" (every draft pass runs the whole block), "cut" (windows up to --cut tokens draft from a
block cut to the window, engine/drafters.py `short_max`). Both arms use the "auto" window, so
the cut's cheaper pass also changes how often and how wide the policy drafts; the ids must be
equal (lossless), only the time differs. In one process the VM's drift hits both arms alike,
which `dflash benchmark` runs in separate processes cannot promise: a 4% effect needs this.
Prints the paired ratio (geometric mean over generations, with a 95% interval) and writes
every generation's decode tok/s, acceptance and tokens per cycle with --out.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from pathlib import Path

ARMS = ("whole", "cut")


def questions(heldout: int, seed: int = 0) -> list[str]:
    from dflash.engine.benchsetup import CHAT_QUESTIONS
    from dflash.engine.training.data import load_heldout

    held = [q for _, q in load_heldout()]
    random.Random(seed).shuffle(held)
    return list(CHAT_QUESTIONS) + held[:heldout]


def run(pair, prompts: list[list[int]], cut: int, rounds: int, max_tokens: int) -> dict[str, list[dict]]:
    """Every prompt (token ids) by both arms each round (order shuffled per prompt); ids checked equal."""
    from dflash.engine.generate import Finished, stream_dflash_generate

    res: dict[str, list[dict]] = {a: [] for a in ARMS}
    saved = pair.drafter.short_max
    try:
        for r in range(rounds):
            for i, ids in enumerate(prompts):
                order = list(ARMS)
                random.Random(r * 1000 + i).shuffle(order)
                got = {}
                for arm in order:
                    pair.drafter.short_max = cut if arm == "cut" else 0
                    *_, fin = stream_dflash_generate(pair.target, pair.drafter, pair.tokenizer, ids,
                                                     max_tokens)
                    assert isinstance(fin, Finished)
                    got[arm] = fin.token_ids
                    s = fin.stats
                    res[arm].append({"question": i, "round": r, "tokens": s.generated_tokens,
                                     "decode_tps": s.decode_tps, "acceptance": s.acceptance,
                                     "tokens_per_cycle": s.tokens_per_cycle})
                if got["whole"] != got["cut"]:
                    raise AssertionError(f"question {i}: the cut block changed the output")
    finally:
        pair.drafter.short_max = saved
    return res


def paired(res: dict[str, list[dict]]) -> dict[str, float]:
    """Geometric mean of cut/whole decode tok/s over the paired generations, 95% interval."""
    logs = [math.log(c["decode_tps"] / w["decode_tps"]) for c, w in zip(res["cut"], res["whole"])]
    m = statistics.mean(logs)
    se = statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else float("nan")
    return {"n": len(logs), "ratio": math.exp(m), "low": math.exp(m - 1.96 * se),
            "high": math.exp(m + 1.96 * se)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", default=None, help="default: the registry's draft for the model")
    ap.add_argument("--cut", type=int, default=2, help="windows up to this many tokens are cut")
    ap.add_argument("--heldout", type=int, default=7, help="held-out prompts after the 5 questions")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from dflash.engine.loading import load_pair

    pair = load_pair(a.model, a.draft, dtype=a.dtype)
    prompts = [pair.tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                  add_generation_prompt=True)
               for q in questions(a.heldout)]
    res = run(pair, prompts, a.cut, a.rounds, a.max_tokens)
    p = paired(res)
    print(f"cut (<= {a.cut}) against whole blocks: {p['ratio']:.3f}x decode tok/s "
          f"(95% interval {p['low']:.3f}-{p['high']:.3f}, {p['n']} paired generations, same ids)")
    if a.out:
        Path(a.out).write_text(json.dumps({"model": a.model, "draft": a.draft, "cut": a.cut,
                                           "rounds": a.rounds, "max_tokens": a.max_tokens,
                                           "dtype": a.dtype, "paired": p, "runs": res}, indent=1))


if __name__ == "__main__":
    main()
