"""Where a DFlash cycle's time goes on a host-bound device: host phases against the one wait.

    python scripts/cycle_profile.py --model MODEL --draft DRAFT [--heldout 11] [--out cp.json]
    python scripts/cycle_profile.py --model MODEL --draft DRAFT --contexts 1024,1500   # raw text

On the H200 a draft cycle of the 135M default pair costs ~3.2 plain-step times whatever its
window (session 19), while its two forwards, synced one by one, add up to ~2.5 (session 14's
host probe): so part of a cycle is neither forward. This runs the engine's own loop
(engine/generate.py, unchanged) with timers around each thing the loop does on the host: the
draft's graph (propose, add_context), the verify's (built and queued), the window and copy
lookup, the rewind, handing out text (push / drain), and the one host read of the cycle
(`summary.tolist()`, the only wait for the device). The sum of the host phases against the wait
says whether the device or the host sets the cycle's pace, and which phase to make cheaper.
mlx-lm's own decode loop on the same prompts gives the plain-step time the phases are counted in.
Each prompt is decoded once unmeasured first (warm-up), so cache lengths are revisited: these are
shares of a cycle, not first-time-length speeds. Prompts: the five chat questions and `--heldout`
held-out prompts through the chat template, or with `--contexts` raw text of those lengths (the
benchmark's built-in prose, as `dflash benchmark --contexts` builds them), where long caches and
the text's repeats (copy drafting) change what a cycle costs.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from dflash.engine import generate as gen
from dflash.engine import accel, lookup, rollback, window
from dflash.engine.bench.environment import hardware_info, versions
from dflash.engine.bench.setup import CHAT_QUESTIONS, text_prompt_ids
from dflash.engine.loading import load_pair
from dflash.engine.prompting import build_prompt
from dflash.engine.training.data import load_heldout

TIMES: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)
NESTED: dict[str, float] = defaultdict(float)  # overlaps the phases above: not summed with them
NESTED_CALLS: dict[str, int] = defaultdict(int)


def timed(name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)  # the loop inspects propose()'s parameters: the signature stays
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name] += time.perf_counter() - t0
            CALLS[name] += 1

    return wrapper


class _TimedSummary:
    """Stands in for a Verified's summary array: its tolist() is the cycle's wait."""

    def __init__(self, arr: mx.array):
        self.arr = arr

    def tolist(self) -> list[int]:
        t0 = time.perf_counter()
        out = self.arr.tolist()
        TIMES["wait (summary read)"] += time.perf_counter() - t0
        CALLS["wait (summary read)"] += 1
        return out


def install(drafter: Any) -> None:
    """Timers on the loop's host phases (module attributes the loop looks up at call time)."""
    verify = gen.verify

    def timed_verify(*args, **kwargs):
        t0 = time.perf_counter()
        cyc = verify(*args, **kwargs)
        plain = cyc.block_len == 1
        name = "verify build (plain step)" if plain else "verify build (draft cycle)"
        TIMES[name] += time.perf_counter() - t0
        CALLS[name] += 1
        cyc.summary = _TimedSummary(cyc.summary)
        return cyc

    gen.verify = timed_verify
    # launches: MLX-CUDA encodes and launches a graph's kernels inside async_eval, on this thread
    # (nested in the verify's build for its own calls; the pipelined draft's launch is not)
    launch = mx.async_eval

    def timed_launch(*args):
        t0 = time.perf_counter()
        try:
            return launch(*args)
        finally:
            NESTED["async_eval (launches)"] += time.perf_counter() - t0
            NESTED_CALLS["async_eval (launches)"] += 1

    gen.mx.async_eval = timed_launch
    rollback.rewind = timed("rewind", rollback.rewind)
    window.VerifyWindow.plan = timed("window plan", window.VerifyWindow.plan)
    window.VerifyWindow.observe = timed("window observe", window.VerifyWindow.observe)
    lookup.CopyProposer.propose = timed("copy lookup", lookup.CopyProposer.propose)
    lookup.CopyProposer.extend = timed("copy extend", lookup.CopyProposer.extend)
    gen._Output.push = timed("push (detokenize)", gen._Output.push)
    gen._Output.drain = timed("drain", gen._Output.drain)
    drafter.propose = timed("draft build (propose)", drafter.propose)
    drafter.add_context = timed("draft context (add_context)", drafter.add_context)
    drafter.trim = timed("draft trim", drafter.trim)


def baseline_step_s(pair: Any, ids: list[int], max_tokens: int) -> float:
    """mlx-lm's decode loop: seconds a token after the first."""
    from mlx_lm.generate import generate_step

    t1 = None
    n = 0
    for (tok, _), i in zip(generate_step(mx.array(ids), pair.target.model, max_tokens=max_tokens),
                           range(max_tokens)):
        n += 1
        if i == 0:
            t1 = time.perf_counter()
    return (time.perf_counter() - t1) / max(n - 1, 1)


def run(pair: Any, ids: list[int], max_tokens: int, verify_window: str) -> tuple[gen.GenerationStats, float]:
    """(stats, decode seconds): from the first token handed out (prefill and the first token
    are before any cycle) to the end."""
    stats = None
    t0 = time.perf_counter()
    for ev in gen.stream_dflash_generate(pair.target, pair.drafter, pair.tokenizer, ids, max_tokens,
                                         verify_window=verify_window):
        if isinstance(ev, gen.Finished):
            stats = ev.stats
    # from the first token by the engine's clock (its first delta can come a cycle later: a delta
    # waits for the text its ids complete)
    return stats, time.perf_counter() - t0 - stats.ttft_s


def _lengths(ap: argparse.ArgumentParser, text: str | None) -> list[int]:
    """--contexts as prompt lengths (none: the chat prompts); a bad list is a usage error."""
    if text is None:
        return []
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 2:
        ap.error(f"--contexts {text!r}: expected comma-separated prompt lengths of 2 tokens or more")
    return lengths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--heldout", type=int, default=11, help="held-out prompts after the 5 chat questions")
    ap.add_argument("--contexts", default=None,
                    help="comma-separated prompt lengths of raw text, instead of chat and held-out prompts")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--window", default="auto", help="verify window for the profiled runs (auto, full, N)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    accel.maybe_reexec()  # MKL on the CPU, as `dflash generate` runs (without it: the BLAS trap)

    lengths = _lengths(ap, a.contexts)
    pair = load_pair(a.model, a.draft, dtype=a.dtype)
    if lengths:
        prompts = [text_prompt_ids(pair.tokenizer, n) for n in lengths]
    else:
        held = [q for _, q in load_heldout()]  # a bad line is named with its file
        prompts = [build_prompt(pair.tokenizer, q) for q in CHAT_QUESTIONS + held[: a.heldout]]
    steps = []
    for ids in prompts:  # warm-up, then mlx-lm's step time on each prompt
        baseline_step_s(pair, ids, 16)
        run(pair, ids, 16, a.window)
        run(pair, ids, a.max_tokens, a.window)
        steps.append(baseline_step_s(pair, ids, a.max_tokens))
    step_s = statistics.median(steps)
    install(pair.drafter)
    per_prompt = []
    t_all = 0.0
    agg = defaultdict(int)
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for ids in prompts:
        TIMES.clear()
        CALLS.clear()  # the prefill's draft context is not a cycle's: count from the first token
        s, dt = run(pair, ids, a.max_tokens, a.window)
        t_all += dt
        for k, v in TIMES.items():
            totals[k] += v
            counts[k] += CALLS[k]
        for k in ("generated_tokens", "cycles", "plain_steps", "accepted_drafts", "copy_cycles", "run_ahead"):
            agg[k] += getattr(s, k)
        per_prompt.append({"prompt_tokens": len(ids), "tokens": s.generated_tokens, "cycles": s.cycles, "plain": s.plain_steps,
                           "decode_tps": round(s.decode_tps, 2), "tokens_per_cycle": round(s.tokens_per_cycle, 3)})
    cycles = max(agg["cycles"], 1)
    phases = {k: {"ms_total": round(v * 1e3, 2), "calls": counts[k],
                  "ms_per_cycle": round(v * 1e3 / cycles, 4),
                  "steps_per_cycle": round(v / cycles / step_s, 4)}
              for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}
    accounted = sum(totals.values())
    result = {
        "what": "host phases of engine/generate.py's loop, timed in place; the wait is the cycle's one host read",
        "measured": "each prompt decoded once before (warm-up): cache lengths revisited, not first-time lengths",
        "prompts": f"raw text of {lengths} tokens" if lengths else "chat questions and held-out prompts, chat template",
        "args": vars(a),
        "plain_step_ms_mlx_lm": round(step_s * 1e3, 3),
        "plain_step_ms_per_prompt": [round(x * 1e3, 3) for x in steps],
        "totals": dict(agg),
        "decode_s": round(t_all, 3),
        "ms_per_cycle": round(t_all * 1e3 / cycles, 3),
        "steps_per_cycle": round(t_all / cycles / step_s, 3),
        "tokens_per_s": round(agg["generated_tokens"] / t_all, 2),
        "speedup_vs_mlx_lm_est": round(agg["generated_tokens"] / t_all * step_s, 3),
        "unaccounted_ms_per_cycle": round((t_all - accounted) * 1e3 / cycles, 4),
        "phases": phases,
        "nested": {k: {"ms_per_cycle": round(v * 1e3 / cycles, 4), "calls": NESTED_CALLS[k]}
                   for k, v in NESTED.items()},
        "per_prompt": per_prompt,
        "machine": hardware_info(),
        "versions": versions(),
    }
    w = sys.stdout.write
    w(f"mlx-lm step {step_s * 1e3:.2f} ms | {cycles} cycles ({agg['plain_steps']} plain), "
      f"{t_all * 1e3 / cycles:.2f} ms a cycle = {t_all / cycles / step_s:.2f} steps, "
      f"{agg['generated_tokens'] / t_all:.1f} tok/s (~{agg['generated_tokens'] / t_all * step_s:.2f}x est.)\n")
    for k, v in phases.items():
        w(f"  {k:32s} {v['ms_per_cycle']:8.3f} ms/cycle  {v['steps_per_cycle']:6.3f} steps  ({v['calls']} calls)\n")
    w(f"  {'(not in a timed phase)':32s} {result['unaccounted_ms_per_cycle']:8.3f} ms/cycle\n")
    for k, v in result["nested"].items():
        w(f"  {'(nested) ' + k:32s} {v['ms_per_cycle']:8.3f} ms/cycle  ({v['calls']} calls)\n")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
