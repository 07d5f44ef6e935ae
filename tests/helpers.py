"""Test helpers: the mlx-lm greedy reference, a one-call DFlash run, a script loaded as a module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.generate import generate_step

from dflash.engine.generate import Finished, stream_dflash_generate


def greedy_reference(model: Any, ids: Sequence[int], n: int, **kwargs: Any) -> list[int]:
    """mlx-lm's own greedy token ids for `n` steps (no EOS handling)."""
    out = []
    for tok, _ in generate_step(mx.array(list(ids)), model, max_tokens=n, **kwargs):
        out.append(int(tok))
    return out


def cut_at_eos(ids: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i]
    return ids


def run_dflash(target, drafter, tokenizer, ids, max_tokens, **kwargs) -> tuple[Finished, list]:
    events = list(stream_dflash_generate(target, drafter, tokenizer, ids, max_tokens, **kwargs))
    final = events[-1]
    assert isinstance(final, Finished)
    return final, events[:-1]


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py as a module (the scripts are tools, not a package); registered in
    sys.modules, where a dataclass of it looks its module up. Module level only imports there:
    nothing re-executes or loads a model until a test calls in."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
