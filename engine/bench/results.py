"""What `dflash benchmark` writes: the result JSON, its method record, its file and folder.

Why a module of its own: everything about the saved result (the setup, the method, the machine,
every run, the summary; a file name that never overwrites another; an --out refused before the
runs) in one place, apart from how the runs are measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import socket
from datetime import datetime
from pathlib import Path
from typing import Iterator

from .. import accel
from ..drafters import short_block_max
from ..window import wide_windows
from .environment import hardware_info, versions
from .setup import BenchConfig, Setup


def method(cfg: BenchConfig, setup: Setup, runs: list[dict], first_time_used: bool) -> dict:
    """How the numbers were measured, in the JSON next to them."""
    return {
        "first_time_lengths": first_time_used,
        "first_time_verified": all(r.get("first_time") for r in runs),
        "revisited_runs": sum(1 for r in runs if not r.get("first_time")),
        "shape_rule": "a run is first-time when none of its decode forwards (tokens, cache "
                      "offset >= prompt length) was run before in this process",
        "warmup_runs": cfg.warmup,
        "warmup_context": cfg.warmup_context or None,  # None: warm-up on each row's own prompt
        "repeats": cfg.repeats,
        "statistic": "median over repeats (every run in runs[]); speedup_paired: the median of "
                     "each repeat's dflash/baseline ratio",
        "order": ("alternating dflash/baseline per repeat, dflash first" if cfg.warmup_context
                  else "alternating baseline/dflash per repeat"),
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
        "min_p": cfg.min_p,
        "min_tokens_to_keep": cfg.min_tokens_to_keep,
        "lossless_check": "greedy only: DFlash ids vs a baseline run on the same prompt; "
                          "sampled runs: null (ids are draws, compare acceptance and speed)",
        "decisive_random_target": setup.decisive,
        "forward_timing": "medians of synced single forwards at first-time cache lengths; "
                          "ideal_speedup = tau * t(step) / (t(verify) + t(draft)); "
                          "verify_revisited_ms: each verify run again at once at the same shape "
                          "(what re-running a prompt, as --chat does, may gain from per-shape "
                          "caches)",
    }


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


def _write(result: dict, cfg: BenchConfig, name: str) -> Path:
    """<out>/<label or model name>-<mode>-<host>-<time>.json; a name already taken (two runs in
    one second) gets -2, -3, ...: a result never overwrites another. A failed write (disk full,
    the folder gone read-only) is a ValueError, the command's one line, and leaves no file."""
    out = out_dir(cfg.out)
    stem = "-".join([cfg.label or name, cfg.mode, socket.gethostname(),
                     datetime.now().strftime("%Y%m%d-%H%M%S")])
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", stem)
    path, n = out / f"{stem}.json", 2
    while path.exists():
        path, n = out / f"{stem}-{n}.json", n + 1
    tmp = path.with_name(f".{path.name}.partial")  # whole or nothing: a full disk left a torn JSON
    try:
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ValueError(f"the result could not be written to {out}: {e.strerror or e}") from None
    return path
