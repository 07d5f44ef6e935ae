"""`dflash benchmark`: DFlash against mlx-lm's own greedy decoding, side by side, in one process.

Why one process and this protocol: speed numbers from different processes, prompts or warm-up
states are not comparable. For every context length both engines get the same prompt token ids,
the same max_tokens and greedy decoding; a warm-up pair runs first (a fresh process pays kernel
compilation on its first calls), then timed runs alternate baseline/DFlash with a cooldown sleep
between them, and the summary takes medians. Every DFlash run's token ids are compared with the
baseline run of the same repeat: losslessness is measured, not assumed.

`--oracle` swaps the draft for `OracleDrafter` replaying the baseline's ids (every draft accepted):
the engine's ceiling, labelled as such everywhere. `--random-target SHAPE` builds a random-weight
target of a named shape in memory, for speed-only numbers on machines without weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
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
from typing import Any, Callable, Sequence

import click
import mlx.core as mx

from . import rollback
from . import tape as tape_mod
from .benchsetup import (
    DTYPES,
    RANDOM_SHAPES,
    BenchConfig,
    Setup,
    build_setup,
    chat_prompts,
    make_drafter,
    prompt_ids,
)
from .drafters import Drafter
from .generate import Finished, stream_dflash_generate
from .target import TargetModel

Log = Callable[[str], None]
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


def run_baseline(setup: Setup, ids: list[int], max_tokens: int) -> tuple[list[int], dict]:
    """mlx-lm's stream_generate, greedy (its default sampler is argmax), on the same model."""
    from mlx_lm.generate import stream_generate

    eos = setup.tokenizer.eos_token_ids
    mx.synchronize()
    mx.reset_peak_memory()
    out: list[int] = []
    reason = ""
    self_tps = 0.0
    t_first: float | None = None
    t0 = time.perf_counter()
    for r in stream_generate(setup.target.model, setup.tokenizer, mx.array(ids), max_tokens):
        if t_first is None:
            t_first = time.perf_counter()
        reason = r.finish_reason or reason
        self_tps = r.generation_tps
        if not (r.finish_reason == "stop" and r.token in eos):
            out.append(int(r.token))
    t_end = time.perf_counter()
    mx.synchronize()  # its pipelined loop may hold one discarded step in flight
    rec = _timing(len(ids), out, t0, t_first or t_end, t_end)
    rec.update(peak_memory_gb=mx.get_peak_memory() / 1e9, finish_reason=reason,
               self_reported_decode_tps=self_tps)  # mlx-lm's own generation_tps
    return out, rec


def _window(cfg: BenchConfig) -> str:
    """The oracle measures the ceiling: always the whole block."""
    return "full" if cfg.oracle else cfg.verify_window


def run_dflash(
    setup: Setup, drafter: Drafter, ids: list[int], max_tokens: int, window: str = "auto"
) -> tuple[list[int], dict]:
    """stream_dflash_generate on the same prompt ids, timed with the baseline's clock."""
    mx.synchronize()
    final: Finished | None = None
    t_first: float | None = None
    t0 = time.perf_counter()
    gen = stream_dflash_generate(
        setup.target, drafter, setup.tokenizer, ids, max_tokens, verify_window=window
    )
    for ev in gen:
        if isinstance(ev, Finished):
            final = ev
        elif t_first is None and ev.token_ids:
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    mx.synchronize()
    assert final is not None
    s = final.stats
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
        engine_stats=s.to_dict(),
    )
    return list(final.token_ids), rec


def compare_ids(got: list[int], want: list[int]) -> dict:
    """Losslessness of one DFlash run against the baseline run of the same repeat."""
    mismatch = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if mismatch is None and len(got) != len(want):
        mismatch = min(len(got), len(want))
    return {"lossless": mismatch is None, "first_mismatch": mismatch}


# --- t(verify) / t(decode step) -----------------------------------------------------------------
def time_forward(
    target: TargetModel, ids: list[int], block: int, iters: int = 10, warmup: int = 3,
    chunk: int = 512,
) -> dict:
    """Median time of one target forward over M=block tokens vs M=1 on a cache of len(ids).

    This is the cost model of speculative decoding: a cycle pays one M=block forward instead of
    tokens_per_cycle M=1 steps. Each forward is synced (mx.eval) and then rewound.
    """
    caches = target.make_cache()
    for s in range(0, len(ids), chunk):
        logits, _ = target.forward(mx.array(ids[s : s + chunk], dtype=mx.int32)[None], caches)
        mx.eval(logits[:, -1], [c.state for c in caches])
    record = rollback.needs_tape(caches)
    keep = 1 if record else 0  # a recurrent state is replayed over >= 1 step
    vocab = target.vocab_size

    def once(m: int) -> float:
        toks = mx.array([(7 * j + 11) % vocab for j in range(m)], dtype=mx.int32)[None]
        tp = tape_mod.Tape() if record else None
        t0 = time.perf_counter()
        with tape_mod.recording(tp):
            logits, feats = target.forward(toks, caches)
        mx.eval(mx.argmax(logits[0], axis=-1), feats)
        dt = time.perf_counter() - t0
        rollback.rewind(caches, target.layers, keep, m, tp)
        return dt

    for _ in range(warmup):
        once(1)
        once(block)
    step, ver = [], []
    for _ in range(iters):  # interleaved, so drift hits both alike
        step.append(once(1))
        ver.append(once(block))
    t1, tb = statistics.median(step), statistics.median(ver)
    return {"block_size": block, "step_ms": t1 * 1e3, "verify_ms": tb * 1e3, "ratio": tb / t1,
            "iters": iters}


# --- the benchmark ------------------------------------------------------------------------------
def _median(runs: list[dict], key: str) -> float:
    vals = [r[key] for r in runs if key in r]
    return statistics.median(vals) if vals else float("nan")


def summarize(ctx: int, base: list[dict], dfl: list[dict], fwd: dict | None) -> dict:
    """Medians over the timed repeats of one context length."""
    b_tps, d_tps = _median(base, "decode_tps"), _median(dfl, "decode_tps")
    hist: list[int] = []
    for r in dfl:
        h = r["accept_histogram"]
        hist = [a + b for a, b in zip(hist, h)] if hist else list(h)
    return {
        "context": ctx,
        "baseline_decode_tps": b_tps,
        "dflash_decode_tps": d_tps,
        "speedup": d_tps / b_tps if b_tps > 0 else float("nan"),
        "baseline_e2e_tps": _median(base, "e2e_tps"),
        "dflash_e2e_tps": _median(dfl, "e2e_tps"),
        "acceptance": _median(dfl, "acceptance"),
        "tokens_per_cycle": _median(dfl, "tokens_per_cycle"),
        "accept_histogram": hist,
        "baseline_ttft_s": _median(base, "ttft_s"),
        "dflash_ttft_s": _median(dfl, "ttft_s"),
        "baseline_prefill_tps": _median(base, "prefill_tps"),
        "dflash_prefill_tps": _median(dfl, "prefill_tps"),
        "generated_tokens": int(_median(dfl, "generated_tokens")),
        "lossless": all(r["lossless"] for r in dfl),
        "forward": fwd,
    }


def settle_oracle(
    setup: Setup, cfg: BenchConfig, ids: list[int], baseline_ids: list[int], max_iters: int = 8
) -> tuple[list[int], dict]:
    """The ids the oracle replays: the baseline's, or DFlash's own if verify numerics differ.

    In low precision a block-of-B verify can round a near-tie differently from a 1-token decode
    step; the baseline's ids then stop matching at that token and the "ceiling" would collapse
    into rejections. Replaying DFlash's own output until it reproduces itself keeps every draft
    accepted. Losslessness is still judged against the baseline, run by run.
    """
    ref = list(baseline_ids)
    for i in range(max_iters + 1):
        out, _ = run_dflash(setup, make_drafter(setup, cfg, ref, len(ids)), ids, cfg.max_tokens, _window(cfg))
        if out == ref:
            break
        ref = out
    info = {"iterations": i, "converged": out == ref, "matches_baseline": ref == baseline_ids}
    info["first_divergence_from_baseline"] = compare_ids(ref, baseline_ids)["first_mismatch"]
    return ref, info


def run_context(
    setup: Setup, cfg: BenchConfig, ids: list[int], log: Log
) -> tuple[list[dict], dict]:
    """Warm-up, then `repeats` alternating timed pairs, then the forward timing, for one prompt."""
    ctx = len(ids)
    tag = "ORACLE" if cfg.oracle else "dflash"
    log(f"-- context {ctx}: warm-up x{cfg.warmup}")
    base_ids: list[int] = []
    for _ in range(cfg.warmup):
        base_ids, _ = run_baseline(setup, ids, cfg.max_tokens)
        if not cfg.oracle:  # the oracle's settling runs below are its warm-up
            run_dflash(setup, make_drafter(setup, cfg, base_ids, ctx), ids, cfg.max_tokens, _window(cfg))
        time.sleep(cfg.cooldown)
    reference, settle = base_ids, None
    if cfg.oracle:
        reference, settle = settle_oracle(
            setup, cfg, ids, base_ids or run_baseline(setup, ids, cfg.max_tokens)[0]
        )
        if not settle["matches_baseline"]:
            log(f"   ctx {ctx}: oracle replays DFlash's own ids (verify differs from decode at "
                f"token {settle['first_divergence_from_baseline']}; settled in "
                f"{settle['iterations']} runs, converged {settle['converged']})")
        time.sleep(cfg.cooldown)

    runs: list[dict] = []
    base_runs, dfl_runs = [], []
    for r in range(cfg.repeats):
        order = ("baseline", "dflash") if r % 2 == 0 else ("dflash", "baseline")
        got: dict[str, tuple[list[int], dict]] = {}
        for eng in order:
            if eng == "baseline":
                got[eng] = run_baseline(setup, ids, cfg.max_tokens)
            else:
                drafter = make_drafter(setup, cfg, reference, ctx)
                got[eng] = run_dflash(setup, drafter, ids, cfg.max_tokens, _window(cfg))
            rec = got[eng][1]
            extra = ""
            if eng == "dflash":
                extra = (f" | accept {rec['acceptance']:.1%}, "
                         f"{rec['tokens_per_cycle']:.2f} tok/cycle")
            log(f"   ctx {ctx} repeat {r + 1}/{cfg.repeats} {tag if eng == 'dflash' else eng:>8}: "
                f"{rec['decode_tps']:8.1f} tok/s | TTFT {rec['ttft_s'] * 1e3:7.0f} ms{extra}")
            time.sleep(cfg.cooldown)
        (b_ids, b_rec), (d_ids, d_rec) = got["baseline"], got["dflash"]
        d_rec.update(compare_ids(d_ids, b_ids))
        if not d_rec["lossless"]:
            log(f"   !! ctx {ctx} repeat {r + 1}: DFlash ids differ from the baseline's at "
                f"token {d_rec['first_mismatch']}")
        for eng, (tok_ids, rec) in got.items():
            rec.update(context=ctx, repeat=r, engine=eng,
                       mode=cfg.mode if eng == "dflash" else "baseline",
                       token_ids_sha1=_ids_hash(tok_ids))
        runs += [b_rec, d_rec]
        base_runs.append(b_rec)
        dfl_runs.append(d_rec)

    fwd = None
    if cfg.verify_iters > 0:
        fwd = time_forward(setup.target, ids, setup.block_size, cfg.verify_iters)
        log(f"   ctx {ctx} forward: M={setup.block_size} {fwd['verify_ms']:.2f} ms vs M=1 "
            f"{fwd['step_ms']:.2f} ms -> t(verify)/t(step) = {fwd['ratio']:.2f}")
    row = summarize(ctx, base_runs, dfl_runs, fwd)
    if settle is not None:
        row["oracle_reference"] = settle
    return runs, row


def run_benchmark(cfg: BenchConfig, log: Log = print) -> tuple[dict, Path]:
    """Run the whole protocol; write the JSON (and plot); return (result, json path)."""
    if cfg.repeats < 1 or cfg.max_tokens < 1 or not cfg.contexts:
        raise ValueError("need repeats >= 1, max_tokens >= 1 and at least one context length")
    t_setup = time.perf_counter()
    setup = build_setup(cfg)
    # Raw prompts ignore EOS: every run generates exactly max_tokens (comparable tok/s). Chat
    # answers stop at EOS: past it a model loops on its last turn, which any draft predicts
    # (95% acceptance measured) and no user ever sees.
    if not (cfg.respect_eos or cfg.chat):
        setup.tokenizer.eos_token_ids = set()
    text = Path(cfg.prompt_file).read_text() if cfg.prompt_file else None
    mode_line = _mode_line(cfg, setup)
    log(f"== dflash benchmark | MODE: {mode_line}")
    log(f"== {setup.description} | dtype {setup.dtype} | device {mx.default_device()} | "
        f"block {setup.block_size} | setup {time.perf_counter() - t_setup:.1f} s")

    runs: list[dict] = []
    summary: list[dict] = []
    if cfg.chat:
        prompts = chat_prompts(setup, text)
    else:
        prompts = [prompt_ids(setup, ctx, text, cfg.seed) for ctx in cfg.contexts]
    for ids in prompts:
        ctx_runs, row = run_context(setup, cfg, ids, log)
        runs.extend(ctx_runs)
        summary.append(row)

    result = {
        "mode": cfg.mode,
        "mode_description": mode_line,
        "model": setup.name,
        "setup": setup.description,
        "dtype": setup.dtype,
        "block_size": setup.block_size,
        "capture_layer_ids": setup.target.layer_ids,
        "created": datetime.now().isoformat(timespec="seconds"),
        "hardware": hardware_info(),
        "versions": versions(),
        "config": dataclasses.asdict(cfg),
        "lossless": all(r["lossless"] for r in runs if r["engine"] == "dflash"),
        "runs": runs,
        "summary": summary,
    }
    path = _write(result, cfg, setup)
    from .benchplot import format_table, plot

    log(format_table(result))
    log(f"== results: {path}")
    if cfg.plot:
        note = plot(result, path.with_suffix(".png"))
        log(f"== plot: {note}")
    return result, path


def _mode_line(cfg: BenchConfig, setup: Setup) -> str:
    if not cfg.oracle:
        return "dflash (real draft proposals)"
    cost = ("the draft still runs every cycle, its cost included"
            if setup.draft_model is not None else "no draft compute at all")
    return (f"ORACLE: draft proposals replaced by the baseline's own greedy ids (every draft "
            f"accepted; the engine's ceiling, NOT a real draft's speed); {cost}")


def _write(result: dict, cfg: BenchConfig, setup: Setup) -> Path:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "-".join([cfg.label or setup.name, cfg.mode, socket.gethostname(),
                     datetime.now().strftime("%Y%m%d-%H%M%S")])
    path = out / (re.sub(r"[^A-Za-z0-9._-]+", "-", stem) + ".json")
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
    blas = {k: os.environ[k] for k in ("LD_PRELOAD", "MKL_THREADING_LAYER") if k in os.environ}
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


@click.command("benchmark")
@click.option("--model", default=None, help="Target model directory (mlx-lm format).")
@click.option("--draft", default=None, help="Draft directory (optional with --oracle).")
@click.option("--random-target", type=click.Choice(list(RANDOM_SHAPES)), default=None,
              help="Build a random-weight target of this shape in memory instead of --model.")
@click.option("--draft-layers", default=5, show_default=True, type=click.IntRange(0),
              help="Random target: layers of the random draft (0 = none).")
@click.option("--block-size", default=16, show_default=True, type=click.IntRange(2),
              help="Block size when no draft fixes it (random draft, oracle without draft).")
@click.option("--oracle", is_flag=True,
              help="Replace draft proposals by the baseline's greedy ids (the ceiling).")
@click.option("--oracle-draft-cost/--no-oracle-draft-cost", default=True, show_default=True,
              help="Oracle mode: still run the draft (if any) so its cost is timed.")
@click.option("--contexts", default="1024,2048,4096,8192", show_default=True, callback=_contexts,
              help="Prompt lengths in tokens, comma-separated.")
@click.option("--max-tokens", default=256, show_default=True, type=click.IntRange(1))
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1))
@click.option("--warmup", default=1, show_default=True, type=click.IntRange(0),
              help="Untimed runs of both engines per context before the timed ones.")
@click.option("--cooldown", default=5.0, show_default=True, type=click.FloatRange(0),
              help="Seconds to sleep between runs.")
@click.option("--dtype", type=click.Choice(list(DTYPES)), default=None,
              help="Cast target and draft (default: as stored; random target: bf16 GPU, fp32 CPU).")
@click.option("--out", default="benchmark/results", show_default=True, help="Output folder.")
@click.option("--prompt-file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Text to build prompts from (repeated/trimmed); default: built-in prose. "
                   "With --chat: one question per line.")
@click.option("--chat", is_flag=True,
              help="Chat questions through the model's chat template, one row each (built-in "
                   "ones or --prompt-file lines) instead of raw text cut to --contexts.")
@click.option("--label", default=None, help="Name for the result files (default: model name).")
@click.option("--respect-eos", is_flag=True,
              help="Stop at EOS (default: ignore it, so all runs have the same length).")
@click.option("--verify-iters", default=10, show_default=True, type=click.IntRange(0),
              help="Timed iterations of the M=block vs M=1 forward (0 = skip).")
@click.option("--verify-window", default="auto", show_default=True,
              help="Tokens per verify: auto, full, or a number (oracle mode: always full).")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--no-plot", is_flag=True, help="Do not draw the PNG plot.")
def benchmark_command(no_plot: bool, **kwargs: Any) -> None:
    """Benchmark DFlash against mlx-lm's greedy stream_generate, side by side, in one process."""
    if not kwargs["model"] and not kwargs["random_target"]:
        raise click.UsageError("give --model PATH or --random-target SHAPE")
    cfg = BenchConfig(**kwargs, plot=not no_plot)
    try:
        run_benchmark(cfg, log=lambda s: click.echo(s))
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from e



if __name__ == "__main__":  # `python -m dflash.engine.benchmark ...`, without the full CLI
    benchmark_command()
