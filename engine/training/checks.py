"""Checks that run before train-draft loads a model: a mistyped command must fail in one line
and change nothing on disk, never overwrite a campaign or train zero steps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .checkpoint import load_trainer, recover

# train-draft options that shape a NEW draft; a resumed draft keeps its checkpoint's shape
ARCH_OPTIONS = ("layers", "block_size", "num_capture", "layer_ids", "mask_token_id")
# options that choose the campaign's data and its order: trainer.json records them, and a resume
# that does not type one keeps the campaign's (a default would quietly change the training set)
DATA_OPTIONS = ("seed", "prompts", "num_prompts", "derive_prompts", "exclude_prompts",
                "max_new_tokens", "sampled_responses", "response_temperature", "train_responses")


def check_out_named(out: str) -> None:
    """Refuse an empty --out (before anything looks inside it)."""
    if not out.strip():
        raise ValueError("--out is empty: name the folder for the draft and its checkpoint")


def check_out(out: str, resume: str | bool | None) -> None:
    """Refuse an --out whose checkpoint (or model) a fresh run would overwrite."""
    ckpt = Path(out) / "checkpoint"
    if resume is not True:
        check_foreign_model(out)
    if resume is True or (resume and Path(resume).resolve() == ckpt.resolve()):
        return  # a resume into its own folder continues (and rewrites) that campaign
    trainer = load_trainer(ckpt)
    if trainer is not None and resume and Path(resume).resolve() == Path(out).resolve():
        raise ValueError(f"--resume {resume} is the run's folder, not its checkpoint: pass --resume {ckpt}")
    if trainer is not None and resume:
        raise ValueError(f"{ckpt} already holds another campaign at step {trainer['step']}: "
                         f"resuming {resume} would overwrite it; choose another --out")
    if trainer is not None:
        raise ValueError(f"{ckpt} already holds a campaign at step {trainer['step']}: pass "
                         f"--resume {ckpt} to continue it, or choose another --out")


def check_foreign_model(out: str) -> None:
    """Refuse an --out that holds a model or draft of its own (config.json) but no campaign of
    train-draft's: the draft written at the end would replace its config.json and weights (the
    target's own folder given as --out, a published draft folder)."""
    if (Path(out) / "config.json").is_file() and not (Path(out) / "checkpoint" / "trainer.json").is_file():
        raise ValueError(f"--out {out} already holds a model or draft (config.json) that no "
                         "train-draft campaign wrote: the new draft would overwrite it; choose another --out")


def check_sources(num_prompts: int, prompts: str | None, derive_prompts: int) -> None:
    """0 built-in prompts is fine when another source gives data, not when none does."""
    if num_prompts == 0 and not prompts and derive_prompts == 0:
        raise ValueError("--num-prompts 0 with no --prompts file and no --derive-prompts: no training data")


def check_flags(resume: str | None, init_draft: str | None, restart_lr: float | None) -> None:
    """Options that mean nothing in this combination, refused rather than ignored."""
    if resume and init_draft:
        raise ValueError("--init-draft starts a new campaign; --resume continues one: pass only one")
    if restart_lr is not None and not resume:
        raise ValueError("--restart-lr is a warm restart of a resumed campaign: it needs --resume")


def check_resume_arch(resume: str, explicit: dict[str, Any]) -> None:
    """Refuse architecture options given explicitly that differ from the checkpoint's draft."""
    cfg_file = Path(resume) / "config.json"
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return  # the draft loader reports a missing or bad config itself
    dc = cfg.get("dflash_config", {})
    taps = dc.get("target_layer_ids", cfg.get("target_layer_ids", []))
    have = {"layers": cfg.get("num_hidden_layers"), "block_size": cfg.get("block_size"),
            "num_capture": len(taps), "layer_ids": list(taps),
            "mask_token_id": dc.get("mask_token_id", cfg.get("mask_token_id"))}
    for name, value in explicit.items():
        if have.get(name) is not None and value != have[name]:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} {value} contradicts the checkpoint {resume} ({have[name]}): "
                             "a resume keeps its draft's shape (grow it with --grow-*)")


def check_resume_steps(resume: str, total_steps: int | None) -> None:
    """Refuse a resume with no step left to train (it would rewrite the draft for nothing)."""
    trainer = load_trainer(resume)
    if trainer is None:
        inner = Path(resume) / "checkpoint"
        hint = f"; {inner} is one: pass --resume {inner}" if (inner / "trainer.json").is_file() else ""
        raise ValueError(f"--resume {resume}: no trainer.json (not a training checkpoint{hint})")
    step = trainer["step"]
    total = total_steps or int(trainer.get("schedule", {}).get("total_steps", 0))
    if step >= total:
        raise ValueError(f"the checkpoint {resume} is at step {step} of {total}: pass a "
                         f"--total-steps above {step} to continue")


def check_resume_again(resume: str, grow: bool, restart_lr: float | None) -> list[str]:
    """A resume of a session that was cut short (Ctrl-C, SIGTERM, a kill after a periodic
    checkpoint) and had applied --grow-* / --restart-lr at its start already: the same command
    line given again, as its "continue with --resume" invites, would grow the draft a second
    time (refused: a shape nobody asked for) or restart the cosine again (allowed, since a new
    session may mean it, and noted for the log). A session that ended as planned (steps, time
    budget) may be followed by either."""
    trainer = load_trainer(resume) or {}
    sessions = trainer.get("sessions") or [{}]
    last = sessions[-1] if isinstance(sessions[-1], dict) else {}
    if "stopped" not in last or last["stopped"] not in (None, "interrupted"):
        return []  # ended as planned, or written before sessions said how they ended
    cut = (f"--resume {resume}: the session that saved it (from step {last.get('start_step')}) was cut "
           f"short at step {trainer['step']}")
    if grow and last.get("grown"):
        raise ValueError(f"{cut} and had grown the draft already ({last['grown']}): continue it without "
                         "--grow-* (given again, it would grow twice)")
    if restart_lr is not None and last.get("restart_lr"):
        return [f"[train] note: {cut} after its own --restart-lr {last['restart_lr']:g}: this restarts the "
                f"cosine again from step {trainer['step']} (to continue that session's, resume without it)"]
    return []


def check_paths(opts: Any) -> None:
    """Input files that must exist and output folders that must be folders, named before the
    model loads (a typo would otherwise surface after the load, as a bare errno line)."""
    for flag, value in (("--prompts", opts.prompts), ("--heldout-file", opts.heldout_file),
                        ("--exclude-prompts", opts.exclude_prompts)):
        if value and not Path(value).is_file():
            what = "is a folder, not a file" if Path(value).is_dir() else "not found"
            raise ValueError(f"{flag} {value}: {what}")
    if opts.prompts and not opts.derive_prompts:
        from .data import load_prompt_file

        if not load_prompt_file(opts.prompts):
            raise ValueError(f"--prompts {opts.prompts}: no prompts in it (JSONL with \"prompt\", "
                             "or one prompt per line)")
    for flag, value in (("--out", opts.out), ("--data-dir", opts.data_dir)):
        if value and Path(value).exists() and not Path(value).is_dir():
            raise ValueError(f"{flag} {value} exists and is not a folder")
    for flag, value in (("--resume", opts.resume), ("--init-draft", opts.init_draft)):
        if value and not Path(value).is_dir():
            raise ValueError(f"{flag} {value}: no such folder")


def recover_checkpoints(opts: Any) -> list[str]:
    """Put back a checkpoint whose save was cut short (checkpoint.recover), in --out and in the
    folder resumed from, before the checks below read them: what was done, for the log."""
    folders = [Path(opts.out) / "checkpoint"] + ([Path(opts.resume)] if opts.resume else [])
    return [note for f in folders if (note := recover(f))]


def preflight(opts: Any, explicit_arch: dict[str, Any] | None = None) -> list[str]:
    """Every check above for TrainOptions `opts`; `explicit_arch`: architecture options the
    user typed (the CLI knows them; the Python API passes none). Returns notes for the log."""
    check_out_named(opts.out)
    notes = recover_checkpoints(opts)  # first: --resume may name the folder it puts back
    check_paths(opts)
    check_out(opts.out, opts.resume or opts.data_only)  # --data-only writes no checkpoint
    check_flags(opts.resume, opts.init_draft, opts.restart_lr)
    check_sources(opts.num_prompts, opts.prompts, opts.derive_prompts)
    if opts.resume:
        check_resume_steps(opts.resume, opts.total_steps)
        check_resume_arch(opts.resume, explicit_arch or {})
        notes += check_resume_again(opts.resume, bool(opts.grow_layers or opts.grow_mlp or opts.grow_taps),
                                    opts.restart_lr)
    return notes


def campaign_data_options(resume: str, typed: set[str], given: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The data options a resume keeps from its campaign: each of DATA_OPTIONS not in `typed`
    whose recorded value differs from `given` (the defaults), and a line that says which.

    Why: `--resume` without `--num-prompts 0 --derive-prompts N --max-new-tokens 512` would
    train on 600 built-in prompts answered to 256 tokens, a different set in a different order.
    An unreadable or missing trainer.json keeps nothing here (preflight names it). A checkpoint
    older than the record keeps its seed and the answers' length (trainer.json had those)."""
    try:
        trainer = load_trainer(resume)
    except ValueError:
        return {}, None
    if trainer is None:
        return {}, None
    recorded = trainer.get("data_options")
    if not isinstance(recorded, dict):
        recorded = {"seed": trainer.get("seed"), "max_new_tokens": (trainer.get("data") or {}).get("max_new_tokens")}
    kept = {k: recorded[k] for k in DATA_OPTIONS
            if k in recorded and recorded[k] is not None and k not in typed and recorded[k] != given.get(k)}
    if not kept:
        return {}, None
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in kept.items())
    return kept, (f"the campaign's data options kept from {Path(resume) / 'trainer.json'}: {flags} "
                  "(type an option to change it)")
