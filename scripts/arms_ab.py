"""Engine settings against each other, interleaved in one process (an in-process A/B).

    python scripts/arms_ab.py --model models/SmolLM2-135M-Instruct \
        [--arm whole:cut=0 --arm cut:cut=2] [--baseline] [--heldout 7] [--rounds 3] \
        [--max-tokens 128] [--dtype float32] [--warmup 1] [--out RESULT.json]

Each chat question (the benchmark's five, then `--heldout` of the 48 held-out prompts, drawn
with a fixed seed) is answered greedily by every arm in a shuffled order, round after round. An
arm is NAME:KEY=VALUE,...; the keys:
    cut=N       draft blocks cut to windows up to N tokens (the drafter's short_max; 0: whole)
    window=W    the verify window: auto, full or a number of tokens (generate.py)
    copy=0|1    copy drafting off / on
    wide=0|1    "auto" chooses the whole block or a plain step by measurement (DFLASH_WINDOW_WIDE,
                engine/window.py; a GPU's default)
    conf=0|1    the draft's confidence chooses a drafted whole block's window (greedy, without
                wide windows; DFLASH_WINDOW_CONFIDENCE, engine/window.py; off by default)
    gap=N       the longest gap between probes while "auto" decodes plainly (VerifyWindow's
                max_probe_gap; as shipped 16 with wide windows, 128 without)
    fdecay=F    the decay of the wide rule's mean of tokens per whole-block cycle (VerifyWindow's
                full_decay, 0.97 as shipped; 0.9 before session 22)
    fast=0|1    RoPE and RMSNorm in fewer CPU kernels (engine/cpufast.py, on by default on a CPU;
                the same bits either way, only the speed differs)
    fuse=0|1    q/k/v and gate/up as one product each (engine/fuse.py; installed at load on a GPU,
                or anywhere with DFLASH_FUSE=1; the same bits either way)
    draft=DIR   another draft for the same target (loaded once per directory), e.g. a candidate
                beside the bundled one
    rows=N      draft rows per greedy verify, 1..8 (engine/branches.py; DFLASH_BRANCHES's value
                for one arm: the target loads with the most rows any arm asks for, and a target
                whose verify attention cannot take rows is refused before any run)
    mem=0|1     carry what each generation's verify window measured into the arm's next one
                (a WindowMemory per arm, engine/window.py), as the daemon does from job to job
                (daemon/compute.py); off: every generation starts from the built-in priors, as
                every other in-process run
    recall=0|1  with mem=1: the remembered acceptances seed the next generation too, not only
                the costs (DFLASH_WINDOW_RECALL_ACCEPTANCE; off by default since session 37)
Unset keys keep the loaded pair's defaults. `--baseline` adds mlx-lm's own decoding of the same
model as an arm ("mlx-lm"), timed with the same clock (engine/bench/timing.py), so every arm's
speedup comes out of the same interleaving. `--warmup` answers the first question by every arm
that many times untimed first (compiles, caches, a GPU's first kernels). In one process the
machine's drift hits every arm alike, which `dflash benchmark` runs in separate processes cannot
promise: a 4% effect needs this.

The output cannot depend on the arm: ids must equal the first arm's (with --baseline, mlx-lm's).
On a bf16 GPU a 16-token verify and a 1-token step may round a near-tie differently (README,
losslessness), so give --tolerate-id-diffs there: differing answers are counted, not fatal.
Texts that part then go on differently, and a text's predictability moves speed more than an
arm does. `--teach` (with --baseline) times every arm on mlx-lm's own text instead: mlx-lm
answers each prompt once untimed first, and each DFlash run takes those ids as the target's
choices (generate.py's `teacher`; its passes are a real run's), so every pair is like for like.
Prints each arm's paired ratio against the first arm (geometric mean over generations, with a
95% interval), tokens per cycle and the mean verify window; --out writes every generation.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

BASELINE = "mlx-lm"
KEYS = ("cut", "window", "copy", "wide", "conf", "gap", "fdecay", "fast", "fuse", "draft", "rows", "mem",
        "recall")
WINDOW_KEYS = {"gap": "max_probe_gap", "fdecay": "full_decay"}  # arm key -> VerifyWindow argument
ENV_NOTED = ("MLX_CUDA_USE_CUDNN_SDPA", "MLX_USE_CUDA_GRAPHS", "DFLASH_VERIFY_ATTN", "DFLASH_PIPELINE", "DFLASH_BRANCHES",
             "DFLASH_SHORT_BLOCK", "DFLASH_DRAFT_VOCAB", "DFLASH_WINDOW_WIDE", "DFLASH_WINDOW_CONFIDENCE",
             "DFLASH_WINDOW_RECALL_ACCEPTANCE",
             "DFLASH_FUSE", "DFLASH_CPU_FAST", "DFLASH_ACCEL")


@dataclass
class Arm:
    name: str
    settings: dict = field(default_factory=dict)
    drafter: Any = None  # None: the loaded pair's (see attach_drafters)
    memory: Any = None  # mem=1: the WindowMemory its generations hand on, one to the next


def parse_arm(spec: str) -> Arm:
    """'cut:cut=2,window=auto' -> Arm('cut', {'cut': 2, 'window': 'auto'}); a clear error otherwise."""
    name, _, rest = spec.partition(":")
    if not name or name == BASELINE:
        raise ValueError(f"arm {spec!r}: give NAME:KEY=VALUE,... (a name other than {BASELINE!r})")
    settings: dict = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in KEYS:
            raise ValueError(f"arm {spec!r}: {item!r} is not one of {', '.join(k + '=' for k in KEYS)}")
        if key == "window":
            settings[key] = value if value in ("auto", "full") else _int(spec, value, 2)
        elif key == "cut":
            settings[key] = _int(spec, value, 0)
        elif key == "gap":
            settings[key] = _int(spec, value, 1)
        elif key == "rows":
            from dflash.engine.branches import MAX_ROWS

            settings[key] = _int(spec, value, 1, MAX_ROWS)
        elif key == "fdecay":
            try:
                settings[key] = float(value)
            except ValueError:
                settings[key] = -1.0
            if not 0.0 < settings[key] < 1.0:
                raise ValueError(f"arm {spec!r}: {value!r} must be a number between 0 and 1")
        elif key == "draft":
            if not value:
                raise ValueError(f"arm {spec!r}: draft= needs a directory")
            settings[key] = value
        else:
            settings[key] = bool(_int(spec, value, 0, 1))
    arm = Arm(name, settings)
    if settings.get("mem"):
        from dflash.engine.window import WindowMemory

        arm.memory = WindowMemory()
    return arm


def _int(spec: str, value: str, low: int, high: int | None = None) -> int:
    try:
        n = int(value)
    except ValueError:
        n = low - 1
    if n < low or (high is not None and n > high):
        raise ValueError(f"arm {spec!r}: {value!r} must be an integer >= {low}"
                         + (f" and <= {high}" if high is not None else ""))
    return n


def load_for_arms(model: str, draft: str | None, dtype: str | None, arms: list[Arm]):
    """The pair, loaded for the most draft rows any arm asks for (rows=N: the target's own check
    of its verify attention runs at load); arms without rows= keep DFLASH_BRANCHES's count."""
    from dflash.engine import branches
    from dflash.engine.loading import load_pair

    base = branches.configure()
    most = max([base] + [a.settings.get("rows", base) for a in arms])
    saved = os.environ.get(branches.ENV)
    os.environ[branches.ENV] = str(most)
    try:
        pair = load_pair(model, draft, dtype=dtype)
    finally:
        if saved is None:
            os.environ.pop(branches.ENV, None)
        else:
            os.environ[branches.ENV] = saved
    if pair.target.branches < most:
        raise ValueError(f"rows={most}: this target verifies one row only here (its verify "
                         "attention cannot read batched rows; engine/branches.py)")
    pair.target.branches = base
    for arm in arms:
        arm.settings.setdefault("rows", base)
    return pair


def attach_drafters(pair, arms: list[Arm], dtype: str | None) -> None:
    """Load each arm's own draft (draft=DIR) once per directory, for the pair's target."""
    from dflash.engine.loading import load_drafter

    loaded: dict[str, Any] = {}
    for arm in arms:
        path = arm.settings.get("draft")
        if path is not None:
            if path not in loaded:
                loaded[path] = load_drafter(pair.target, path, dtype)
            arm.drafter = loaded[path]


def questions(heldout: int, seed: int = 0) -> list[str]:
    from dflash.engine.bench.setup import CHAT_QUESTIONS
    from dflash.engine.training.data import load_heldout

    held = [q for _, q in load_heldout()]
    random.Random(seed).shuffle(held)
    return list(CHAT_QUESTIONS) + held[:heldout]


def _generate(pair, arm: Arm | None, ids: list[int], max_tokens: int,
              teacher: list[int] | None = None) -> tuple[list[int], dict]:
    """One greedy answer by one arm (None: mlx-lm), timed as `dflash benchmark` times it;
    `teacher`: the ids a DFlash arm decodes (see --teach)."""
    from dflash.engine.bench.timing import run_baseline, run_dflash

    if arm is None:
        return run_baseline(pair, ids, max_tokens)
    import functools

    from dflash.engine import cpufast, fuse
    from dflash.engine import generate as generate_mod
    from dflash.engine.window import CONFIDENCE_ENV, RECALL_ENV, WIDE_ENV, VerifyWindow

    drafter = arm.drafter or pair.drafter
    envs = {key: name for key, name in (("wide", WIDE_ENV), ("conf", CONFIDENCE_ENV),
                                        ("recall", RECALL_ENV)) if key in arm.settings}
    saved, saved_env = drafter.short_max, {name: os.environ.get(name) for name in envs.values()}
    saved_rows = pair.target.branches
    try:
        drafter.short_max = arm.settings.get("cut", saved)
        pair.target.branches = arm.settings.get("rows", saved_rows)
        for key, name in envs.items():
            os.environ[name] = "1" if arm.settings[key] else "0"
        cpufast.ON = arm.settings.get("fast", True)
        fuse.ON = arm.settings.get("fuse", True)
        rule = {arg: arm.settings[key] for key, arg in WINDOW_KEYS.items() if key in arm.settings}
        if rule:  # the loop builds its VerifyWindow by this module-level name
            generate_mod.VerifyWindow = functools.partial(VerifyWindow, **rule)
        out, rec = run_dflash(pair, drafter, ids, max_tokens,
                              window=arm.settings.get("window", "auto"),
                              copy_draft=arm.settings.get("copy", True), teacher=teacher,
                              window_memory=arm.memory)
    finally:
        generate_mod.VerifyWindow = VerifyWindow
        cpufast.ON = fuse.ON = True
        drafter.short_max = saved
        pair.target.branches = saved_rows
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    eng = rec.get("engine_stats", {})
    rec.update(mean_verify_window=eng.get("mean_verify_window"), plain_steps=eng.get("plain_steps"),
               branch_rows=eng.get("branch_rows"))
    return out, rec


def run(pair, prompts: list[list[int]], arms: list[Arm], rounds: int, max_tokens: int,
        baseline: bool = False, tolerate_id_diffs: bool = False, warmup: int = 0,
        on_round: Callable[[dict[str, list[dict]]], None] | None = None,
        log: Callable[[str], None] | None = None, teach: bool = False) -> dict[str, list[dict]]:
    """Every prompt (token ids) by every arm each round, the order shuffled per prompt;
    `on_round` sees the results so far after each round (a run cut short keeps its rounds), `log`
    gets a line per prompt (a run cut short keeps those too); `teach`: every DFlash arm decodes
    mlx-lm's text of the prompt (see the module doc)."""
    names = ([BASELINE] if baseline else []) + [a.name for a in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"arm names must differ: {names}")
    if teach and not baseline:
        raise ValueError("--teach times the arms on mlx-lm's texts: give --baseline too")
    by_name: dict[str, Arm | None] = {a.name: a for a in arms}
    by_name[BASELINE] = None
    teachers: list[list[int] | None] = [None] * len(prompts)
    if teach:  # mlx-lm's text of each prompt, with the end-of-sequence id it stopped on
        for i, ids in enumerate(prompts):
            out, rec = _generate(pair, None, ids, max_tokens)
            teachers[i] = out + ([rec["stop_token"]] if rec.get("stop_token") is not None else [])
    for _ in range(warmup):
        for name in names:
            _generate(pair, by_name[name], prompts[0], max_tokens, teachers[0])
    res: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(rounds):
        for i, ids in enumerate(prompts):
            order = list(names)
            random.Random(r * 1000 + i).shuffle(order)
            got = {}
            for name in order:
                got[name], rec = _generate(pair, by_name[name], ids, max_tokens, teachers[i])
                res[name].append({"question": i, "round": r, "tokens": rec["generated_tokens"],
                                  "ids_sha1": ids_digest(got[name]),
                                  **{k: rec.get(k) for k in ("decode_tps", "acceptance",
                                     "tokens_per_cycle", "mean_verify_window", "plain_steps",
                                     "cycles", "copy_cycles", "confidence_windows",
                                     "run_ahead", "branch_rows")}})
            for name in names[1:]:
                same = got[name] == got[names[0]]
                res[name][-1]["same_ids"] = same
                if not same and not tolerate_id_diffs:
                    raise AssertionError(f"question {i}: arm {name!r} changed the output")
            if log:
                log(f"round {r} question {i}: " + ", ".join(
                    f"{n} {res[n][-1]['decode_tps']:.1f} tok/s"
                    + (f" ({res[n][-1]['tokens_per_cycle']:.2f}/cycle)" if res[n][-1]['tokens_per_cycle'] else "")
                    for n in names))
        if on_round:
            on_round(res)
    return res


def ids_digest(ids: list[int]) -> str:
    """A short fingerprint of an answer's ids: which arms wrote the same text (bf16 near-ties)."""
    return hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:12]


def paired(res: dict[str, list[dict]], arm: str, reference: str,
           same_text: bool = False) -> dict[str, float]:
    """Geometric mean of arm/reference decode tok/s over the paired generations, 95% interval;
    `same_text`: only the pairs whose answers are the same ids (arms that part at a bf16 near-tie
    go on to decode different texts, and a text's predictability moves speed more than an arm)."""
    pairs = [(a, b) for a, b in zip(res[arm], res[reference])
             if not same_text or a.get("ids_sha1") == b.get("ids_sha1")]
    if not pairs:
        return {"n": 0, "ratio": float("nan"), "low": float("nan"), "high": float("nan")}
    logs = [math.log(a["decode_tps"] / b["decode_tps"]) for a, b in pairs]
    m = statistics.mean(logs)
    se = statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else float("nan")
    return {"n": len(logs), "ratio": math.exp(m), "low": math.exp(m - 1.96 * se),
            "high": math.exp(m + 1.96 * se)}


def summary(res: dict[str, list[dict]]) -> dict[str, dict]:
    """Per arm: paired ratio against the first arm, mean tokens a cycle, verify window, id diffs."""
    ref = next(iter(res))
    out = {}
    for name, gens in res.items():
        row: dict = {"vs": ref, **paired(res, name, ref)}
        for k in ("tokens_per_cycle", "mean_verify_window", "acceptance"):
            vals = [g[k] for g in gens if g.get(k) is not None]
            row[k] = statistics.mean(vals) if vals else None
        row["id_diffs"] = sum(not g.get("same_ids", True) for g in gens)
        if row["id_diffs"]:  # the comparison on equal texts only, against the reference and each arm
            row["same_text"] = {other: paired(res, name, other, same_text=True)
                                for other in res if other != name}
        out[name] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", default=None, help="default: the registry's draft for the model")
    ap.add_argument("--arm", action="append", default=None, metavar="NAME:KEY=VALUE,...",
                    help="an arm (repeat; default: whole:cut=0 and cut:cut=2)")
    ap.add_argument("--baseline", action="store_true", help="mlx-lm's decoding as the first arm")
    ap.add_argument("--heldout", type=int, default=7, help="held-out prompts after the 5 questions")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--warmup", type=int, default=1, help="untimed answers of the first question per arm")
    ap.add_argument("--tolerate-id-diffs", action="store_true",
                    help="count answers that differ from the first arm's instead of stopping (bf16)")
    ap.add_argument("--teach", action="store_true",
                    help="every DFlash arm decodes mlx-lm's text of each prompt (needs --baseline)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from dflash.engine import accel

    accel.maybe_reexec()  # MKL preloaded on the CPU, as `dflash benchmark` runs (no return then)
    if a.teach and not a.baseline:
        ap.error("--teach times the arms on mlx-lm's texts: give --baseline too")
    try:
        arms = [parse_arm(s) for s in (a.arm or ["whole:cut=0", "cut:cut=2"])]
    except ValueError as e:
        ap.error(str(e))
    try:
        pair = load_for_arms(a.model, a.draft, a.dtype, arms)
    except ValueError as e:
        ap.error(str(e))
    attach_drafters(pair, arms, a.dtype)
    prompts = [pair.tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                  add_generation_prompt=True)
               for q in questions(a.heldout)]
    from dflash.engine.bench.environment import hardware_info, versions

    machine = {"hardware": hardware_info(), "versions": versions(),
               "env": {k: os.environ.get(k) for k in ENV_NOTED},
               "measured": "in one process, every arm answering each prompt in a shuffled order "
                           "each round: cache lengths revisited, not first-time (--warmup untimed)"}

    def write(res: dict[str, list[dict]]) -> None:
        if a.out:
            Path(a.out).write_text(json.dumps({
                "model": a.model, "draft": a.draft, "arms": {x.name: x.settings for x in arms},
                "baseline": a.baseline, "rounds": a.rounds, "warmup": a.warmup, "heldout": a.heldout,
                "max_tokens": a.max_tokens, "dtype": a.dtype, "teach": a.teach,
                "summary": summary(res), **machine,
                "runs": res},
                indent=1))

    if a.teach:
        machine["measured"] += ("; every DFlash arm teacher-forced to mlx-lm's text of each prompt "
                                "(--teach: its own target passes, mlx-lm's ids)")
    res = run(pair, prompts, arms, a.rounds, a.max_tokens, a.baseline, a.tolerate_id_diffs,
              a.warmup, on_round=write, log=lambda line: print(line, flush=True), teach=a.teach)
    for name, row in summary(res).items():
        print(f"{name:>10}: {row['ratio']:.3f}x of {row['vs']} decode tok/s (95% interval "
              f"{row['low']:.3f}-{row['high']:.3f}, {row['n']} pairs)"
              + (f", {row['tokens_per_cycle']:.2f} tokens a cycle, verify window "
                 f"{row['mean_verify_window']:.1f}" if row["tokens_per_cycle"] is not None else "")
              + (f", {row['id_diffs']} answers differ" if row["id_diffs"] else ""))
        for other, st in row.get("same_text", {}).items():
            if st["n"]:
                print(f"{'':>12}on the same text as {other}: {st['ratio']:.3f}x of it "
                      f"({st['low']:.3f}-{st['high']:.3f}, {st['n']} pairs)")


if __name__ == "__main__":
    main()
