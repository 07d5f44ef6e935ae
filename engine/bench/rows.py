"""One summary row of `dflash benchmark`: warm-up, alternating timed runs, medians.

Why a module of its own: this is the protocol of the package docstring, row by row. `Bench`
holds one process's setup, shape ledger and planner; `run_context_fresh` runs a context at
first-time lengths, `run_context_same` re-runs one prompt (chat questions,
--no-first-time-lengths); `summarize` turns a row's runs into its medians.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from typing import Callable, Sequence

from .. import rollback
from .plan import (
    Planner,
    ShapeLedger,
    baseline_shapes,
    dflash_shapes,
    forward_timing_shapes,
    oracle_shapes,
)
from .setup import BenchConfig, Setup, make_drafter, prompt_ids
from .timing import (
    FORWARD_WARMUP,
    GREEDY,
    Sampling,
    compare_ids,
    run_baseline,
    run_dflash,
    time_forward,
)

Log = Callable[[str], None]


def _window(cfg: BenchConfig) -> str:
    """The oracle measures the ceiling: always the whole block."""
    return "full" if cfg.oracle else cfg.verify_window


def _copy_draft(cfg: BenchConfig) -> bool:
    """The oracle measures the model draft's ceiling: no copies beside it."""
    return cfg.copy_draft and not cfg.oracle


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
        "dflash_first_time": all(r.get("first_time") for r in dfl),
        # the forward widths (tokens) of the shapes any run revisited: [1] is single-token steps only
        "revisited_widths": sorted({w for r in base + dfl
                                    for w in (r.get("shapes") or {}).get("revisited_widths", ())}),
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
                        (self.cfg.seed * 1_000_003 + self.counter) % 2**63,
                        self.cfg.min_p, self.cfg.min_tokens_to_keep)

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
        again = fwd["verify_revisited_ms"]
        again = f" (revisited {again:.2f} ms)" if again is not None else ""
        self.log(f"   ctx {center} forward at {len(ids)}: M={setup.block_size} "
                 f"{fwd['verify_ms']:.2f} ms{again} vs M=1 {fwd['step_ms']:.2f} ms -> "
                 f"t(verify)/t(step) = {fwd['ratio']:.2f}{draft}")
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


def _ids_hash(ids: Sequence[int]) -> str:
    return hashlib.sha1(json.dumps(list(ids)).encode()).hexdigest()[:16]


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
    before first-time lengths; the ledger still says, run by run, which shapes were revisited.

    With --warmup-context the warm-up runs on the built-in text instead, and each repeat runs
    DFlash first: one repeat of one question then decodes at shapes new to the process (the
    baseline after it can only revisit DFlash's single-token steps, which flatters the
    baseline if anything)."""
    setup, cfg, log = bench.setup, bench.cfg, bench.log
    ctx = len(ids)
    greedy = temp == 0
    apart = cfg.warmup_context > 0
    warm = prompt_ids(setup, cfg.warmup_context, None, cfg.seed) if apart else ids
    log(f"-- context {ctx}" + (f", temperature {temp:g}" if not greedy else "")
        + f": warm-up x{cfg.warmup}"
        + (f" (on {len(warm)} tokens of text, DFlash first)" if apart else " (same prompt every run)"))
    base_ids: list[int] = []
    for _ in range(cfg.warmup):
        base_ids, _ = bench.baseline(warm, temp)
        if not cfg.oracle:  # the oracle's settling runs below are its warm-up
            bench.dflash(warm, temp, base_ids)
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
        order = ("baseline", "dflash") if (r + apart) % 2 == 0 else ("dflash", "baseline")
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
    # at a fresh length of the text when the runs were apart (re-running `ids` would revisit)
    fwd = bench.forward_cost(ctx, None if apart else ids)
    row = summarize(ctx, base_runs, dfl_runs, fwd, temp)
    if settle is not None:
        row["oracle_reference"] = settle
    return _in_order(base_runs + dfl_runs), row
