"""The `dflash benchmark` command: its options, checked before any model loads.

Why a module of its own: the click command that `dflash benchmark` (engine/cli.py) and
`python -m dflash.engine.bench` run; `finite_option` and `window_option` also check
`dflash generate`'s options, `nonempty_option` `dflash eval-draft`'s --out.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Callable

import click

from .run import run_benchmark
from .setup import DEFAULT_OUT, DTYPES, RANDOM_SHAPES, BenchConfig


def _contexts(_ctx: Any, _param: Any, value: str) -> list[int]:
    try:
        vals = [int(v) for v in value.replace(" ", "").split(",") if v]
    except ValueError:
        raise click.BadParameter("comma-separated integers, e.g. 1024,2048") from None
    if not vals or min(vals) < 1:
        raise click.BadParameter("at least one positive context length")
    return vals


def nonempty_option(what: str) -> Callable[[Any, Any, str | None], str | None]:
    """A callback refusing an empty path option (an unset variable: `--out "$DIR"`), which
    would mean the current directory or nothing at all; `what` the option must name."""

    def check(_ctx: Any, _param: Any, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise click.BadParameter(f"must name {what}, not be empty")
        return value

    return check


def finite_option(_ctx: Any, _param: Any, value: float | None) -> float | None:
    """nan passes click's float ranges (every comparison with it is false), inf sleeps forever:
    refused as the option's value."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number")
    return value


def window_option(_ctx: Any, _param: Any, value: str) -> str:
    """--verify-window's form (auto, full, a count >= 1) checked as an option, before any model
    loads; whether the draft's block and the target's caches take it is checked once loaded."""
    from ...daemon.protocol import shown
    from ..window import fixed_window

    try:
        fixed_window(value, 1 << 30)
    except ValueError:
        raise click.BadParameter(f"auto, full or a number of tokens >= 1 (1 = plain decoding); "
                                 f"got {shown(value)}") from None
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
              help="Prompt lengths in tokens, comma-separated (not used with --chat); each plus "
                   "--max-tokens within the target's context.")
@click.option("--max-tokens", default=256, show_default=True, type=click.IntRange(1))
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1))
@click.option("--warmup", default=1, show_default=True, type=click.IntRange(0),
              help="Untimed runs of both engines per context before the timed ones.")
@click.option("--warmup-context", default=0, show_default=True, type=click.IntRange(0),
              help="Warm up on the built-in text cut to this many tokens instead of each row's "
                   "own prompt (0: the row's prompt). With --chat, one question and --repeats 1, "
                   "every timed run is at first-time cache lengths (DFlash runs first).")
@click.option("--cooldown", default=5.0, show_default=True, type=click.FloatRange(0),
              callback=finite_option, help="Seconds to sleep between runs.")
@click.option("--dtype", type=click.Choice(list(DTYPES)), default=None,
              help="Cast target and draft (default: as stored; random target: bf16 GPU, fp32 CPU).")
@click.option("--out", default=DEFAULT_OUT, show_default=True, callback=nonempty_option("the results folder"),
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
@click.option("--min-p", default=0.0, show_default=True, type=click.FloatRange(0, 1), callback=finite_option,
              help="Sampling: keep the tokens at least this fraction as likely as the most likely one "
                   "(0 = off), for both engines.")
@click.option("--min-tokens-to-keep", default=1, show_default=True, type=click.IntRange(min=1),
              help="Sampling with --min-p: the most likely tokens min-p always keeps, for both engines.")
@click.option("--first-time-lengths/--no-first-time-lengths", default=True, show_default=True,
              help="Every timed run at cache lengths never run before in the process (its own "
                   "prompt length); off: one prompt re-run by every run (the old method; --chat "
                   "runs so, unless --process-per-run).")
@click.option("--process-per-run", is_flag=True,
              help="With --chat: each repeat of each question in a process of its own, warmed up "
                   "on text elsewhere (--warmup-context; default 2 x --max-tokens + 512), DFlash "
                   "first, so every DFlash run is at first-time cache lengths; one JSON for all.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, (1 << 63) - 1),
              help="Random prompt ids and random weights (--random-target), and the sampling "
                   "draws of each run.")
@click.option("--no-plot", is_flag=True, help="Do not draw the PNG plot.")
def benchmark_command(no_plot: bool, **kwargs: Any) -> None:
    """Benchmark DFlash against mlx-lm's stream_generate, side by side, in one process.

    Writes one JSON (and a PNG plot) into --out and prints its path. Ctrl-C (or SIGTERM, as
    `timeout` sends) stops it and still writes what was measured ("interrupted": true), exit
    status 130.
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
