"""`dflash benchmark --chat --process-per-run`: chat questions at first-time cache lengths.

Why a module of its own: `--chat` re-runs each question's prompt, so every run after the first
decodes at (tokens, cache length) shapes its process has run before, and a per-shape cache (the
cuDNN attention graphs of MLX-CUDA, which dflash turns off by default) could flatter it. A chat
question cannot be moved to a fresh length without changing its text, and a 16-token verify may
land anywhere in the answer's range, so two runs share no process here: each repeat of each
question runs in a process of its own, warmed up on the built-in text at `--warmup-context`
tokens (far from the question's range), DFlash first (every shape new), the baseline after it
(it can only revisit DFlash's single-token steps, which flatters the baseline if anything). The
ledger in each child still checks every run; this parent merges the children's JSON into one
result of the usual form (one summary row per question, every run, the method), so the table,
the plot and the goal's numbers read as for any other `dflash benchmark`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

from .rows import _in_order, summarize
from .setup import BenchConfig

Log = Callable[[str], None]
CHILD = "dflash.engine.bench.apart"  # `python -m` target of each child process


def warmup_context(cfg: BenchConfig) -> int:
    """--warmup-context, or a length whose runs stay clear of a chat question's (a prompt of
    tens to hundreds of tokens plus --max-tokens)."""
    return cfg.warmup_context or 2 * cfg.max_tokens + 512


class ChildFailed(ValueError):
    """A child benchmark process exited non-zero (its own output says why): a clear error of
    the command, as a bad option is."""


def child_configs(cfg: BenchConfig, questions: list[str], work: Path) -> list[tuple[int, int, BenchConfig]]:
    """(repeat, question index, the child's config) in run order: repeat by repeat, so a machine
    that drifts moves every question alike."""
    out = []
    for r in range(cfg.repeats):
        for qi, question in enumerate(questions):
            qfile = work / f"q{qi}.jsonl"
            qfile.write_text(json.dumps({"prompt": question}) + "\n")
            child = dataclasses.replace(
                cfg, prompt_file=str(qfile), repeats=1, out=str(work / f"r{r}-q{qi}"),
                plot=False, process_per_run=False,
                warmup_context=warmup_context(cfg),
                label=f"r{r}-q{qi}")
            out.append((r, qi, child))
    return out


def run_child(cfg: BenchConfig) -> dict:
    """One child process; its result JSON."""
    cfg_file = Path(cfg.out + ".config.json")
    cfg_file.parent.mkdir(parents=True, exist_ok=True)
    cfg_file.write_text(json.dumps(dataclasses.asdict(cfg)))
    rc = subprocess.call([sys.executable, "-m", CHILD, str(cfg_file)])
    if rc == 130:
        raise KeyboardInterrupt
    if rc != 0:
        why = error_file(cfg)
        raise ChildFailed(f"the benchmark process for {cfg.label} exited with status {rc}"
                          + (f": {why.read_text()}" if why.is_file() else ""))
    found = sorted(Path(cfg.out).glob("*.json"))
    if len(found) != 1:
        raise ChildFailed(f"the benchmark process for {cfg.label} wrote {len(found)} results, not one")
    return json.loads(found[0].read_text())


def error_file(cfg: BenchConfig) -> Path:
    """Where a child leaves the one line `dflash benchmark` would have said for its error, for
    the parent to say (the child's own traceback was the user's only clue)."""
    return Path(cfg.out + ".error")


def merge(cfg: BenchConfig, children: list[tuple[int, int, dict]], interrupted: bool) -> dict:
    """One result from the children's: their runs (repeat = the child's repeat, `question` =
    its index), a summary row per (question, temperature), the method of a process per run."""
    first = children[0][2]
    result = copy.deepcopy(first)
    runs: list[dict] = []
    rows: dict[tuple[int, float], list[dict]] = {}
    forward: dict[tuple[int, float], dict | None] = {}
    for r, qi, child in children:
        for run in child["runs"]:
            run = dict(run, repeat=r, question=qi)
            runs.append(run)
            rows.setdefault((qi, run["temperature"]), []).append(run)
        for row in child["summary"]:
            forward.setdefault((qi, row["temperature"]), row["forward"])
    summary = []
    for (qi, temp), qruns in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        base = _in_order([x for x in qruns if x["engine"] == "baseline"])
        dfl = _in_order([x for x in qruns if x["engine"] == "dflash"])
        if not base or not dfl:
            continue
        row = summarize(base[0]["context"], base, dfl, forward[(qi, temp)], temp)
        row["question"] = qi
        summary.append(row)
    dfl_runs = [x for x in runs if x["engine"] == "dflash"]
    greedy = [x["lossless"] for x in dfl_runs if x.get("lossless") is not None]
    result.update(
        created=first["created"], interrupted=interrupted, config=dataclasses.asdict(cfg),
        runs=runs, summary=summary, lossless=all(greedy) if greedy else None)
    m = result["method"]
    m.update(
        process_per_run=True,
        processes=len(children),
        first_time_lengths=True,
        first_time_verified=all(x.get("first_time") for x in dfl_runs),
        revisited_runs=sum(1 for x in runs if not x.get("first_time")),
        revisited_widths=sorted({w for x in runs for w in x["shapes"]["revisited_widths"]}),
        repeats=cfg.repeats,
        order="a process per repeat of each question, repeat by repeat; in each, DFlash first, "
              "then the baseline on the same prompt",
        shape_rule=m["shape_rule"] + "; first_time_verified counts the DFlash runs (each "
                   "baseline may revisit its process's DFlash single-token steps: "
                   "revisited_widths)")
    return result


def run_apart(cfg: BenchConfig, questions: list[str], log: Log) -> tuple[dict, Path]:
    """Every (repeat, question) in a child process; the merged result written to --out."""
    children: list[tuple[int, int, dict]] = []
    stopped: BaseException | None = None  # Ctrl-C or a failed child: what finished is written
    with tempfile.TemporaryDirectory(prefix="dflash-apart-") as tmp:
        plan = child_configs(cfg, questions, Path(tmp))
        log(f"== {len(plan)} processes: {cfg.repeats} repeat(s) of {len(questions)} question(s), "
            f"each warmed up on {warmup_context(cfg)} tokens of text")
        try:
            for i, (r, qi, child) in enumerate(plan):
                log(f"== process {i + 1}/{len(plan)}: repeat {r + 1}, question {qi + 1}")
                children.append((r, qi, run_child(child)))
        except (KeyboardInterrupt, ChildFailed) as e:
            stopped = e
            if not children:
                log("== stopped before any process finished: nothing written")
                raise
    from .run import Interrupted, publish

    result = merge(cfg, children, stopped is not None)
    note = (f"== stopped: {len(children)} of {len(plan)} process(es) finished"
            if stopped is not None else None)
    path = publish(result, cfg, result["model"], log, note)
    if isinstance(stopped, ChildFailed):
        raise ValueError(f"{stopped}; the {len(children)} finished process(es) are in {path}")
    if stopped is not None:
        raise Interrupted(path)
    return result, path


def main(argv: list[str]) -> int:
    """A child: the config file's benchmark, in this process."""
    from .run import run_benchmark

    (cfg_file,) = argv
    cfg = BenchConfig(**json.loads(Path(cfg_file).read_text()))
    try:
        run_benchmark(cfg)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as e:  # what the command says in one line: the parent says it
        error_file(cfg).write_text(str(e))
        return 1
    return 0


if __name__ == "__main__":
    from .. import accel

    accel.maybe_reexec()
    sys.exit(main(sys.argv[1:]))
