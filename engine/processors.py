"""Logits processors: logit bias and the repetition, presence and frequency penalties.

mlx-lm's semantics (`make_logits_processors`), in its order, on the raw logits before any
sampling transform: the bias is added; then, over the last `repetition_context_size` tokens of
the history, each token's logit is multiplied by `repetition_penalty` when negative and divided by
it otherwise; then `presence_penalty` is subtracted once from each token of the last
`presence_context_size`; then `frequency_penalty` once per occurrence in the last
`frequency_context_size`. The history is what mlx-lm's `generate_step` hands its processors:
the prompt and every token generated before the one the logits predict.

A verify scores a block [anchor, d1..dk] in one target pass; row i predicts the token after
d_i, so its history is the committed tokens (prompt + emitted, the anchor last) followed by
d1..d_i: the history the target alone would have had, had it produced those drafts. Each row
is processed with its own window, in a few MLX ops over the whole block (no host sync); the
windows' positions are built on the host once per block shape, the tokens at them are gathered
on the device (the drafts are still there). So a kept draft was judged by the processed p, and
greedy ids and sampled distributions are the target's own with the same processors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Mapping, Sequence

import mlx.core as mx
import numpy as np

# the float32-safe ranges, one definition for the engine and the worker's submit check: a bias
# or penalty past 1e30 (times a count) is inf in float32, a repetition penalty of 1e-40 is 0 (a
# logit divided by it is inf, and the draw garbage)
from ..daemon.protocol import BIAS_MAX, MAX_TOKEN_ID_DIGITS, PENALTY_MAX, REPETITION_MIN, finite_number, shown

CONTEXT_SIZE = 20  # mlx-lm's default window for each penalty


def bias_items(logit_bias: Mapping[Any, Any] | None) -> dict[int, float]:
    """{token id: bias} from ints or decimal strings (as JSON spells the keys); ValueError names
    what is wrong."""
    if logit_bias is None:
        return {}
    if not isinstance(logit_bias, Mapping):
        raise ValueError(f"logit_bias must map token ids to numbers, got {type(logit_bias).__name__}")
    out: dict[int, float] = {}
    for k, v in logit_bias.items():
        if isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= MAX_TOKEN_ID_DIGITS:
            tid = int(k)
        elif isinstance(k, int) and not isinstance(k, bool):
            tid = k
        else:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {shown(k)}")
        if tid < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {shown(k)}")
        if not finite_number(v):
            raise ValueError(f"logit_bias values must be finite numbers, got {shown(v)} for token {shown(tid)}")
        if abs(v) > BIAS_MAX:  # a bias past float32's range is inf there: no distribution left
            raise ValueError(f"logit_bias values must be within +-{BIAS_MAX:.0e} (logits are float32), "
                             f"got {shown(v)} for token {shown(tid)}")
        if tid in out:
            raise ValueError(f"logit_bias names token {shown(tid)} twice")
        out[tid] = float(v)
    return out


def parse_bias_flags(values: Sequence[str]) -> dict[int, float] | None:
    """--logit-bias ID=BIAS values (the command lines') as {id: bias}; None for none. ValueError
    names the value that is not of that form."""
    out: dict[int, float] = {}
    for v in values:
        tid, eq, bias = v.partition("=")
        try:
            if not eq or not tid.strip().isdigit():
                raise ValueError
            out[int(tid)] = float(bias)
        except ValueError:
            raise ValueError(f"{shown(v)} is not ID=BIAS (a token id >= 0 and a number)") from None
        if not math.isfinite(out[int(tid)]):
            raise ValueError(f"{shown(v)}: the bias is not a finite number")
    return out or None


@dataclass(frozen=True)
class ProcessorParams:
    """mlx-lm's make_logits_processors arguments. None (or the neutral value: repetition 1,
    presence/frequency 0, an empty bias) is off; context sizes are >= 1 tokens."""

    logit_bias: Mapping[Any, float] | None = None
    repetition_penalty: float | None = None
    repetition_context_size: int = CONTEXT_SIZE
    presence_penalty: float | None = None
    presence_context_size: int = CONTEXT_SIZE
    frequency_penalty: float | None = None
    frequency_context_size: int = CONTEXT_SIZE
    bias: dict[int, float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "bias", bias_items(self.logit_bias))
        r = self.repetition_penalty
        if r is not None and not (finite_number(r) and r > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1: off), got {shown(r)}")
        if r is not None and not REPETITION_MIN <= r <= PENALTY_MAX:
            raise ValueError(f"repetition_penalty must be within {REPETITION_MIN:.0e}..{PENALTY_MAX:.0e} "
                             f"(logits are float32), got {shown(r)}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if v is not None and not finite_number(v):
                raise ValueError(f"{name} must be a finite number (0: off), got {shown(v)}")
            if v is not None and abs(v) > PENALTY_MAX:
                raise ValueError(f"{name} must be within +-{PENALTY_MAX:.0e} (logits are float32), got {shown(v)}")
        for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {shown(v)}")

    def penalties(self) -> list[tuple[str, float, int]]:
        """The penalties that change something, in mlx-lm's order: (kind, value, context size)."""
        out = []
        if self.repetition_penalty is not None and self.repetition_penalty != 1:
            out.append(("repetition", float(self.repetition_penalty), self.repetition_context_size))
        if self.presence_penalty:
            out.append(("presence", float(self.presence_penalty), self.presence_context_size))
        if self.frequency_penalty:
            out.append(("frequency", float(self.frequency_penalty), self.frequency_context_size))
        return out

    @property
    def active(self) -> bool:
        return bool(self.bias) or bool(self.penalties())

    def reported(self) -> dict[str, Any]:
        """The processors as a run's "sampling" reports them (the daemon's done.stats, `dflash
        generate --json`): only those that change something, each penalty with its window, the
        bias keyed by decimal strings (JSON's map keys), so a run without them reads as before."""
        out: dict[str, Any] = {}
        for kind, value, size in self.penalties():
            out[f"{kind}_penalty"] = value
            out[f"{kind}_context_size"] = size
        if self.bias:
            out["logit_bias"] = {str(k): float(v) for k, v in self.bias.items()}
        return out

    def check_vocab(self, vocab_size: int) -> None:
        """A bias on a token past the vocabulary would index outside the logits: refused."""
        if (problem := bias_vocab_problem(self.bias, vocab_size)) is not None:
            raise ValueError(problem)


def bias_vocab_problem(logit_bias: Mapping[Any, Any] | None, vocab_size: int) -> str | None:
    """Why a bias (ids as ints or decimal strings) does not fit a vocabulary of vocab_size, or
    None: the one rule the engine, the worker at submit and its MLX thread apply."""
    bad = [int(t) for t in (logit_bias or {}) if int(t) >= vocab_size]
    return f"logit_bias token id {shown(min(bad))} is outside the vocabulary (0..{vocab_size - 1})" if bad else None


class LogitsProcessors:
    """One generation's processors and its host-side history (prompt + committed tokens)."""

    def __init__(self, params: ProcessorParams, prompt: Sequence[int]):
        self.params = params
        self.history = list(prompt)
        self._penalties = params.penalties()
        self._reach = max((c for _, _, c in self._penalties), default=0)
        self._bias = None
        if params.bias:
            self._bias = (mx.array(list(params.bias), dtype=mx.int32),
                          mx.array(list(params.bias.values()), dtype=mx.float32))

    def extend(self, ids: Sequence[int]) -> None:
        self.history.extend(ids)

    def __call__(self, logits: mx.array, n_before: int, block: mx.array | None = None) -> mx.array:
        """logits (R, V): row i predicts the token after history[:n_before] + block[:i+1]
        (block None: one row after history[:n_before], e.g. the first token after the prompt)."""
        if self._bias is not None:
            idx, values = self._bias
            logits = logits.at[:, idx].add(values)
        if not self._penalties:
            return logits
        rows = logits.shape[0]
        tail = self.history[max(0, n_before - self._reach) : n_before]
        seq = mx.array(tail, dtype=mx.int32)
        if block is not None:
            seq = mx.concatenate([seq, block.reshape(-1).astype(mx.int32)[:rows]])
        first_end = len(tail) + (block is not None)  # row 0's history ends here in seq
        seen_by_context: dict[int, mx.array] = {}  # one mask per window: repetition and presence share it
        for kind, value, context in self._penalties:
            context = min(context, first_end + rows)  # no window reaches further back
            r, p = window_pairs(first_end, rows, context)
            if r.size == 0:
                continue
            r_idx, toks = mx.array(r), seq[mx.array(p)]
            if kind == "frequency":  # once per occurrence, as mlx-lm's scatter-subtract does
                logits = logits.at[r_idx, toks].subtract(value)
                continue
            if context not in seen_by_context:
                seen_by_context[context] = mx.zeros(logits.shape, mx.int32).at[r_idx, toks].add(1) > 0
            seen = seen_by_context[context]
            if kind == "repetition":
                logits = mx.where(seen, mx.where(logits < 0, logits * value, logits / value), logits)
            else:  # presence: once per distinct token
                logits = mx.where(seen, logits - value, logits)
        return logits


@lru_cache(maxsize=256)
def window_pairs(first_end: int, rows: int, context: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, position) pairs: row i's window is positions [end_i - context, end_i) of the
    sequence, end_i = first_end + i, clipped at 0."""
    ends = first_end + np.arange(rows)
    pos = ends[:, None] - context + np.arange(context)[None, :]
    keep = pos >= 0
    r = np.broadcast_to(np.arange(rows)[:, None], pos.shape)[keep].astype(np.int32)
    return r, pos[keep].astype(np.int32)
