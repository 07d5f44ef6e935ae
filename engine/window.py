"""How many of the draft's tokens to verify each cycle, and when not to draft at all.

The draft always proposes a whole block in one pass; verifying all of it is right when the draft is
good or when a wide verify costs about as much as one decode step (GPUs: M=16 costs ~1.5 steps).
On a CPU a 16-token verify costs ~2.4 steps, so a draft accepted only half the time is better
verified a few tokens at a time. "auto" picks the window k that maximises expected tokens per unit
of time: with per-token acceptance p (geometric, estimated from recent cycles) a window of k emits
E(k) = 1 + p + ... + p^(k-1) tokens, and costs 1 + d + c*(k-1) decode steps (c: each extra
verified token, a per-backend constant; d: the draft pass and the cycle's overhead).

d depends on the pair (a 5-layer draft with a 49K-vocabulary head is a large share of a 135M
target, a small one of an 8B), so it is measured while generating: now and then a cycle runs
as a plain decode step (window 1: no draft, the target's next token only, never wasted work),
which times a step; draft cycles are timed too, and d follows. When no window beats a plain
step (rate < 1), "auto" keeps decoding plainly and drafts now and then to notice when the text
turns predictable: after `probe_every` plain steps, a gap that doubles after every probe that
does not pay (up to `max_probe_gap`) and resets when one does or has all its drafts accepted.
A probe verifies `probe_window` tokens (one draft): the draft pass still runs whole, but the LM
head and the verify are at their cheapest, so a probe costs about one plain step more.
The output never depends on any of this: only the speed does.

Measurement hygiene (what keeps "auto" at acceptance ~0 close to plain decoding): a step's time is
the median of the last few plain steps (the first one after a draft cycle is not pipelined and
would inflate an average); the first draft cycle's time is not used (it also projects the whole
prompt into the draft's context); the first usable measurement of d replaces the prior instead
of being averaged with it, so a draft that does not pay is found out within a few cycles.

Copy drafting (engine/lookup.py) offers a second proposal when the text's last tokens occurred
before: the tokens that followed them. It needs no draft pass, so a copy window k costs
1 + o + c*(k-1) steps (o: the cycle's overhead, measured like d, small), and it is expected to
emit 1 + p' + ... + p'^(k-1) tokens, p' the running acceptance of copies raised for longer
matches (p' = p ** (min_ngram / n) for an n-token match: a longer match is likelier to go on,
and a long match gets tried again after copies failed). `plan` verifies the copy when its best
rate beats what the cycle would otherwise do: the model's window, or a plain step, which is
where copying matters most (repetitive text, a weak draft). Timing steps and probes of the
model draft are never displaced; a fixed window copies that many tokens (fewer if the proposal
is shorter) when that beats the model's draft at the same window; window 1 never copies.
"""

from __future__ import annotations

import os
import statistics
from collections import deque

import mlx.core as mx

from .lookup import CopyAcceptance

# Priors (c, d) per backend, in units of one decode step: c measured on SmolLM2-135M fp32 + MKL
# (CPU, M=16 / M=1 = 2.4) and on an 8B shape in bf16 (H200, M=16 / M=1 = 1.4-1.55); d is a start
# value that measurement replaces.
DEFAULT_COSTS = {"cpu": (0.09, 0.2), "gpu": (0.035, 0.3)}
COPY_OVERHEAD = 0.05  # o's prior: a copy cycle has no draft pass, only a host-side lookup


def rate(p: float, k: int, overhead: float, c: float) -> float:
    """Expected tokens per decode-step time of a window k at per-token acceptance p."""
    p = min(p, 0.999)
    return (1.0 - p**k) / (1.0 - p) / (1.0 + overhead + c * (k - 1))


class VerifyWindow:
    """Chooses the verify window each cycle; `fixed` pins it (tests, the published method).

    A fixed window of 1 is plain greedy decoding through the same loop (no draft pass);
    `allow_plain=False` (targets whose caches cannot undo one token) keeps every window >= 2.
    """

    def __init__(self, block_size: int, policy: str | int = "auto", allow_plain: bool = True,
                 decay: float = 0.9, probe_every: int = 8, max_probe_gap: int = 128,
                 remeasure_every: int = 64, probe_window: int = 2):
        self.block_size = block_size
        self.probe_window = probe_window
        self.allow_plain = allow_plain
        if policy == "auto":
            self.fixed = None
        elif policy == "full":
            self.fixed = block_size
        else:
            k = int(policy)
            if not 1 <= k <= block_size:
                raise ValueError(f"verify window must be 1..{block_size}, 'auto' or 'full'; got {policy}")
            if k == 1 and not allow_plain:
                raise ValueError("verify window 1 (plain steps) is not available for this target: "
                                 "its sliding-window cache cannot undo a single token; use 2 or more")
            self.fixed = k
        self.decay = decay
        self.probe_every = probe_every
        self.max_probe_gap = max_probe_gap
        self._probe_gap = probe_every
        self.remeasure_every = remeasure_every
        self.successes, self.failures = 2.0, 0.5  # prior: p = 0.8, worth ~2.5 cycles
        self.c, self.d = _costs()
        self.step_s: float | None = None  # measured seconds of a plain step (recent median)
        self._steps: deque[float] = deque(maxlen=9)
        self._draft_cycles = 0  # observed draft cycles; the first one's time is not used
        self._d_measured = False
        self.cycles = 0
        self._since_draft = 0  # cycles without the model's draft since its last one
        self._since_step = 0  # draft and copy cycles since the last timed plain step
        self._best = self.best()  # changes only when a draft cycle is observed
        self.copy = CopyAcceptance()  # per-token acceptance of copy proposals
        self.o = COPY_OVERHEAD  # a copy cycle's overhead beyond its verify, in plain steps

    @property
    def p(self) -> float:
        return self.successes / (self.successes + self.failures)

    def best(self) -> tuple[int, float]:
        """The window k >= 2 with the highest expected tokens per decode-step time, and that rate."""
        return max(((k, rate(self.p, k, self.d, self.c)) for k in range(2, self.block_size + 1)),
                   key=lambda t: t[1])

    def next(self) -> int:
        """The window of the next cycle without copy drafting (1: a plain step)."""
        return self._model()[0]

    def _model(self) -> tuple[int, float | None]:
        """The model draft's (or a plain step's) window, and the rate a copy must beat to
        replace it (None: it must run, a timing step, a probe or plain decoding)."""
        if self.fixed is not None:
            if self.fixed == 1:
                return 1, None
            return self.fixed, rate(self.p, self.fixed, self.d, self.c)
        k, best_rate = self._best
        if not self.allow_plain:
            return k, best_rate
        if self.cycles >= 1 and (self.step_s is None or self._since_step >= self.remeasure_every):
            return 1, None  # time a plain step: early, then again as the context grows
        if best_rate < 1.0:
            if self._since_draft < self._probe_gap:
                return 1, 1.0  # drafting does not pay at this acceptance: decode plainly for a while
            return min(k, self.probe_window), None  # a probe: the cheapest window testing the draft
        return k, best_rate

    def plan(self, copy_len: int = 0, strength: float = 1.0) -> tuple[int, bool]:
        """The next cycle: (window k, whether it verifies the copy proposal's first k-1 tokens).

        copy_len: tokens the copy proposal holds (0: no match); strength: its match length over
        the shortest match the lookup takes (>= 1; longer matches are likelier to continue).
        """
        k, to_beat = self._model()
        if copy_len < 1 or to_beat is None:
            return k, False
        p = self.copy.p ** (1.0 / max(strength, 1.0))
        top = min(copy_len + 1, self.block_size)
        windows = [min(self.fixed, top)] if self.fixed is not None else range(2, top + 1)
        k_copy, copy_rate = max(((j, rate(p, j, self.o, self.c)) for j in windows),
                                key=lambda t: t[1])
        return (k_copy, True) if copy_rate > to_beat else (k, False)

    def _overhead(self, seconds: float, window: int) -> float:
        """A cycle's cost beyond its verify (1 + c*(k-1) steps), in plain steps, clipped to 0..8."""
        return min(max(seconds / self.step_s - 1.0 - self.c * (window - 1), 0.0), 8.0)

    def observe(self, window: int, accepted: int, seconds: float | None = None,
                copied: bool = False) -> None:
        """A cycle verified window-1 drafts (`copied`: a copy proposal's), accepted the first
        `accepted`, and took `seconds`."""
        self.cycles += 1
        if copied:  # not a draft cycle: the model's estimates and the probe schedule stay
            self._since_draft += 1
            self._since_step += 1
            self.copy.observe(window - 1, accepted)
            if self.fixed is None and seconds is not None and self.step_s:
                self.o = 0.8 * self.o + 0.2 * self._overhead(seconds, window)
            return
        if window == 1:
            self._since_draft += 1
            self._since_step = 0
            if seconds is not None and seconds > 0:
                self._steps.append(seconds)
                self.step_s = statistics.median(self._steps)
            return
        self._since_draft = 0
        self._since_step += 1
        self._draft_cycles += 1
        self.successes = self.successes * self.decay + accepted
        self.failures = self.failures * self.decay + (1 if accepted < window - 1 else 0)
        if (self.fixed is None and seconds is not None and self.step_s
                and self._draft_cycles > 1):
            d = self._overhead(seconds, window)
            self.d = 0.8 * self.d + 0.2 * d if self._d_measured else d
            self._d_measured = True
        self._best = self.best()
        if accepted < window - 1 and self._best[1] < 1.0:  # drafting does not pay: probe less often
            self._probe_gap = min(self._probe_gap * 2, self.max_probe_gap)
        else:  # it pays, or every verified draft was taken: look again soon
            self._probe_gap = self.probe_every


def _costs() -> tuple[float, float]:
    env = os.environ.get("DFLASH_VERIFY_COST")
    if env:
        c, d = (float(x) for x in env.split(","))
        return c, d
    return DEFAULT_COSTS["gpu" if mx.default_device() == mx.gpu else "cpu"]
