"""`dflash benchmark`: DFlash against mlx-lm's own decoding, side by side, in one process.

Why one process and this protocol: speed numbers from different processes, prompts or warm-up
states are not comparable. For every context length both engines get prompts of (about) that
length, the same max_tokens and the same sampling (greedy by default); warm-up runs come first (a
fresh process pays kernel compilation on its first calls), then timed runs alternate
baseline/DFlash with a cooldown sleep between them, and the summary takes medians (every run is
in the JSON too).

First-time lengths (default): every timed run decodes at (tokens, cache length) shapes this
process never ran before (benchplan.py): per-shape caches, such as MLX-CUDA's cuDNN attention
graphs, cannot flatter a run that re-decodes a visited length. Each run gets its own prompt
length, chosen near the nominal context; a ledger of every target forward checks it, run by run.
Losslessness is measured against a baseline run on the same prompt (untimed, after the timed ones).

`--oracle` swaps the draft for `OracleDrafter` replaying a baseline run's ids (every draft accepted):
the engine's ceiling, labelled as such everywhere. `--random-target SHAPE` builds a random-weight
target of a named shape in memory, for speed-only numbers on machines without weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import click
import mlx.core as mx

from . import accel, rollback
from . import tape as tape_mod
from .benchplan import (
    Planner,
    ShapeLedger,
    baseline_shapes,
    dflash_shapes,
    forward_timing_shapes,
    oracle_shapes,
)
from .benchsetup import (
    DEFAULT_OUT,
    DTYPES,
    RANDOM_SHAPES,
    BenchConfig,
    Setup,
    build_setup,
    chat_prompts,
    make_drafter,
    prompt_ids,
    prompt_text,
)
from .drafters import DFlashDrafter, Drafter, short_block_max
from .generate import Finished, stream_dflash_generate
from .sampling import SamplingParams
from .target import TargetModel
from .window import wide_windows

Log = Callable[[str], None]
FORWARD_WARMUP = 3  # untimed step/verify pairs before the timed ones in time_forward


# --- one run of each engine ---------------------------------------------------------------------
def _ids_hash(ids: Sequence[int]) -> str:
    return hashlib.sha1(json.dumps(list(ids)).encode()).hexdigest()[:16]


def _timing(n_prompt: int, ids: list[int], t0: float, t_first: float, t_end: float) -> dict:
    """The same clock and formulas for both engines."""
    n = len(ids)
    ttft = t_first - t0
    return {
        "prompt_tokens": n_prompt,
        "generated_tokens": n,
        "ttft_s": ttft,
        "prefill_tps": n_prompt / max(ttft, 1e-9),
        "decode_tps": (n - 1) / max(t_end - t_first, 1e-9) if n > 1 else 0.0,
        "e2e_tps": n / max(t_end - t0, 1e-9),
        "total_s": t_end - t0,
    }


Sampling = SamplingParams  # one run's sampling: greedy (temperature 0) or mlx-lm's make_sampler's
GREEDY = Sampling()


def run_baseline(
    setup: Setup, ids: list[int], max_tokens: int, sampling: Sampling = GREEDY
) -> tuple[list[int], dict]:
    """mlx-lm's stream_generate on the same model: greedy (its default sampler is argmax), or
    `make_sampler(temperature, top_p=..., top_k=...)` with MLX's global seed set to `seed`."""
    from mlx_lm.generate import stream_generate

    sampler = None
    if not sampling.greedy:
        from mlx_lm.sample_utils import make_sampler

        sampler = make_sampler(sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
        mx.random.seed(sampling.seed or 0)
    eos = setup.tokenizer.eos_token_ids
    mx.synchronize()
    mx.reset_peak_memory()
    out: list[int] = []
    reason = ""
    stop_token = None
    self_tps = 0.0
    t_first: float | None = None
    t0 = time.perf_counter()
    for r in stream_generate(setup.target.model, setup.tokenizer, mx.array(ids), max_tokens,
                             sampler=sampler):
        if t_first is None:
            t_first = time.perf_counter()
        reason = r.finish_reason or reason
        self_tps = r.generation_tps
        if not (r.finish_reason == "stop" and r.token in eos):
            out.append(int(r.token))
        else:
            stop_token = int(r.token)
    t_end = time.perf_counter()
    mx.synchronize()  # its pipelined loop may hold one discarded step in flight
    rec = _timing(len(ids), out, t0, t_first or t_end, t_end)
    rec.update(peak_memory_gb=mx.get_peak_memory() / 1e9, finish_reason=reason,
               stop_token=stop_token,  # the end-of-sequence id it stopped on (not in `out`)
               self_reported_decode_tps=self_tps)  # mlx-lm's own generation_tps
    return out, rec


def _window(cfg: BenchConfig) -> str:
    """The oracle measures the ceiling: always the whole block."""
    return "full" if cfg.oracle else cfg.verify_window


def _copy_draft(cfg: BenchConfig) -> bool:
    """The oracle measures the model draft's ceiling: no copies beside it."""
    return cfg.copy_draft and not cfg.oracle


def run_dflash(
    setup: Setup, drafter: Drafter, ids: list[int], max_tokens: int, window: str = "auto",
    sampling: Sampling = GREEDY, copy_draft: bool = True, teacher: list[int] | None = None,
) -> tuple[list[int], dict]:
    """stream_dflash_generate on the same prompt ids, timed with the baseline's clock
    (`teacher`: a reference decoding's ids to decode, see stream_dflash_generate)."""
    mx.synchronize()
    final: Finished | None = None
    t0 = time.perf_counter()
    gen = stream_dflash_generate(
        setup.target, drafter, setup.tokenizer, ids, max_tokens, verify_window=window,
        temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
        seed=sampling.seed, copy_draft=copy_draft, teacher=teacher,
    )
    for ev in gen:
        if isinstance(ev, Finished):
            final = ev
    t_end = time.perf_counter()
    mx.synchronize()
    assert final is not None
    s = final.stats
    # the first token's moment from the engine's own clock, not the first delta's: a delta waits
    # for the text its ids complete (a lone space, a character's first bytes), so the first one
    # can come a cycle late, which would drop that cycle from the decode time. The engine's clock
    # starts after t0, so this moment is a little early: the decode time a little long, if anything
    t_first = t0 + s.ttft_s if s.generated_tokens else None
    rec = _timing(len(ids), final.token_ids, t0, t_first or t_end, t_end)
    rec.update(
        peak_memory_gb=s.peak_memory_gb,
        finish_reason=s.finish_reason,
        self_reported_decode_tps=s.decode_tps,  # the engine's own clock
        acceptance=s.acceptance,
        tokens_per_cycle=s.tokens_per_cycle,
        cycles=s.cycles,
        accepted_drafts=s.accepted_drafts,
        accept_histogram=list(s.accept_histogram),
        copy_cycles=s.copy_cycles,
        confidence_windows=s.confidence_windows,
        run_ahead=s.run_ahead,
        engine_stats=s.to_dict(),
    )
    return list(final.token_ids), rec


def compare_ids(got: list[int], want: list[int]) -> dict:
    """Losslessness of one DFlash run against the baseline's ids for the same prompt."""
    mismatch = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if mismatch is None and len(got) != len(want):
        mismatch = min(len(got), len(want))
    return {"lossless": mismatch is None, "first_mismatch": mismatch}


# --- t(verify) / t(decode step) / t(draft) ------------------------------------------------------
def time_forward(
    target: TargetModel, ids: list[int], block: int, iters: int = 10,
    warmup: int = FORWARD_WARMUP, chunk: int = 512, draft: Any | None = None,
    draft_vocab: list[int] | None = None,
) -> dict:
    """Median times of a target forward over M=block tokens, over M=1, and of the draft pass.

    This is the cost model of speculative decoding: a cycle pays one draft pass and one M=block
    forward instead of tokens_per_cycle M=1 steps. Every timed forward runs at a cache length it
    never ran at: iteration i steps one token at n+i (kept), drafts a block after it, verifies
    M=block at n+i+1 and rewinds that verify; the next step is at n+i+1. Each is synced (mx.eval)
    on its own, interleaved so drift hits all alike. `draft` (a DFlashDraft, optional): its whole
    block + the LM head on block-1 rows, as a cycle runs it, fed the features computed here
    (over `draft_vocab` only when given, as the drafter of the runs scores it).
    """
    caches = target.make_cache()
    drafter = DFlashDrafter(draft, target, draft_vocab) if draft is not None else None
    for s in range(0, len(ids), chunk):
        logits, feats = target.forward(mx.array(ids[s : s + chunk], dtype=mx.int32)[None], caches,
                                       last_only=True)
        if drafter is not None:
            drafter.add_context(feats)
            mx.eval([c.state for c in drafter.cache])
        mx.eval(logits, [c.state for c in caches])
    record = rollback.needs_tape(caches)
    keep = 1 if record else 0  # a recurrent state is replayed over >= 1 step
    vocab = target.vocab_size
    pos = len(ids)

    def forward(m: int) -> float:
        nonlocal pos
        toks = mx.array([(7 * (pos + j) + 11) % vocab for j in range(m)], dtype=mx.int32)[None]
        tp = tape_mod.Tape() if record and m > 1 else None
        t0 = time.perf_counter()
        with tape_mod.recording(tp):
            logits, feats = target.forward(toks, caches)
        mx.eval(mx.argmax(logits[0], axis=-1), feats)
        dt = time.perf_counter() - t0
        kept = m if m == 1 else keep
        if m > 1:
            rollback.rewind(caches, target.layers, keep, m, tp)
        if drafter is not None and kept:
            drafter.add_context(feats[:, :kept])
        pos += kept
        return dt

    def draft_pass() -> float:
        if drafter is None:
            return 0.0
        anchor = mx.array((7 * pos + 11) % vocab, dtype=mx.int32)
        mx.eval([c.state for c in drafter.cache])
        t0 = time.perf_counter()
        out = drafter.propose(anchor, pos)
        mx.eval(out[0] if isinstance(out, tuple) else out)
        return time.perf_counter() - t0

    step, ver, drf = [], [], []
    for i in range(warmup + iters):
        t1 = forward(1)
        td = draft_pass()
        tb = forward(block)
        if i >= warmup:
            step.append(t1)
            drf.append(td)
            ver.append(tb)
    t1, tb = statistics.median(step), statistics.median(ver)
    out = {"block_size": block, "step_ms": t1 * 1e3, "verify_ms": tb * 1e3, "ratio": tb / t1,
           "iters": iters, "context": len(ids)}
    out["draft_ms"] = statistics.median(drf) * 1e3 if drafter is not None else None
    return out


# --- the benchmark ------------------------------------------------------------------------------
def _median(runs: list[dict], key: str) -> float:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else float("nan")


def _spread(runs: list[dict], key: str) -> list[float] | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return [min(vals), statistics.median(vals), max(vals)] if vals else None


def summarize(ctx: int, base: list[dict], dfl: list[dict], fwd: dict | None,
              temperature: float = 0.0) -> dict:
    """Medians over the timed repeats of one context length (and temperature)."""
    b_tps, d_tps = _median(base, "decode_tps"), _median(dfl, "decode_tps")
    hist: list[int] = []
    for r in dfl:
        h = r["accept_histogram"]
        hist = [a + b for a, b in zip(hist, h)] if hist else list(h)
    speedup = d_tps / b_tps if b_tps > 0 else float("nan")
    # each repeat's dflash run over the baseline run beside it: a machine that drifts between
    # repeats (the H200 host moved mlx-lm's 1K baseline 110-166 tok/s in one process) moves both
    pairs = [d["decode_tps"] / b["decode_tps"] for b, d in zip(base, dfl)
             if b.get("decode_tps") and d.get("decode_tps") is not None]
    tau = _median(dfl, "tokens_per_cycle")
    lossless = [r["lossless"] for r in dfl]
    row = {
        "context": ctx,
        "temperature": temperature,
        "baseline_decode_tps": b_tps,
        "dflash_decode_tps": d_tps,
        "speedup": speedup,
        "speedup_paired": statistics.median(pairs) if pairs else float("nan"),
        "baseline_e2e_tps": _median(base, "e2e_tps"),
        "dflash_e2e_tps": _median(dfl, "e2e_tps"),
        "acceptance": _median(dfl, "acceptance"),
        "tokens_per_cycle": tau,
        "accept_histogram": hist,
        "baseline_ttft_s": _median(base, "ttft_s"),
        "dflash_ttft_s": _median(dfl, "ttft_s"),
        "baseline_prefill_tps": _median(base, "prefill_tps"),
        "dflash_prefill_tps": _median(dfl, "prefill_tps"),
        "generated_tokens": int(_median(dfl, "generated_tokens")),
        "prompt_tokens": {"baseline": _spread(base, "prompt_tokens"),
                          "dflash": _spread(dfl, "prompt_tokens")},
        "first_time": all(r.get("first_time") for r in base + dfl),
        "lossless": None if any(v is None for v in lossless) else all(lossless),
        "forward": fwd,
        "baseline_runs_tps": [r["decode_tps"] for r in base],
        "dflash_runs_tps": [r["decode_tps"] for r in dfl],
    }
    if fwd:
        # what a cycle of tau tokens would give if it cost exactly one draft pass + one verify
        cost = fwd["verify_ms"] + (fwd.get("draft_ms") or 0.0)
        row["ideal_speedup"] = tau * fwd["step_ms"] / cost if cost > 0 else float("nan")
        row["fraction_of_ideal"] = speedup / row["ideal_speedup"] if row["ideal_speedup"] else None
    return row


class Bench:
    """One benchmark process: the setup, the shape ledger and planner, the run counter."""

    def __init__(self, setup: Setup, cfg: BenchConfig, log: Log, text: str | None):
        self.setup, self.cfg, self.log, self.text = setup, cfg, log, text
        self.ledger = ShapeLedger(setup.target)
        self.planner = Planner(self.ledger)
        self.counter = 0
        self._forward: dict[tuple, dict | None] = {}  # forward costs do not depend on the temperature
        self.timed: list[dict] = []  # the context in progress's timed runs: kept on Ctrl-C

    def timed_run(self, ctx: int, r: int, eng: str, rec: dict) -> None:
        """A timed run is done: shown, and kept should the benchmark be interrupted."""
        self.timed.append(rec)
        _progress(self, ctx, r, eng, rec)

    def sampling(self, temperature: float) -> Sampling:
        """Greedy, or the run's own seed: reproducible, different for every run."""
        self.counter += 1
        if temperature == 0:
            return GREEDY
        return Sampling(temperature, self.cfg.top_p, self.cfg.top_k,
                        (self.cfg.seed * 1_000_003 + self.counter) % 2**63)

    def prompt(self, length: int) -> list[int]:
        return prompt_ids(self.setup, length, self.text, self.cfg.seed)

    def baseline(self, ids: list[int], temp: float, max_tokens: int | None = None):
        smp = self.sampling(temp)
        self.ledger.begin()
        out, rec = run_baseline(self.setup, ids, max_tokens or self.cfg.max_tokens, smp)
        rec["shapes"] = self.ledger.end(len(ids))
        rec["first_time"] = rec["shapes"]["first_time"]
        if not smp.greedy:
            rec["seed"] = smp.seed
        return out, rec

    def dflash(self, ids: list[int], temp: float, reference: list[int] | None = None):
        smp = self.sampling(temp)
        drafter = make_drafter(self.setup, self.cfg, reference or [], len(ids))
        self.ledger.begin()
        out, rec = run_dflash(self.setup, drafter, ids, self.cfg.max_tokens, _window(self.cfg), smp,
                              _copy_draft(self.cfg))
        rec["shapes"] = self.ledger.end(len(ids))
        rec["first_time"] = rec["shapes"]["first_time"]
        if not smp.greedy:
            rec["seed"] = smp.seed
        return out, rec

    def forward_cost(self, center: int, ids: list[int] | None = None) -> dict | None:
        """t(verify), t(step), t(draft) near `center` (or on `ids`): measured once per context,
        shared by every temperature's rows."""
        key = (center, None if ids is None else tuple(ids))
        if key not in self._forward:
            self._forward[key] = self._measure_forward(center, ids)
        return self._forward[key]

    def _measure_forward(self, center: int, ids: list[int] | None) -> dict | None:
        cfg, setup = self.cfg, self.setup
        if cfg.verify_iters <= 0:
            return None
        count = FORWARD_WARMUP + cfg.verify_iters
        if ids is None:  # a prompt length where every timed forward is at a new shape
            keep = 1 if rollback.needs_tape(setup.target.make_cache()) else 0
            n = self.planner.nearest(
                center, lambda n: forward_timing_shapes(n, setup.block_size, count, keep))
            ids = self.prompt(n)
        self.ledger.begin()
        fwd = time_forward(setup.target, ids, setup.block_size, cfg.verify_iters,
                           draft=setup.draft_model, draft_vocab=setup.draft_vocab)
        fwd["first_time"] = self.ledger.end(len(ids))["first_time"]
        draft = f", draft {fwd['draft_ms']:.2f} ms" if fwd["draft_ms"] is not None else ""
        self.log(f"   ctx {center} forward at {len(ids)}: M={setup.block_size} "
                 f"{fwd['verify_ms']:.2f} ms vs M=1 {fwd['step_ms']:.2f} ms -> t(verify)/t(step) = "
                 f"{fwd['ratio']:.2f}{draft}")
        return fwd


def _progress(bench: Bench, ctx: int, r: int, eng: str, rec: dict) -> None:
    cfg = bench.cfg
    tag = "ORACLE" if cfg.oracle else "dflash"
    extra = ""
    if eng == "dflash":
        extra = (f" | accept {rec['acceptance']:.1%}, {rec['tokens_per_cycle']:.2f} tok/cycle, "
                 f"{rec.get('copy_cycles', 0)} copy cycles")
    fresh = "" if rec.get("first_time") else " | REVISITED shapes"
    bench.log(f"   ctx {ctx} repeat {r + 1}/{cfg.repeats} {tag if eng == 'dflash' else eng:>8} "
              f"(prompt {rec['prompt_tokens']}): {rec['decode_tps']:8.1f} tok/s | TTFT "
              f"{rec['ttft_s'] * 1e3:7.0f} ms{extra}{fresh}")


def _label(rec: dict, ctx: int, r: int, eng: str, cfg: BenchConfig, ids: list[int],
           temp: float) -> dict:
    rec.update(context=ctx, repeat=r, engine=eng, temperature=temp,
               mode=cfg.mode if eng == "dflash" else "baseline", token_ids_sha1=_ids_hash(ids))
    return rec


def run_context_fresh(bench: Bench, ctx: int, temp: float) -> tuple[list[dict], dict]:
    """One context at first-time lengths: every timed run decodes at shapes never run before."""
    setup, cfg, planner, log = bench.setup, bench.cfg, bench.planner, bench.log
    T, B = cfg.max_tokens, setup.block_size
    greedy = temp == 0
    log(f"-- context {ctx}" + (f", temperature {temp:g}" if not greedy else "")
        + f": warm-up x{cfg.warmup} (first-time lengths)")
    ref_prompt: list[int] = []
    ref_ids: list[int] = []
    spare = cfg.warmup + cfg.repeats + 2  # oracle prompts: the reference's prompt + j of its ids

    def new_reference() -> None:
        nonlocal ref_prompt, ref_ids
        n = planner.nearest(ctx, lambda n: baseline_shapes(n, T + spare))
        ref_prompt = bench.prompt(n)
        ref_ids, _ = bench.baseline(ref_prompt, 0.0, T + spare)

    def oracle_prompt() -> tuple[list[int], list[int]]:
        """A prompt = reference prompt + its first j ids, j such that the verifies are new."""
        for _ in range(2):
            if ref_ids:
                L0 = len(ref_prompt)
                usable = range(L0, L0 + min(spare, len(ref_ids)) + 1)
                n = planner.nearest(L0, lambda n: oracle_shapes(n, T, B), candidates=usable)
                if n is not None:
                    j = n - L0
                    return ref_prompt + ref_ids[:j], ref_ids[j:]
            new_reference()
        raise RuntimeError("no first-time oracle prompt found")

    def plain_prompt(predict) -> list[int]:
        return bench.prompt(planner.nearest(ctx, predict))

    base_pred = lambda n: baseline_shapes(n, T)  # noqa: E731
    dfl_pred = lambda n: dflash_shapes(n, T, B)  # noqa: E731
    if cfg.oracle:
        new_reference()  # the reference run is the baseline's first warm-up
    for w in range(cfg.warmup):
        if not (cfg.oracle and w == 0):
            bench.baseline(plain_prompt(base_pred), temp)
        if cfg.oracle:
            ids, ref = oracle_prompt()
            bench.dflash(ids, 0.0, ref)
        else:
            bench.dflash(plain_prompt(dfl_pred), temp)
        time.sleep(cfg.cooldown)

    base_runs: list[dict] = []
    dfl_runs: list[dict] = []
    pending: list[tuple[dict, list[int], list[int]]] = []  # (record, prompt, ids): check later
    for r in range(cfg.repeats):
        order = ("baseline", "dflash") if r % 2 == 0 else ("dflash", "baseline")
        for eng in order:
            if eng == "baseline":
                ids = plain_prompt(base_pred)
                out, rec = bench.baseline(ids, temp)
                base_runs.append(_label(rec, ctx, r, eng, cfg, out, temp))
            elif cfg.oracle:
                ids, ref = oracle_prompt()
                out, rec = bench.dflash(ids, 0.0, ref)
                rec.update(compare_ids(out, ref[: len(out)] if len(ref) >= len(out) else ref))
                dfl_runs.append(_label(rec, ctx, r, eng, cfg, out, temp))
            else:
                ids = plain_prompt(dfl_pred)
                out, rec = bench.dflash(ids, temp)
                dfl_runs.append(_label(rec, ctx, r, eng, cfg, out, temp))
                if greedy:
                    pending.append((rec, ids, out))
                else:
                    rec.update(lossless=None, first_mismatch=None)
            bench.timed_run(ctx, r, eng, rec)
            time.sleep(cfg.cooldown)
    for rec, ids, out in pending:  # the baseline's ids for each DFlash prompt (untimed, after)
        want, _ = bench.baseline(ids, 0.0)
        rec.update(compare_ids(out, want))
    for rec in dfl_runs:
        if rec["lossless"] is False:
            log(f"   !! ctx {ctx} repeat {rec['repeat'] + 1}: DFlash ids differ from the baseline's "
                f"at token {rec['first_mismatch']}")
    fwd = bench.forward_cost(ctx)
    row = summarize(ctx, base_runs, dfl_runs, fwd, temp)
    if cfg.oracle:
        row["oracle_reference"] = {
            "source": "an untimed baseline run; each DFlash prompt is its prompt + its first j ids",
            "reference_prompt_tokens": len(ref_prompt),
            "matches_baseline": True,
            # every cycle but the last (cut by max_tokens) took all its B-1 drafts
            "every_draft_accepted": all(r["accept_histogram"][B - 1] >= r["cycles"] - 1
                                        for r in dfl_runs),
        }
    return _in_order(base_runs + dfl_runs), row


def _in_order(runs: list[dict]) -> list[dict]:
    return sorted(runs, key=lambda r: (r["repeat"], r["engine"] != "baseline"))


def settle_oracle(
    bench: Bench, ids: list[int], baseline_ids: list[int], max_iters: int = 8
) -> tuple[list[int], dict]:
    """Same-prompt method: the ids the oracle replays, the baseline's or DFlash's own.

    In low precision a block-of-B verify can round a near-tie differently from a 1-token decode
    step; replaying DFlash's own output until it reproduces itself keeps every draft accepted
    (it re-runs one prompt: only for --no-first-time-lengths). Losslessness is still judged
    against the baseline, run by run.
    """
    ref = list(baseline_ids)
    for i in range(max_iters + 1):
        out, _ = bench.dflash(ids, 0.0, ref)
        if out == ref:
            break
        ref = out
    info = {"iterations": i, "converged": out == ref, "matches_baseline": ref == baseline_ids}
    info["first_divergence_from_baseline"] = compare_ids(ref, baseline_ids)["first_mismatch"]
    return ref, info


def run_context_same(bench: Bench, ids: list[int], temp: float) -> tuple[list[dict], dict]:
    """One prompt, re-run by every run (chat questions, --no-first-time-lengths): the method
    before first-time lengths; the ledger still says, run by run, which shapes were revisited."""
    setup, cfg, log = bench.setup, bench.cfg, bench.log
    ctx = len(ids)
    greedy = temp == 0
    log(f"-- context {ctx}" + (f", temperature {temp:g}" if not greedy else "")
        + f": warm-up x{cfg.warmup} (same prompt every run)")
    base_ids: list[int] = []
    for _ in range(cfg.warmup):
        base_ids, _ = bench.baseline(ids, temp)
        if not cfg.oracle:  # the oracle's settling runs below are its warm-up
            bench.dflash(ids, temp, base_ids)
        time.sleep(cfg.cooldown)
    reference, settle = base_ids, None
    if cfg.oracle:
        if not base_ids or not greedy:
            base_ids, _ = bench.baseline(ids, 0.0)
        reference, settle = settle_oracle(bench, ids, base_ids)
        if not settle["matches_baseline"]:
            log(f"   ctx {ctx}: oracle replays DFlash's own ids (verify differs from decode at "
                f"token {settle['first_divergence_from_baseline']}; settled in "
                f"{settle['iterations']} runs, converged {settle['converged']})")
        time.sleep(cfg.cooldown)

    base_runs, dfl_runs = [], []
    for r in range(cfg.repeats):
        order = ("baseline", "dflash") if r % 2 == 0 else ("dflash", "baseline")
        got: dict[str, tuple[list[int], dict]] = {}
        for eng in order:
            if eng == "baseline":
                got[eng] = bench.baseline(ids, temp)
            else:
                got[eng] = bench.dflash(ids, temp, reference)
            _label(got[eng][1], ctx, r, eng, cfg, got[eng][0], temp)
            bench.timed_run(ctx, r, eng, got[eng][1])
            time.sleep(cfg.cooldown)
        (b_ids, b_rec), (d_ids, d_rec) = got["baseline"], got["dflash"]
        if greedy:
            d_rec.update(compare_ids(d_ids, b_ids))
            if not d_rec["lossless"]:
                log(f"   !! ctx {ctx} repeat {r + 1}: DFlash ids differ from the baseline's at "
                    f"token {d_rec['first_mismatch']}")
        else:
            d_rec.update(lossless=None, first_mismatch=None)
        base_runs.append(b_rec)
        dfl_runs.append(d_rec)
    fwd = bench.forward_cost(ctx, ids)
    row = summarize(ctx, base_runs, dfl_runs, fwd, temp)
    if settle is not None:
        row["oracle_reference"] = settle
    return _in_order(base_runs + dfl_runs), row


def method(cfg: BenchConfig, setup: Setup, runs: list[dict], first_time_used: bool) -> dict:
    """How the numbers were measured, in the JSON next to them."""
    return {
        "first_time_lengths": first_time_used,
        "first_time_verified": all(r.get("first_time") for r in runs),
        "revisited_runs": sum(1 for r in runs if not r.get("first_time")),
        "shape_rule": "a run is first-time when none of its decode forwards (tokens, cache "
                      "offset >= prompt length) was run before in this process",
        "warmup_runs": cfg.warmup,
        "repeats": cfg.repeats,
        "statistic": "median over repeats (every run in runs[]); speedup_paired: the median of "
                     "each repeat's dflash/baseline ratio",
        "order": "alternating baseline/dflash per repeat",
        "cooldown_s": cfg.cooldown,
        "mlx_cuda_use_cudnn_sdpa": accel.setting(accel.CUDNN_SDPA),
        "mlx_use_cuda_graphs": accel.setting(accel.CUDA_GRAPHS),
        "verify_attention": setup.target.verify_attention,  # engine/verifyattn.py: mlx, kernel, fastexp
        "pipelined": setup.target.pipelined,  # DFLASH_PIPELINE: verifies queued layer group by group
        "run_ahead": setup.target.run_ahead,  # DFLASH_RUNAHEAD: next draft queued before the read
        "branches": setup.target.branches,  # DFLASH_BRANCHES: draft rows per greedy verify
        # the default rows' limit: R copies of the KV cache in bytes (None: rows asked for, any length)
        "branch_budget_bytes": setup.target.branch_budget,
        "row_padding": {"dflash": setup.target.row_padding, "baseline": False,
                        "plan": setup.target.row_plan,
                        "what": "dflash's target forwards pad few-row products to the row count "
                                "the BLAS does fastest, per weight shape (plan: rows -> padded "
                                "rows; engine/rowpad.py); mlx-lm's baseline runs the model unpadded"},
        # engine/cpufast.py: RoPE / RMSNorm modules of the target on the CPU path (same bits)
        "cpu_fast": {"dflash": setup.target.cpu_fast, "baseline": 0,
                     "what": "dflash's own forwards run RoPE from per-forward tables and RMSNorm in "
                             "two kernels on a CPU, bit for bit MLX's; mlx-lm's baseline runs "
                             "MLX's ops"},
        # engine/fuse.py: q/k/v and gate/up groups run as one product each (same bits)
        "fused_products": {"dflash": setup.target.fused, "baseline": 0,
                           "what": "dflash's own forwards run each attention's q/k/v and each "
                                   "MLP's gate/up as one product (groups fused; a GPU's default); "
                                   "mlx-lm's baseline runs them one by one"},
        "draft_vocab": (len(setup.draft_vocab) if setup.draft_vocab else None),  # engine/draftvocab.py: None = all
        # engine/drafters.py: windows up to this many tokens draft from a cut block (0: never)
        "short_block_max": (short_block_max(setup.draft_model.config)
                            if setup.draft_model is not None else None),
        # engine/window.py: "auto" chooses the whole block or a plain step, by measurement (DFLASH_WINDOW_WIDE)
        "window_wide": wide_windows(),
        "temperatures": list(cfg.temperatures),
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
        "lossless_check": "greedy only: DFlash ids vs a baseline run on the same prompt; "
                          "sampled runs: null (ids are draws, compare acceptance and speed)",
        "decisive_random_target": setup.decisive,
        "forward_timing": "medians of synced single forwards at first-time cache lengths; "
                          "ideal_speedup = tau * t(step) / (t(verify) + t(draft))",
    }


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during the runs: what was measured is written all the same (`path`)."""

    def __init__(self, path: Path):
        super().__init__(str(path))
        self.path = path


def check_config(cfg: BenchConfig) -> None:
    """What can be refused before any model loads (ValueError), so a mistake costs no setup."""
    if cfg.repeats < 1 or cfg.max_tokens < 1 or not cfg.contexts or not cfg.temperatures:
        raise ValueError("need repeats >= 1, max_tokens >= 1, at least one context length "
                         "and at least one temperature")
    if cfg.oracle and any(t > 0 for t in cfg.temperatures):
        raise ValueError("--oracle is greedy only: it replays the target's greedy ids")
    if cfg.random_target and (cfg.model or cfg.draft):
        raise ValueError("--random-target builds its own target and draft: give it without "
                         "--model / --draft")
    if cfg.random_target and cfg.chat:
        raise ValueError("--chat needs a real model with a tokenizer (not --random-target)")
    if cfg.random_target and cfg.draft_layers == 0 and not cfg.oracle:
        raise ValueError("DFlash mode needs a draft (give --draft, or --draft-layers > 0)")


def out_dir(out: str) -> Path:
    """The results folder, made if missing; ValueError when it cannot be (a file in its place)."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {out} cannot be made: {e.strerror or e}") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out} is not writable")
    return path


@contextlib.contextmanager
def results_folder(out: str) -> Iterator[Path]:
    """The results folder made before the runs, so a bad --out is refused before them, not
    after (when the measurements would be lost); the folders made for it are removed again
    when the body fails before writing anything into them."""
    made = [d for d in (Path(out), *Path(out).parents) if not d.exists()]
    path = out_dir(out)
    try:
        yield path
    except BaseException:
        for d in made:  # innermost first; a folder holding anything stays
            with contextlib.suppress(OSError):
                d.rmdir()
        raise


def check_setup(cfg: BenchConfig, setup: Setup) -> None:
    """What the loaded pair decides, checked before the first run: a draft to run, a window
    its block and the target's caches can take."""
    from .window import fixed_window

    if not cfg.oracle and setup.draft_model is None:
        raise ValueError("DFlash mode needs a draft (give --draft, or --draft-layers > 0)")
    fixed_window(_window(cfg), setup.block_size,
                 rollback.plain_step_undoable(setup.target.make_cache()))


def run_benchmark(cfg: BenchConfig, log: Log = print) -> tuple[dict, Path]:
    """Run the whole protocol; write the JSON (and plot); return (result, json path).

    Ctrl-C during the runs writes what was measured (`interrupted: true`: the finished rows,
    and every finished timed run) and raises Interrupted with its path."""
    check_config(cfg)
    text = prompt_text(cfg)
    with results_folder(cfg.out):
        return _run_benchmark(cfg, log, text)


def _run_benchmark(cfg: BenchConfig, log: Log, text: str | None) -> tuple[dict, Path]:
    t_setup = time.perf_counter()
    setup = build_setup(cfg)
    check_setup(cfg, setup)
    # Raw prompts ignore EOS: every run generates exactly max_tokens (comparable tok/s). Chat
    # answers stop at EOS: past it a model loops on its last turn, which any draft predicts
    # (95% acceptance measured) and no user ever sees.
    if not (cfg.respect_eos or cfg.chat):
        setup.tokenizer.eos_token_ids = set()
    mode_line = _mode_line(cfg, setup)
    log(f"== dflash benchmark | MODE: {mode_line}")
    log(f"== {setup.description} | dtype {setup.dtype} | device {mx.default_device()} | "
        f"block {setup.block_size} | setup {time.perf_counter() - t_setup:.1f} s | "
        + " | ".join(f"{name}={accel.setting(name)['value']}" for name in accel.CUDA_SETTINGS))

    bench = Bench(setup, cfg, log, text)
    fresh = cfg.first_time_lengths and not cfg.chat
    runs: list[dict] = []
    summary: list[dict] = []
    try:
        _run_rows(bench, fresh, runs, summary)
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True
        runs.extend(_unfinished(bench.timed))
    if interrupted and not runs:
        log("== interrupted (Ctrl-C) before any timed run finished: nothing written")
        raise KeyboardInterrupt
    result = _result(cfg, setup, mode_line, runs, summary, fresh, interrupted)
    path = _write(result, cfg, setup)
    from .benchplot import format_table, plot

    if summary:
        log(format_table(result))
    if interrupted:
        log(f"== interrupted (Ctrl-C): {len(summary)} finished row(s), {len(runs)} timed run(s) kept")
    log(f"== results: {path}")
    if interrupted:
        raise Interrupted(path)
    if cfg.plot:
        note = plot(result, path.with_suffix(".png"))
        log(f"== plot: {note}")
    return result, path


def _run_rows(bench: Bench, fresh: bool, runs: list[dict], summary: list[dict]) -> None:
    """Every (temperature, context or question) row, appended to `runs` / `summary` as each
    one finishes."""
    cfg, setup = bench.cfg, bench.setup
    for temp in cfg.temperatures:
        if cfg.chat:
            rows = ((run_context_same, ids) for ids in chat_prompts(setup, bench.text))
        elif fresh:
            rows = ((run_context_fresh, ctx) for ctx in cfg.contexts)
        else:
            rows = ((run_context_same, bench.prompt(ctx)) for ctx in cfg.contexts)
        for run_row, arg in rows:
            bench.timed = []
            ctx_runs, row = run_row(bench, arg, temp)
            runs.extend(ctx_runs)
            summary.append(row)
            bench.timed = []


def _unfinished(timed: list[dict]) -> list[dict]:
    """The interrupted row's finished timed runs; DFlash runs whose ids were not yet compared
    with the baseline's say so (lossless null)."""
    for rec in timed:
        if rec.get("engine") == "dflash":
            rec.setdefault("lossless", None)
            rec.setdefault("first_mismatch", None)
    return _in_order(timed)


def _result(cfg: BenchConfig, setup: Setup, mode_line: str, runs: list[dict], summary: list[dict],
            fresh: bool, interrupted: bool) -> dict:
    """The JSON written: the setup, the method, every run and the per-row summary."""
    sampled = any(t > 0 for t in cfg.temperatures)
    greedy_dfl = [r["lossless"] for r in runs if r["engine"] == "dflash" and r["lossless"] is not None]
    return {
        "mode": cfg.mode,
        "mode_description": mode_line,
        "model": setup.name,
        "setup": setup.description,
        "dtype": setup.dtype,
        "block_size": setup.block_size,
        "capture_layer_ids": setup.target.layer_ids,
        "created": datetime.now().isoformat(timespec="seconds"),
        "interrupted": interrupted,
        "hardware": hardware_info(),
        "versions": versions(),
        "config": dataclasses.asdict(cfg),
        "method": method(cfg, setup, runs, fresh),
        "lossless": all(greedy_dfl) if greedy_dfl else None,
        "lossless_note": None if not sampled else (
            "sampled runs are not compared id by id (lossless: null); their acceptance, tokens "
            "per cycle and speed are"),
        "runs": runs,
        "summary": summary,
    }


def _mode_line(cfg: BenchConfig, setup: Setup) -> str:
    if not cfg.oracle:
        return "dflash (real draft proposals)"
    cost = ("the draft still runs every cycle, its cost included"
            if setup.draft_model is not None else "no draft compute at all")
    return (f"ORACLE: draft proposals replaced by the baseline's own greedy ids (every draft "
            f"accepted; the engine's ceiling, NOT a real draft's speed); {cost}")


def _write(result: dict, cfg: BenchConfig, setup: Setup) -> Path:
    """<out>/<label>-<mode>-<host>-<time>.json; a name already taken (two runs in one second)
    gets -2, -3, ...: a result never overwrites another."""
    out = out_dir(cfg.out)
    stem = "-".join([cfg.label or setup.name, cfg.mode, socket.gethostname(),
                     datetime.now().strftime("%Y%m%d-%H%M%S")])
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", stem)
    path, n = out / f"{stem}.json", 2
    while path.exists():
        path, n = out / f"{stem}-{n}.json", n + 1
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


# --- environment --------------------------------------------------------------------------------
def hardware_info() -> dict:
    """Where the numbers came from: CPU, memory, MLX device, and the GPU's name on CUDA."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or _cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_gb": _memory_gb(),
        "mx_default_device": str(mx.default_device()),
    }
    try:
        info["mx_device_info"] = {k: v for k, v in mx.device_info().items()
                                  if isinstance(v, (str, int, float))}
    except Exception:  # noqa: BLE001 - informational only
        pass
    gpu = _nvidia_gpu()
    if gpu:
        info["gpu"] = gpu
    blas = {k: os.environ[k] for k in ("LD_PRELOAD", "MKL_THREADING_LAYER", *accel.CUDA_SETTINGS)
            if k in os.environ}
    if blas:
        info["env"] = blas
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _memory_gb() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _nvidia_gpu() -> str | None:
    if mx.default_device() != mx.gpu or sys.platform == "darwin":
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def v(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return {"mlx": mx.__version__, "mlx_lm": v("mlx-lm"), "dflash": v("dflash"),
            "python": platform.python_version()}


# --- CLI ----------------------------------------------------------------------------------------
def _contexts(_ctx: Any, _param: Any, value: str) -> list[int]:
    try:
        vals = [int(v) for v in value.replace(" ", "").split(",") if v]
    except ValueError:
        raise click.BadParameter("comma-separated integers, e.g. 1024,2048") from None
    if not vals or min(vals) < 1:
        raise click.BadParameter("at least one positive context length")
    return vals


def finite_option(_ctx: Any, _param: Any, value: float | None) -> float | None:
    """nan passes click's float ranges (every comparison with it is false), inf sleeps forever:
    refused as the option's value."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number")
    return value


def window_option(_ctx: Any, _param: Any, value: str) -> str:
    """--verify-window's form (auto, full, a count >= 1) checked as an option, before any model
    loads; whether the draft's block and the target's caches take it is checked once loaded."""
    from .window import fixed_window

    try:
        fixed_window(value, 1 << 30)
    except ValueError:
        raise click.BadParameter(f"auto, full or a number of tokens >= 1 (1 = plain decoding); "
                                 f"got {value!r}") from None
    return value


def _temperatures(_ctx: Any, _param: Any, value: str) -> list[float]:
    try:
        vals = [float(v) for v in value.replace(" ", "").split(",") if v]
    except ValueError:
        raise click.BadParameter("comma-separated numbers, e.g. 0 or 0,0.7") from None
    if not vals or any(not (v >= 0 and v < float("inf")) for v in vals):
        raise click.BadParameter("temperatures are finite numbers >= 0 (0 = greedy)")
    return list(dict.fromkeys(vals))


@click.command("benchmark")
@click.option("--model", default=None, help="Target model directory (mlx-lm format).")
@click.option("--draft", default=None,
              help="Draft directory; omitted: resolved from the registry, as `dflash generate` does "
                   "(with --oracle: no draft, none of its cost).")
@click.option("--random-target", type=click.Choice(list(RANDOM_SHAPES)), default=None,
              help="Build a random-weight target (and draft) of this shape in memory instead of "
                   "--model / --draft.")
@click.option("--draft-layers", default=5, show_default=True, type=click.IntRange(0),
              help="Random target: layers of the random draft (0 = none).")
@click.option("--block-size", default=16, show_default=True, type=click.IntRange(2),
              help="Block size when no draft fixes it (random draft, oracle without draft).")
@click.option("--oracle", is_flag=True,
              help="Replace draft proposals by the baseline's greedy ids (the ceiling).")
@click.option("--oracle-draft-cost/--no-oracle-draft-cost", default=True, show_default=True,
              help="Oracle mode: still run the draft (if any) so its cost is timed.")
@click.option("--contexts", default="1024,2048,4096,8192", show_default=True, callback=_contexts,
              help="Prompt lengths in tokens, comma-separated (not used with --chat).")
@click.option("--max-tokens", default=256, show_default=True, type=click.IntRange(1))
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1))
@click.option("--warmup", default=1, show_default=True, type=click.IntRange(0),
              help="Untimed runs of both engines per context before the timed ones.")
@click.option("--cooldown", default=5.0, show_default=True, type=click.FloatRange(0),
              callback=finite_option, help="Seconds to sleep between runs.")
@click.option("--dtype", type=click.Choice(list(DTYPES)), default=None,
              help="Cast target and draft (default: as stored; random target: bf16 GPU, fp32 CPU).")
@click.option("--out", default=DEFAULT_OUT, show_default=True,
              help="Output folder for the JSON and the plot, made if missing (relative paths: "
                   "under the current directory).")
@click.option("--prompt-file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Text to build prompts from (repeated/trimmed); default: built-in prose. "
                   "With --chat: one question per line, or JSONL with \"prompt\" (e.g. engine/training/heldout_prompts.jsonl).")
@click.option("--chat", is_flag=True,
              help="Chat questions through the model's chat template, one row each (built-in "
                   "ones or --prompt-file lines) instead of raw text cut to --contexts.")
@click.option("--label", default=None, help="Name for the result files (default: model name).")
@click.option("--respect-eos", is_flag=True,
              help="Stop at EOS (default: ignore it, so all runs have the same length; --chat "
                   "always stops there).")
@click.option("--verify-iters", default=10, show_default=True, type=click.IntRange(0),
              help="Timed iterations of the M=block vs M=1 forward (0 = skip).")
@click.option("--verify-window", default="auto", show_default=True, callback=window_option,
              help="Tokens per verify: auto, full, or a number (oracle mode: always full).")
@click.option("--copy-draft/--no-copy-draft", default=True, show_default=True,
              help="Copy drafting beside the draft: verify a copy of what followed the text's last "
                   "tokens earlier, where that is expected to pay (oracle mode: always off).")
@click.option("--temperature", "temperatures", default="0", show_default=True,
              callback=_temperatures,
              help="Sampling temperature(s), comma-separated: 0 = greedy; e.g. 0,0.7 runs both, "
                   "one summary row per temperature and context.")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1, min_open=True),
              callback=finite_option, help="Sampling: nucleus mass (1 = off), for both engines.")
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(0),
              help="Sampling: keep the k most likely tokens (0 = off), for both engines.")
@click.option("--first-time-lengths/--no-first-time-lengths", default=True, show_default=True,
              help="Every timed run at cache lengths never run before in the process (its own "
                   "prompt length); off: one prompt re-run by every run (the old method; --chat "
                   "always runs so).")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, (1 << 63) - 1),
              help="Random prompt ids and random weights (--random-target), and the sampling "
                   "draws of each run.")
@click.option("--no-plot", is_flag=True, help="Do not draw the PNG plot.")
def benchmark_command(no_plot: bool, **kwargs: Any) -> None:
    """Benchmark DFlash against mlx-lm's stream_generate, side by side, in one process.

    Writes one JSON (and a PNG plot) into --out and prints its path. Ctrl-C stops it and still
    writes what was measured ("interrupted": true), exit status 130.
    """
    if not kwargs["model"] and not kwargs["random_target"]:
        raise click.UsageError("give --model PATH or --random-target SHAPE")
    if kwargs["random_target"] and (kwargs["model"] or kwargs["draft"]):
        raise click.UsageError("--random-target builds its own target and draft: give it without "
                               "--model / --draft")
    cfg = BenchConfig(**kwargs, plot=not no_plot)
    try:
        run_benchmark(cfg, log=lambda s: click.echo(s))
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from e
    except KeyboardInterrupt:  # Interrupted: the JSON so far is written (and named) already
        click.echo("cancelled", err=True)
        sys.exit(130)


if __name__ == "__main__":  # `python -m dflash.engine.benchmark ...`, without the full CLI
    accel.maybe_reexec()  # MKL preload on CPU, like `dflash benchmark` (cuDNN SDPA: set on import)
    benchmark_command()
