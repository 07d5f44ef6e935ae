"""First-time cache lengths for `dflash benchmark`: a ledger of every target forward, and a planner.

Per-shape caches can flatter a benchmark that re-runs one prompt: MLX-CUDA's cuDNN attention builds
a graph per exact (query tokens, KV length) shape (a 16-token verify at a new length costs ~5x one
at a revisited length), and a real request never revisits its lengths. So every timed run must
decode at shapes the process has never run before. Shapes are (M, offset): M new tokens on a cache
holding `offset` tokens, which is what such caches key on.

- `ShapeLedger` records every forward of the target (baseline and DFlash alike, prefill included)
  by swapping the class of the model's inner module (same instance, same weights, one Python call
  more per forward) and tells, per run, whether any of its decode forwards (offset >= prompt
  length) had a shape used before: `first_time` in each run's JSON is measured, not assumed.
- `Planner` picks each run's prompt length: the length nearest the nominal context whose
  predicted decode shapes are all unused. Predictions: a baseline run does M=1 steps at offsets
  L .. L+T; an oracle DFlash run (every block accepted, full window) verifies M=B at L, L+B, ...;
  any other DFlash run may verify any M <= B anywhere in L .. L+T+B (a conservative superset).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Iterable

Shape = tuple[int, int]  # (tokens in the forward, cache offset before it)
_LEDGER_CLASSES: dict[type, type] = {}


def _first_offset(cache: Any) -> int | None:
    for c in cache or ():
        off = getattr(c, "offset", None)
        if isinstance(off, int):
            return off
    return None


def _ledger_class(cls: type) -> type:
    if cls not in _LEDGER_CLASSES:

        def __call__(self, inputs, *args, **kwargs):
            ledger = self.__dict__.get("_dflash_ledger")
            if ledger is not None:
                cache = kwargs.get("cache", args[0] if args else None)
                off = _first_offset(cache)
                if off is not None and getattr(inputs, "ndim", 0) >= 2:
                    ledger.record(int(inputs.shape[1]), off)
            return cls.__call__(self, inputs, *args, **kwargs)

        _LEDGER_CLASSES[cls] = type(f"Ledgered{cls.__name__}", (cls,), {"__call__": __call__})
    return _LEDGER_CLASSES[cls]


class ShapeLedger:
    """Every (M, offset) the target ran in this process, and the shapes of the current run."""

    def __init__(self, target: Any | None = None):
        self._seen: dict[int, list[int]] = {}  # M -> sorted offsets
        self._run: list[Shape] | None = None
        if target is not None:
            inner = target.inner
            if not type(inner).__name__.startswith("Ledgered"):
                inner.__class__ = _ledger_class(type(inner))
            inner.__dict__["_dflash_ledger"] = self

    # --- recording ----------------------------------------------------------------------------
    def record(self, m: int, offset: int) -> None:
        if self._run is not None:
            self._run.append((m, offset))
        else:
            self._add(m, offset)

    def _add(self, m: int, offset: int) -> None:
        offs = self._seen.setdefault(m, [])
        i = bisect.bisect_left(offs, offset)
        if i == len(offs) or offs[i] != offset:
            offs.insert(i, offset)

    def seen(self, m: int, offset: int) -> bool:
        offs = self._seen.get(m, ())
        i = bisect.bisect_left(offs, offset)
        return i < len(offs) and offs[i] == offset

    def any_seen(self, m: int, start: int, stop: int, step: int = 1) -> bool:
        """Whether any offset in range(start, stop, step) was run with M = m."""
        offs = self._seen.get(m)
        if not offs:
            return False
        if step == 1:
            i = bisect.bisect_left(offs, start)
            return i < len(offs) and offs[i] < stop
        return any(self.seen(m, o) for o in range(start, stop, step))

    def begin(self) -> None:
        self._run = []

    def end(self, prompt_len: int) -> dict[str, Any]:
        """Close the run: its decode shapes, how many of them this process had run before."""
        shapes, self._run = self._run or [], None
        decode = [(m, o) for m, o in shapes if o >= prompt_len]
        again = {(m, o) for m, o in set(decode) if self.seen(m, o)}
        for m, o in shapes:
            self._add(m, o)
        widths = sorted({m for m, _ in decode})
        return {
            "first_time": not again,
            "decode_forwards": len(decode),
            "revisited_shapes": len(again),
            "revisited_widths": sorted({m for m, _ in again}),
            "verify_widths": widths,
            "cache_lengths": [min((o for _, o in decode), default=prompt_len),
                              max((o + m for m, o in decode), default=prompt_len)],
        }


# --- predictions --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Span:
    """Forwards of M tokens at offsets range(start, stop, step)."""

    m: int
    start: int
    stop: int
    step: int = 1


def baseline_shapes(length: int, max_tokens: int) -> list[Span]:
    """mlx-lm's decode loop: M=1 steps at L .. L+T (the last one queued and discarded)."""
    return [Span(1, length, length + max_tokens + 1)]


def oracle_shapes(length: int, max_tokens: int, block: int) -> list[Span]:
    """Every block accepted, full window: M=B verifies at L, L+B, ... (one queued beyond)."""
    return [Span(block, length, length + (max_tokens // block + 2) * block, block)]


def dflash_shapes(length: int, max_tokens: int, block: int) -> list[Span]:
    """Any window 1..B anywhere in the run's range (auto windows, plain steps, rejections)."""
    stop = length + max_tokens + block
    return [Span(m, length, stop) for m in range(1, block + 1)]


def forward_timing_shapes(length: int, block: int, count: int, keep: int = 0) -> list[Span]:
    """time_forward: step i at L+i(1+keep), its verify (rewound to `keep`) one token later."""
    pitch = 1 + keep
    return [Span(1, length, length + count * pitch, pitch),
            Span(block, length + 1, length + 1 + count * pitch, pitch)]


class Planner:
    """Chooses prompt lengths whose predicted decode shapes this process has never run."""

    def __init__(self, ledger: ShapeLedger, min_length: int = 2, limit: int = 1 << 20):
        self.ledger = ledger
        self.min_length = min_length
        self.limit = limit

    def fresh(self, spans: Iterable[Span]) -> bool:
        return not any(self.ledger.any_seen(s.m, s.start, s.stop, s.step) for s in spans)

    def nearest(self, center: int, predict, candidates: Iterable[int] | None = None) -> int | None:
        """The candidate length nearest `center` (default: every length >= min_length) whose
        predicted shapes, predict(length), are all unused; None if no candidate is fresh."""
        if candidates is not None:
            for n in sorted(candidates, key=lambda n: (abs(n - center), n)):
                if n >= self.min_length and self.fresh(predict(n)):
                    return n
            return None
        center = max(center, self.min_length)
        for d in range(self.limit):
            for n in (center + d, center - d) if d else (center,):
                if n >= self.min_length and self.fresh(predict(n)):
                    return n
        return None
