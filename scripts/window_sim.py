"""The verify-window policy replayed on real acceptance traces, on a synthetic clock.

    python scripts/window_sim.py trace --model models/SmolLM2-135M-Instruct --heldout 11 \
        --max-tokens 256 --out trace.json          # CPU, minutes: the draft at every position
    python scripts/window_sim.py sim --trace trace.json --slope 0 --d 2.2   # the H200's measured cycle
    python scripts/window_sim.py sim --trace trace.json --cpu --d 0.35 --short-max 2   # this CPU

Why: on a bf16 GPU every arm of an A/B parts from mlx-lm's text at some near-tie and goes on
decoding a different text (session 19: 25-26 of 32 answers per arm), and a text's predictability
moves speed more than any window rule, so a GPU A/B of rules compares texts as much as rules.
Here the text is fixed: `trace` decodes each prompt greedily with mlx-lm (fp32), then runs the
draft once at EVERY answer position (the anchor there, the target's features of everything
before it as context) and records a(t), how many of its 15 proposals match the text that
follows (with the draft's probability of each proposal, `confidence`, and the target's of each
answer token, `target_p`). Any cycle the engine could run at position t, window k, accepts
min(a(t), k-1) drafts.

`sim` drives engine/window.py's own VerifyWindow (the shipped code, not a model of it) over those
traces with a clock in decode steps: a plain step costs 1, a draft cycle of window k costs
v(k) + d (v linear, 1 + slope*(k-1), as a GPU; or --cpu for the CPU's table; slope 0: every
draft cycle 1 + d, as session 19 measured a 135M target's on the H200, ~3.2 steps), while the
policy starts from the engine's own priors (the GPU's or the CPU's; --prior C,D another linear
one) and measures d as the engine does, from the clock. It reports
tokens per step-time for each policy: auto (wide), auto (narrow: the per-token model's window),
the whole block every cycle, fixed windows, and the oracle that drafts exactly where a(t) pays.
Copy drafting is left out (the trace holds the model draft only). Lossless by construction: the
emitted text is the trace's.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path


def trace(model: str, draft: str | None, heldout: int, max_tokens: int, dtype: str) -> dict:
    """mlx-lm's greedy answers and a(t) at every answer position (see the module doc)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from arms_ab import questions

    from dflash.engine.loading import load_pair

    pair = load_pair(model, draft, dtype=dtype)
    pair.drafter.short_max = 0  # whole blocks: a window's first k-1 proposals are the block's
    prompts = [pair.tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                  add_generation_prompt=True)
               for q in questions(heldout)]
    return {"model": model, "draft": draft, "dtype": dtype, "max_tokens": max_tokens,
            "block_size": pair.drafter.block_size,
            "traces": trace_answers(pair, pair.drafter, prompts, max_tokens, log=print)}


def trace_answers(pair, drafter, prompts: list[list[int]], max_tokens: int,
                  log=lambda line: None) -> list[dict]:
    """Per prompt (ids): mlx-lm's greedy answer and `accepted`, a(t) for every answer position t
    but the last (the drafts at t that match the answer's tokens after t)."""
    import mlx.core as mx

    from dflash.engine.bench.timing import run_baseline

    out = []
    for qi, ids in enumerate(prompts):
        t0 = time.perf_counter()
        answer, _ = run_baseline(pair, ids, max_tokens)
        text = list(ids) + list(answer)
        logits, feats = pair.target.forward(mx.array(text)[None], pair.target.make_cache())
        # the target's probability of each answer token where it chose it (known at that step)
        probs = mx.softmax(logits[0, len(ids) - 1 : -1].astype(mx.float32), axis=-1)
        chosen = mx.take_along_axis(probs, mx.array(answer)[:, None], axis=-1)[:, 0]
        target_p = [round(x, 4) for x in chosen.tolist()]
        drafter.reset()
        P, acc = len(ids), []
        drafter.add_context(feats[:, :P])  # the anchor at P (the first answer token) sees the prompt
        conf = []  # the draft's probability of each proposal (drafters that give it)
        confident = "confidence" in inspect.signature(drafter.propose).parameters
        for a in range(P, len(text) - 1):
            if confident:
                ids_a, p_a = drafter.propose(mx.array(text[a]), a, confidence=True)
                prop = ids_a.tolist()
                conf.append([round(x, 4) for x in p_a.tolist()])
            else:
                prop = drafter.propose(mx.array(text[a]), a).tolist()
            follow = text[a + 1 : a + 1 + len(prop)]
            n = 0
            while n < len(follow) and prop[n] == follow[n]:
                n += 1
            acc.append(n)
            drafter.add_context(feats[:, a : a + 1])
        out.append({"question": qi, "prompt_tokens": P, "answer": answer, "accepted": acc,
                    "target_p": target_p,
                    **({"confidence": conf} if conf else {})})
        log(f"question {qi}: {len(answer)} tokens, mean a(t) {statistics.mean(acc or [0]):.2f}, "
            f"{time.perf_counter() - t0:.0f} s")
    return out


def simulate(acc: list[int], policy: str | int, wide: bool = True, slope: float | None = 0.055,
             d: float = 0.6, cpu: bool = False, confidence: list[list[float]] | None = None,
             short_max: int = 0, prior: str | None = None, max_probe_gap: int | None = None,
             full_decay: float | None = None) -> dict:
    """One answer under one VerifyWindow policy ("auto", "full" or k): the cycles after the first
    answer token (the prefill's), each at anchor position pos taking min(a(pos), k-1) drafts.
    `confidence` (the trace's): where the policy drafts the whole block to let the draft's
    confidence choose the window (window.py), it does; `short_max`: windows up to it draft a
    block cut to k rows, at half the draft's cost (SHORT_D_PRIOR). `prior` ("c,d"): the
    window's verify-cost prior (default: the engine's own for the GPU, or the CPU's table);
    `max_probe_gap`: the longest gap between probes while "auto" decodes plainly, `full_decay`:
    the decay of the wide rule's mean of tokens per whole-block cycle (defaults: the engine's)."""
    from dflash.engine.window import DEFAULT_COSTS, SHORT_D_PRIOR, VerifyWindow

    saved = {k: os.environ.get(k) for k in ("DFLASH_WINDOW_WIDE", "DFLASH_VERIFY_COST",
                                             "DFLASH_WINDOW_CONFIDENCE")}
    os.environ["DFLASH_WINDOW_WIDE"] = "1" if wide else "0"
    os.environ["DFLASH_WINDOW_CONFIDENCE"] = "1" if confidence else "0"
    if prior:
        os.environ["DFLASH_VERIFY_COST"] = prior
    elif cpu:  # this machine is a CPU: the engine's CPU table is the default prior
        os.environ.pop("DFLASH_VERIFY_COST", None)
    else:
        os.environ["DFLASH_VERIFY_COST"] = ",".join(str(x) for x in DEFAULT_COSTS["gpu"])
    try:
        rule = {k: v for k, v in (("max_probe_gap", max_probe_gap), ("full_decay", full_decay))
                if v is not None}
        w = VerifyWindow(16, policy, short_max=short_max, **rule)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    cost = _costs(slope, d, cpu)
    pos, clock, cycles, plain, chosen, m = 0, 0.0, 0, 0, 0, len(acc)
    while pos < m:
        k = w.next()
        whole = bool(confidence) and w.reads_draft(k)
        if whole:
            k = w.after_draft(confidence[pos])
            chosen += 1
        taken = min(acc[pos], k - 1, m - pos - 1) if k > 1 else 0
        seconds = cost[k] - (d * (1 - SHORT_D_PRIOR) if 1 < k <= short_max and not whole else 0.0)
        plain += k == 1
        w.observe(k, taken, seconds, whole_block=whole)
        pos += taken + 1
        clock += seconds
        cycles += 1
    return {"tokens": m, "time": clock, "cycles": cycles, "plain": plain, "confidence_windows": chosen}


def oracle(acc: list[int], slope: float | None = 0.055, d: float = 0.6, cpu: bool = False) -> dict:
    """Each cycle the window with the most tokens per step-time knowing a(t): a ceiling."""
    cost = _costs(slope, d, cpu)
    pos, clock, cycles, m = 0, 0.0, 0, len(acc)
    while pos < m:
        a = min(acc[pos], m - pos - 1)
        k = max(range(1, 17), key=lambda j: ((min(a, j - 1) + 1) / cost[j], -j))
        pos += (min(a, k - 1) if k > 1 else 0) + 1
        clock += cost[k]
        cycles += 1
    return {"tokens": m, "time": clock, "cycles": cycles, "plain": None}


def _costs(slope: float | None, d: float, cpu: bool) -> list[float]:
    """The clock: cost[k] of a cycle of window k in decode steps (cost[1] = a plain step = 1);
    slope 0 with d = C: every draft cycle costs 1 + C whatever its window (a small target on a
    GPU, where a cycle's cost is its launches and syncs: session 19 measured ~3.2 steps)."""
    from dflash.engine.window import CPU_VERIFY_COST, verify_costs

    v = verify_costs(CPU_VERIFY_COST if cpu else slope, 16)
    return [1.0, 1.0] + [v[k] + d for k in range(2, 17)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trace")
    t.add_argument("--model", required=True)
    t.add_argument("--draft", default=None)
    t.add_argument("--heldout", type=int, default=11)
    t.add_argument("--max-tokens", type=int, default=256)
    t.add_argument("--dtype", default="float32")
    t.add_argument("--out", required=True)
    s = sub.add_parser("sim")
    s.add_argument("--trace", required=True)
    s.add_argument("--slope", type=float, default=0.055, help="GPU: v(k) = 1 + slope*(k-1) steps")
    s.add_argument("--d", type=float, default=0.6, help="a draft cycle's cost beyond its verify, steps")
    s.add_argument("--cpu", action="store_true", help="the CPU's verify-cost table instead")
    s.add_argument("--short-max", type=int, default=0, help="windows up to this draft a cut block")
    s.add_argument("--prior", default=None, help="the window's verify-cost prior C,D (default: the engine's)")
    s.add_argument("--max-probe-gap", type=int, default=None,
                   help="auto: the longest gap between probes of plain decoding (default: the engine's)")
    s.add_argument("--full-decay", type=float, default=None,
                   help="auto, wide: the decay of the mean tokens per whole-block cycle (default: the engine's)")
    s.add_argument("--zeros", type=int, default=0,
                   help="also replay an answer of this many tokens where no draft is ever accepted "
                        "(acceptance 0: what auto costs against plain decoding)")
    s.add_argument("--policies", default="auto-wide,auto-narrow,auto-conf,full,8,4,oracle",
                   help="auto-wide, auto-narrow (the model's window), auto-conf (the model's window, "
                        "re-chosen by the draft's confidence), full, a window k, oracle")
    a = ap.parse_args()
    if a.cmd == "trace":
        from dflash.engine import accel

        accel.maybe_reexec()  # MKL on the CPU, as dflash's commands run (without it: the BLAS trap)
        res = trace(a.model, a.draft, a.heldout, a.max_tokens, a.dtype)
        Path(a.out).write_text(json.dumps(res))
        return
    traces = json.loads(Path(a.trace).read_text())["traces"]
    if a.zeros:
        traces.append({"question": "0s", "accepted": [0] * a.zeros})
    print(f"{'policy':>12} " + " ".join(f"q{t['question']:<4}" for t in traces) + "  geomean  plain")
    for pol in a.policies.split(","):
        speeds, plains = [], 0
        for t in traces:
            if pol == "oracle":
                r = oracle(t["accepted"], a.slope, a.d, a.cpu)
            else:
                name = "auto" if pol.startswith("auto") else pol if pol == "full" else int(pol)
                r = simulate(t["accepted"], name, pol == "auto-wide", a.slope, a.d, a.cpu,
                             t.get("confidence") if pol == "auto-conf" else None, a.short_max,
                             a.prior, a.max_probe_gap, a.full_decay)
            speeds.append(r["tokens"] / r["time"])  # tokens per plain-step time: the speedup
            plains += r["plain"] or 0
        gm = statistics.geometric_mean(speeds)
        print(f"{pol:>12} " + " ".join(f"{x:5.2f}" for x in speeds) + f"  {gm:6.3f}  {plains}")


if __name__ == "__main__":
    main()
