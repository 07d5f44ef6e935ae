"""Training checkpoints small enough to bring back from a lent GPU.

A checkpoint folder:
    config.json                          the draft's config (published DFlash format)
    model-0000i-of-0000N.safetensors     bf16 draft weights, whole tensors, each file <= part_bytes
    model.safetensors.index.json         weight_map (Hugging Face layout)
    trainer.json                         global step, schedule, seed, data, running loss, sessions
    optimizer/state.safetensors          optional (--save-optimizer): AdamW moments + step, fp32
    optimizer/master.safetensors         optional: the fp32 master weights (exact local resume)

The folder is itself a loadable draft: `load_draft` reads every top-level *.safetensors. A
tensor larger than a part is split by rows into keys `NAME.__rows{i}of{n}`, which `load_draft`
joins back (draft.join_rows). The folder is written to a sibling temp folder and swapped in, so a
crash mid-save never leaves a half checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx

from ...daemon.protocol import finite_number

PART_BYTES = 15_000_000
_HEADER_BUDGET = 64 * 1024  # safetensors header (JSON with names, shapes, offsets) per file


def _pieces(name: str, t: mx.array, budget: int) -> list[tuple[str, mx.array]]:
    if t.nbytes <= budget or t.ndim == 0 or t.shape[0] < 2:
        return [(name, t)]
    row = t.nbytes // t.shape[0]
    per = max(1, budget // max(row, 1))
    n = -(-t.shape[0] // per)
    return [(f"{name}.__rows{i}of{n}", t[i * per : (i + 1) * per]) for i in range(n)]


def write_parts(weights: dict[str, mx.array], folder: Path, part_bytes: int = PART_BYTES,
                stem: str = "model") -> list[Path]:
    """Whole tensors packed greedily into files of at most part_bytes (rows split if needed)."""
    budget = max(part_bytes - min(_HEADER_BUDGET, part_bytes // 10), 256)
    parts: list[dict[str, mx.array]] = [{}]
    size = 0
    for name in sorted(weights):
        for key, t in _pieces(name, weights[name], budget):
            if parts[-1] and size + t.nbytes > budget:
                parts.append({})
                size = 0
            parts[-1][key] = t
            size += t.nbytes
    n = len(parts)
    files, wmap = [], {}
    for i, p in enumerate(parts, 1):
        f = folder / f"{stem}-{i:05d}-of-{n:05d}.safetensors"
        mx.save_safetensors(str(f), p, metadata={"format": "mlx"})
        files.append(f)
        wmap.update({k: f.name for k in p})
    total = sum(t.nbytes for t in weights.values())
    (folder / f"{stem}.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": wmap}, indent=1) + "\n")
    return files


def read_draft(folder: str | Path, dtype: mx.Dtype | None = None):
    """draft.load_draft, with a damaged folder (cut-short weights, a bad config.json) reported
    in one line naming it: MLX's loader raises a bare RuntimeError, which reads as a crash."""
    from ..draft import load_draft

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} is not a draft folder (no config.json)")
    try:
        return load_draft(folder, dtype)
    except (RuntimeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{folder}: damaged draft files ({reason})") from None


def load_draft_any(folder: str | Path, dtype: mx.Dtype | None = None):
    """A DFlashDraft to train from: a checkpoint (row-split parts included) or a published draft
    folder, read by the one draft loader (read_draft); a quantized draft cannot be trained."""
    folder = Path(folder)
    try:
        quantized = json.loads((folder / "config.json").read_text()).get("quantization")
    except FileNotFoundError:
        raise FileNotFoundError(f"{folder} is not a draft folder (no config.json)") from None
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        raise ValueError(f"{folder / 'config.json'}: not a readable draft config") from None
    if quantized:
        raise ValueError(f"{folder}: a quantized draft cannot seed training")
    return read_draft(folder, dtype)


def recover(folder: str | Path) -> str | None:
    """Finish a checkpoint swap that was cut short (killed, Ctrl-C twice, power loss) between
    moving the old checkpoint aside and the new one in: without this the folder looks empty,
    a fresh run would start over and its first save would delete the only copy. Returns what
    was done, or None."""
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        return None  # a checkpoint, or something that is not ours to move
    for src, what in ((folder.with_name(folder.name + ".tmp"), "the new checkpoint"),
                      (folder.with_name(folder.name + ".old"), "the previous checkpoint")):
        if not _complete(src):
            continue
        if folder.exists():
            folder.rmdir()
        os.replace(src, folder)
        return f"{folder}: a checkpoint save had been cut short; {what} was put back in place"
    return None


def _complete(folder: Path) -> bool:
    """Whether `folder` holds a whole checkpoint: trainer.json is written last, so a readable
    one means every other file was written before it."""
    try:
        return isinstance(json.loads((folder / "trainer.json").read_text()).get("step"), int)
    except (OSError, ValueError, AttributeError):
        return False


def save_checkpoint(
    folder: str | Path, config: dict[str, Any], params: dict[str, mx.array], trainer: dict[str, Any],
    part_bytes: int = PART_BYTES, dtype: mx.Dtype = mx.bfloat16,
    optimizer_state: dict[str, mx.array] | None = None,
) -> Path:
    """Write a checkpoint (see the module doc); `params` flat {name: array} (fp32 masters)."""
    folder = Path(folder)
    recover(folder)  # a swap cut short: never delete the only copy below
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write_into(tmp, config, params, trainer, part_bytes, dtype, optimizer_state)
    except BaseException:  # disk full, Ctrl-C: the previous checkpoint stays as it was
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = folder.with_name(folder.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)
    return folder


def _write_into(tmp: Path, config: dict[str, Any], params: dict[str, mx.array], trainer: dict[str, Any],
                part_bytes: int, dtype: mx.Dtype, optimizer_state: dict[str, mx.array] | None) -> None:
    """Every file of a checkpoint into `tmp`; trainer.json last, so its presence means complete."""
    write_parts({k: v.astype(dtype) for k, v in params.items()}, tmp, part_bytes)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    trainer = dict(trainer, optimizer_saved=optimizer_state is not None,
                   weights_dtype=str(dtype).split(".")[-1])
    if optimizer_state is not None:
        (tmp / "optimizer").mkdir()
        mx.save_safetensors(str(tmp / "optimizer" / "state.safetensors"), optimizer_state)
        mx.save_safetensors(str(tmp / "optimizer" / "master.safetensors"),
                            {k: v.astype(mx.float32) for k, v in params.items()})
    (tmp / "trainer.json").write_text(json.dumps(trainer, indent=2) + "\n")


def load_trainer(folder: str | Path) -> dict[str, Any] | None:
    """trainer.json of a checkpoint folder (None when absent); a corrupt one is named."""
    f = Path(folder) / "trainer.json"
    if not f.is_file():
        return None
    try:
        data = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{f}: not a readable trainer.json ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("step"), int):
        raise ValueError(f"{f}: not a trainer.json (no integer 'step')")
    if isinstance(data["step"], bool) or data["step"] < 0:  # a resume trimmed the log, then failed
        raise ValueError(f"{f}: 'step' must be an integer >= 0, got {data['step']}")
    sched = data.get("schedule", {})
    if not isinstance(sched, dict) or not all(
            v is None or finite_number(v)
            for v in sched.values()):  # an AttributeError or TypeError traceback before
        raise ValueError(f"{f}: 'schedule' must be an object of numbers")
    return data


def load_optimizer(folder: str | Path) -> tuple[dict[str, mx.array], dict[str, mx.array]] | None:
    """(flat optimizer state, fp32 master weights) when the checkpoint kept them, else None."""
    d = Path(folder) / "optimizer"
    if not (d / "state.safetensors").is_file() or not (d / "master.safetensors").is_file():
        return None
    try:
        return mx.load(str(d / "state.safetensors")), mx.load(str(d / "master.safetensors"))
    except RuntimeError as e:  # cut short: MLX's bare RuntimeError reads as a crash
        raise ValueError(f"{d}: damaged optimizer files ({str(e).splitlines()[0]}); "
                         "delete that folder to resume with a fresh optimiser") from None


def trim_log(path: str | Path, step: int) -> int:
    """Drop the records of `path` (train_log.jsonl) past `step`, where this session starts: a run
    killed after its last checkpoint had logged steps the resume runs again, and appending would
    log them twice. A record cut short by the kill goes too; the rest stays as it was. The file
    is swapped whole. Returns how many lines were dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    data = path.read_bytes()
    lines = data.split(b"\n")
    last = lines.pop()  # b"" after a final newline; else a record cut short (or one that lost only its newline)
    torn = bool(last) and _record(last) is None
    if last and not torn:
        lines.append(last)
    kept = [line for line in lines if not _past(line, step)]
    new = b"".join(line + b"\n" for line in kept)
    if new != data:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(new)
        os.replace(tmp, path)
    return len(lines) - len(kept) + torn


def _record(line: bytes) -> dict[str, Any] | None:
    """A log line's record (a JSON object with an integer step), else None."""
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("step"), int) else None


def _past(line: bytes, step: int) -> bool:
    """Whether a log line is a record of a step after `step` (a line that is not a record stays)."""
    rec = _record(line)
    return rec is not None and rec["step"] > step
