"""What the verify window measured, kept on disk across worker restarts.

The window (engine/window.py) learns per pair what a draft cycle costs on this machine (d, o)
and how often drafts are accepted (p, copy_p). Within one worker, `WindowMemory` hands that
from job to job; without a file, every daemon start explored again, and a short answer right
after a start (`make demo`) paid most of its time for it: a first 16-token verify at the prior
acceptance of 0.8, timing steps, probes. This file keeps those four numbers per pair, machine
and decoding kind (greedy or sampled), in <state_dir>/window_memory.json, written atomically
after each job. A missing, unreadable or foreign file only means starting fresh (a warning);
delete it to forget.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from dflash.engine.window import WindowMemory

log = logging.getLogger("dflash.worker")
FILE = "window_memory.json"
FORMAT = "dflash-window-memory/1"
_BOUNDS = {"d": (0.0, 8.0), "d_short": (0.0, 8.0), "o": (0.0, 8.0), "p": (0.0, 1.0), "copy_p": (0.0, 1.0),
           "full_tokens": (1.0, 64.0)}


def pair_key(model: str, draft: str, dtype: str | None, device: str) -> str:
    """One entry per target, draft, dtype and device on this host: costs are the machine's."""
    return "|".join([str(model), str(draft), str(dtype or "native"), device, platform.node()])


def _memory(entry: Any) -> WindowMemory:
    """A WindowMemory from a stored dict; values that are missing or out of range stay None."""
    m = WindowMemory()
    if not isinstance(entry, dict):
        return m
    for f in fields(WindowMemory):
        v = entry.get(f.name)
        lo, hi = _BOUNDS[f.name]
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and lo <= v <= hi:
            setattr(m, f.name, float(v))
    return m


def _read(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("pairs"), dict):
            raise ValueError(f"not a {FORMAT} file")
        return data["pairs"]
    except (OSError, ValueError) as e:
        log.warning("ignoring %s (%s): the verify window starts fresh", path, e)
        return {}


def load(state_dir: Path, key: str) -> dict[bool, WindowMemory]:
    """{greedy: memory} for this pair, as the last worker left it ({} when none)."""
    entry = _read(state_dir / FILE).get(key)
    if not isinstance(entry, dict):
        return {}
    return {kind == "greedy": _memory(entry[kind]) for kind in ("greedy", "sampled") if kind in entry}


def save(state_dir: Path, key: str, memories: dict[bool, WindowMemory]) -> None:
    """Write this pair's entry (other pairs' entries kept), atomically; a failure is a warning."""
    path = state_dir / FILE
    tmp = path.with_name(f".{FILE}.{os.getpid()}.tmp")
    try:
        pairs = _read(path)
        pairs[key] = {("greedy" if g else "sampled"): asdict(m) for g, m in memories.items()}
        state_dir.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"format": FORMAT, "pairs": pairs}, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not save %s: %s", path, e)
        _discard(tmp)  # a full disk left a partial temp file behind, one per worker pid


def _discard(tmp: Path) -> None:
    try:
        tmp.unlink(missing_ok=True)
    except OSError:
        pass
