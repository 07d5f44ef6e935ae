"""Tape recording for Gated DeltaNet layers (qwen3_5, qwen3_next and their MoE variants).

A recurrent state cannot be trimmed. While the target verifies a block we record, per GDN
layer, the conv input (pre-verify conv state + the block's projected rows) and the arguments of
the gated-delta recurrence (q, k, v, a, b and the pre-verify state). Rolling back to n accepted
steps then needs no layer re-run: the conv state is a slice of the recorded conv input and the
recurrent state is the recurrence replayed over the first n recorded steps only.

Recording hooks: each GDN instance and its conv1d get a recording subclass (same instance, same
weights), and the model module's `gated_delta_update` name is wrapped once. With no tape active
the hooks only check a global and call through.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import mlx.core as mx


@dataclass
class TapeEntry:
    """What one GDN layer saw during one verify pass."""

    conv_input: mx.array | None = None  # [B, kernel-1 + S, C]
    recurrence: Callable[..., tuple[mx.array, mx.array]] | None = None
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def replay(self, n: int) -> tuple[mx.array, mx.array]:
        """(conv state, recurrent state) after only the first n recorded steps."""
        if self.conv_input is None or self.recurrence is None:
            raise RuntimeError("incomplete GDN tape: the layer was not recorded")
        n_keep = self.conv_input.shape[1] - self.args[0].shape[1]
        conv_state = mx.contiguous(self.conv_input[:, n : n + n_keep, :])
        q, k, v, a, b, a_log, dt_bias, state = self.args[:8]
        if n == 0:  # nothing kept (a queued cycle undone): the state the block started from
            return conv_state, state
        cut = lambda x: x[:, :n]  # noqa: E731
        _, new_state = self.recurrence(
            cut(q), cut(k), cut(v), cut(a), cut(b), a_log, dt_bias, state, None, **self.kwargs
        )
        return conv_state, new_state


class Tape:
    """All GDN layers' entries for one verify pass, keyed by layer instance."""

    def __init__(self) -> None:
        self.entries: dict[int, TapeEntry] = {}
        self.current: TapeEntry | None = None

    def entry_for(self, gdn_module: Any) -> TapeEntry:
        try:
            return self.entries[id(gdn_module)]
        except KeyError:
            raise RuntimeError("GDN layer was not recorded during verify") from None


_ACTIVE: Tape | None = None


@contextmanager
def recording(tape: Tape | None) -> Iterator[Tape | None]:
    """Record GDN layers into `tape` for the duration of one forward pass."""
    global _ACTIVE
    _ACTIVE = tape
    try:
        yield tape
    finally:
        _ACTIVE = None


def gdn_module(layer: Any) -> Any | None:
    """The Gated DeltaNet sub-module of a decoder layer, if it has one."""
    la = layer.get("linear_attn") if hasattr(layer, "get") else None
    return la if la is not None and "conv1d" in la else None


_SUBCLASSES: dict[tuple[type, str], type] = {}


def _subclass(cls: type, name: str, call: Callable) -> type:
    key = (cls, name)
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(f"{name}{cls.__name__}", (cls,), {"__call__": call})
    return _SUBCLASSES[key]


def _make_gdn_call(cls: type) -> Callable:
    def __call__(self, *args, **kwargs):
        tape = _ACTIVE
        if tape is None:
            return cls.__call__(self, *args, **kwargs)
        tape.current = tape.entries.setdefault(id(self), TapeEntry())
        try:
            return cls.__call__(self, *args, **kwargs)
        finally:
            tape.current = None

    return __call__


def _make_conv_call(cls: type) -> Callable:
    def __call__(self, x, *args, **kwargs):
        tape = _ACTIVE
        if tape is not None and tape.current is not None:
            tape.current.conv_input = x
        return cls.__call__(self, x, *args, **kwargs)

    return __call__


def _wrap_recurrence(fn: Callable) -> Callable:
    if getattr(fn, "_dflash_taped", False):
        return fn

    def taped(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, **kwargs):
        tape = _ACTIVE
        if tape is not None and tape.current is not None:
            if state is None:
                B, _, _, Dk = q.shape
                Hv, Dv = v.shape[-2:]
                state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
            entry = tape.current
            entry.recurrence = fn
            entry.args = (q, k, v, a, b, A_log, dt_bias, state)
            entry.kwargs = dict(kwargs)
        return fn(q, k, v, a, b, A_log, dt_bias, state, mask, **kwargs)

    taped._dflash_taped = True  # type: ignore[attr-defined]
    return taped


def install(layers: list[Any]) -> int:
    """Install recording hooks on every GDN layer; return how many were found."""
    found = 0
    for layer in layers:
        gdn = gdn_module(layer) if layer is not None else None
        if gdn is None:
            continue
        found += 1
        cls = type(gdn)
        if cls.__name__.startswith("Taped"):
            cls = cls.__bases__[0]
        else:
            gdn.__class__ = _subclass(cls, "Taped", _make_gdn_call(cls))
        conv = gdn.conv1d
        ccls = type(conv)
        if not ccls.__name__.startswith("Taped"):
            conv.__class__ = _subclass(ccls, "Taped", _make_conv_call(ccls))
        mod = sys.modules[cls.__module__]
        if not hasattr(mod, "gated_delta_update"):
            raise RuntimeError(f"{cls.__module__} has no gated_delta_update to record")
        mod.gated_delta_update = _wrap_recurrence(mod.gated_delta_update)
    return found
