"""`run_benchmark`: the whole `dflash benchmark` protocol, from a config to a written result.

Why a module of its own: it ties the pieces together in order (checks before any model loads,
the setup, every row of rows.py, the JSON of results.py, the table and plot of plot.py) and
keeps what was measured when Ctrl-C or SIGTERM stops the runs.
"""

from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx

from .. import accel, rollback
from ..launch import stops_once
from .results import _mode_line, _result, _write, results_folder
from .rows import (
    Bench,
    Log,
    _in_order,
    _window,
    run_context_fresh,
    run_context_same,
)
from .setup import (
    BenchConfig,
    Setup,
    build_setup,
    chat_prompts,
    chat_questions,
    check_contexts,
    prompt_text,
)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during the runs: what was measured is written all the same (`path`)."""

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
    if cfg.process_per_run and (not cfg.chat or cfg.oracle):
        raise ValueError("--process-per-run is for --chat questions (not --oracle)")
    if cfg.warmup_context and (cfg.oracle or not (cfg.chat or not cfg.first_time_lengths)):
        raise ValueError("--warmup-context is for prompts re-run by every run (--chat, or "
                         "--no-first-time-lengths), not --oracle")
    if cfg.random_target and cfg.draft_layers == 0 and not cfg.oracle:
        raise ValueError("DFlash mode needs a draft (give --draft, or --draft-layers > 0)")


def check_setup(cfg: BenchConfig, setup: Setup) -> None:
    """What the loaded pair decides, checked before the first run: a draft to run, one made for
    this target (else refused only when its first run starts, after the baseline's), a window
    its block and the target's caches can take."""
    from ..drafters import check_fit
    from ..window import fixed_window

    if not cfg.oracle and setup.draft_model is None:
        raise ValueError("DFlash mode needs a draft (give --draft, or --draft-layers > 0)")
    if setup.draft_model is not None:
        check_fit(setup.draft_model, setup.target)
    fixed_window(_window(cfg), setup.block_size,
                 rollback.plain_step_undoable(setup.target.make_cache()))


def run_benchmark(cfg: BenchConfig, log: Log = print) -> tuple[dict, Path]:
    """Run the whole protocol; write the JSON (and plot); return (result, json path).

    Ctrl-C or SIGTERM during the runs writes what was measured (`interrupted: true`: the
    finished rows, and every finished timed run) and raises Interrupted with its path."""
    check_config(cfg)
    text = prompt_text(cfg)
    check_contexts(cfg)  # reads the target's config only: before any weights load
    with results_folder(cfg.out), stops_once():
        if cfg.process_per_run:
            from .apart import run_apart

            return run_apart(cfg, chat_questions(text), log)
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
        log("== interrupted (Ctrl-C or SIGTERM) before any timed run finished: nothing written")
        raise KeyboardInterrupt
    result = _result(cfg, setup, mode_line, runs, summary, fresh, interrupted)
    stopped = (f"== interrupted (Ctrl-C or SIGTERM): {len(summary)} finished row(s), {len(runs)} timed run(s) "
               "kept") if interrupted else None
    path = publish(result, cfg, setup.name, log, stopped)
    if interrupted:
        raise Interrupted(path)
    return result, path


def publish(result: dict, cfg: BenchConfig, name: str, log: Log, stopped: str | None = None) -> Path:
    """Print the result's table, write it and print its path, and draw its plot unless the runs
    were stopped (`stopped`: the line that says so); the one ending of every benchmark, in one
    process or merged from several (apart.py). The table comes first: a result that cannot be
    written is still on the screen."""
    from .plot import format_table, plot

    if result["summary"]:
        log(format_table(result))
    path = _write(result, cfg, name)
    if stopped:
        log(stopped)
    log(f"== results: {path}")
    if not stopped and cfg.plot:
        log(f"== plot: {plot(result, path.with_suffix('.png'))}")
    return path


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
        for qi, (run_row, arg) in enumerate(rows):
            bench.timed = []
            ctx_runs, row = run_row(bench, arg, temp)
            if cfg.chat:  # which question (0-based), as --process-per-run's merged rows say
                row["question"] = qi
                for rec in ctx_runs:
                    rec["question"] = qi
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
