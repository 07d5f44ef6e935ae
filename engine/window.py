"""How many of the draft's tokens to verify each cycle, and when not to draft at all.

The draft always proposes a whole block in one pass; verifying all of it is right when the draft is
good or when a wide verify costs about as much as one decode step (GPUs: M=16 costs ~1.5 steps).
On a CPU a 16-token verify costs ~3 steps, so a draft accepted only half the time is better
verified a few tokens at a time. "auto" picks the window k that maximises expected tokens per unit
of time: with per-token acceptance p (geometric, estimated from recent cycles) a window of k emits
E(k) = 1 + p + ... + p^(k-1) tokens, and costs v(k) + d decode steps (v(k): a k-token verify
in decode steps, a per-backend prior; d: the draft pass and the cycle's overhead). On a GPU v is
close to linear, 1 + c*(k-1). On the CPU it is not: with one-row products padded (rowpad.py) a
2-token verify costs what a plain step does, 3 and 4 tokens cost 1.5 and 1.7 steps, 16 cost 3.

d depends on the pair (a 5-layer draft with a 49K-vocabulary head is a large share of a 135M
target, a small one of an 8B), so it is measured while generating: now and then a cycle runs
as a plain decode step (window 1: no draft, the target's next token only, never wasted work),
which times a step; draft cycles are timed too, and d follows. When no window beats a plain
step (rate < 1), "auto" keeps decoding plainly and drafts now and then to notice when the text
turns predictable: after `probe_every` plain steps, a gap that doubles after every probe that
does not pay (up to `max_probe_gap`, and with narrow windows up to what keeps a failed probe's
cost within PROBE_SHARE of the stretch) and resets when one does or has all its drafts accepted.
A probe verifies `probe_window` tokens (one draft): the draft pass still runs whole, but the LM
head and the verify are at their cheapest, so a probe costs about one plain step more.
A draft cycle right after plain steps is never timed (narrow windows): it also drains the plain
step queued ahead and adds the whole plain stretch to the draft's context, so a probe drafts a
second cycle, and that one measures the overhead (session 35: probes timed on their first cycle
read d_short 0.5-0.7 where drafting costs ~0.2, and kept the daemon's jobs plain).
The output never depends on any of this: only the speed does.

Cut blocks (a draft whose config allows them, `short_max` >= 2; engine/drafters.py): a window k up to
`short_max` drafts with a block of k rows instead of B, a draft pass about half as dear on a CPU
(2 rows: 9 ms against 20 ms for SmolLM2's draft, 200-row context). Its overhead is measured apart
(d_short, prior d * SHORT_D_PRIOR), since one d would mix the two passes' costs and mislead both.

Wide windows (a GPU's default; DFLASH_WINDOW_WIDE=1|0 sets it anywhere): the choice is the
whole block or a plain step, by what whole-block cycles are measured to emit. The geometric model
undervalues long windows: a run of accepted drafts is likelier to go on than p says (held-out
P(accept >= k), k = 1..8: 0.67 0.43 0.28 0.20 0.15 0.12 0.09 0.07, so 0.64-0.80 a step, rising),
and on a GPU a 16-token verify costs little more than an 8-token one. So "wide" keeps a running
mean of the tokens a whole-block cycle emitted (`full_tokens`, prior: the geometric value at the
prior p) and drafts the whole block while full_tokens / (v(B) + d) >= 1, a rate measured rather
than modelled (d is measured on those same cycles); below it, plain steps, and the probes verify
the whole block too, so the measurement can recover. Measured on the H200 (session 18,
scripts/arms_ab.py, 5 chat + 11 held-out prompts, 256 tokens, interleaved, two machines):
the model's own window 1.27x / 1.40x of mlx-lm, 8 tokens 1.42x, the whole block every cycle
1.63x / 1.76x; a first wide rule (the whole block when the geometric rate(B) >= 1) 1.42x, no
better than the model's window, since that rate is below 1 where whole blocks pay. On a CPU a
16-token verify costs ~3 steps against ~1.7 for 4, and the model's window stays.
The mean of tokens per whole-block cycle is noisy (a cycle emits 1 to 16), and a mean that
remembered ~10 cycles dipped below the bar on texts where whole blocks paid; each probe that then
failed to lift it doubled the plain stretch, up to 128 steps, half a 256-token answer. Timed on
mlx-lm's own texts (session 22, H200 bf16, `scripts/arms_ab.py --teach`, 16 prompts x 3 rounds,
48 pairs): the whole block every cycle ran 1.091x (1.041-1.143) of that rule, probes at most 16
apart 1.040x (0.996-1.086). So wide windows now remember ~33 whole-block cycles (`full_decay`
0.97) and probe at most 16 plain steps apart (WIDE_PROBE_GAP). Replayed on fixed texts at 2.0-
and 2.7-step cycles (scripts/window_sim.py) the pair is at or above both the old rule and the
whole block, and where nothing is accepted it runs 0.90-0.92 of plain decoding (the old rule
0.96: a whole-block probe every 17 tokens instead of every 129). Live, with CUDA graphs off (accel.py;
12 pairs on mlx-lm's texts, one round): this rule 1.94x of mlx-lm, the old one 1.87x, the whole
block 1.90x.

Windows chosen by the draft's confidence (opt-in: DFLASH_WINDOW_CONFIDENCE=1, where "auto" uses
the model's window): when the model's window needs the whole block drafted anyway (k >
short_max), the host reads the draft's own probability of each proposal c_1..c_15 before the
verify and takes the window j with the most expected tokens per cost,
(1 + c_1 + c_1*c_2 + ... + c_1*...*c_(j-1)) / (v(j) + d). The draft is calibrated (held-out,
session 19: proposals at 0.9+ accepted 98% of the time, at 0.5 65%, at 0.1 26%), so a cycle
verifies as far as this block's drafts are likely right instead of as far as recent blocks were.
It costs a second host read a cycle and the LM head over all 15 rows. Replayed on held-out traces
(scripts/window_sim.py, CPU costs, cut blocks) it gave 1.57 -> 1.64 tokens a step-time; measured
on the CPU in one process (scripts/arms_ab.py, 74 paired generations in two runs) it tied:
1.019x (0.988-1.050) and 0.990x (0.940-1.044) of the model's window, so it stays off by default.
Never with wide windows (a GPU's: there a window costs about the same whatever its width, and the
read would stall the launches that overlap the draft). Greedy only: a sampled draft's window must
not depend on its draws.

A long-lived caller (the daemon's worker) hands the same `WindowMemory` to every generation of a
pair: what one generation measured (d, o, the acceptance of drafts and copies) becomes the next
one's prior, so a short answer does not pay the first cycles' exploration each time (a draft
that does not pay is not tried at p = 0.8 again). Acceptance depends on the text, so it carries
the weight of a few cycles only; the plain step is timed afresh (it depends on the context).

Measurement hygiene (what keeps "auto" at acceptance ~0 close to plain decoding): a step's time is
the median of the last few plain steps (the first one after a draft cycle is not pipelined and
would inflate an average), and each overhead the median of its last few measurements (a VM's
stalled cycle would move a mean for many cycles); the first draft cycle's time is not used (it
also projects the whole prompt into the draft's context); the first usable measurement of d
replaces the prior instead of being averaged with it, so a draft that does not pay is found out
within a few cycles.

Copy drafting (engine/lookup.py) offers a second proposal when the text's last tokens occurred
before: the tokens that followed them. It needs no draft pass, so a copy window k costs
v(k) + o steps (o: the cycle's overhead, measured like d, small), and it is expected to
emit 1 + p' + ... + p'^(k-1) tokens, p' the running acceptance of copies raised for longer
matches (p' = p ** (min_ngram / n) for an n-token match: a longer match is likelier to go on,
and a long match gets tried again after copies failed). `plan` verifies the copy when its best
rate beats what the cycle would otherwise do: the model's window, or a plain step, which is
where copying matters most (repetitive text, a weak draft). Timing steps and probes of the
model draft are never displaced; a fixed window copies that many tokens (fewer if the proposal
is shorter) when that beats the model's draft at the same window; window 1 never copies.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import deque
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .accel import env_switch
from .lookup import CopyAcceptance

# Verify cost priors per backend, in decode steps. CPU: a k-token forward of SmolLM2-135M fp32 +
# MKL on a 2-core VM at a 300-token cache, one-row products padded (medians of 3 x 5, session 6:
# 49.1, 48.4, 72.4, 84.3, 95.6, 98.2, 103.8, 125.2, 145.5 ms; 2 tokens taken as 1.0), interpolated
# between these points.
# Another CPU, another curve: on session 7's Intel Xeon VM (row plans, 300-token cache) 2, 3, 4, 6,
# 8, 12, 16 tokens cost 1.04, 1.09, 1.66, 1.69, 2.04, 2.72, 2.24 steps; d absorbs part of the gap
# for the widths in use, and this table stays the prior. Session 12's Xeon VM with MKL threaded over
# both cores (accel.py's default since), the same k-token verify at a 300-token cache, two runs: 2, 3, 4,
# 5, 6, 8, 12, 16 tokens cost 1.18-1.23, 1.28-1.35, 1.54-1.62, 1.66, 1.71-1.81, 1.80-1.83, 2.09-2.36,
# 2.30-2.39 steps; session 14's VM (60-200-token cache, medians of 5 interleaved rounds): 1.12, 1.23,
# 1.46, 1.55, 1.59, 1.83, 2.06, 2.14. That measured curve as the prior did not pay (session 14, two
# interleaved pairs of `dflash benchmark --chat --max-tokens 128 --repeats 2`: geometric means 1.57x
# and 1.69x against this table's 1.73x and 1.71x): it drafts more where acceptance is 10-20%, while
# a padded plain step already runs 1.1-1.2x mlx-lm's, so this table's lean to plain steps stays.
# GPU: linear, c = 0.035 a token (an 8B shape in bf16 on the H200: M=16 / M=1 = 1.4-1.55).
# d is a start value that measurement replaces.
CPU_VERIFY_COST = {1: 1.0, 2: 1.0, 3: 1.47, 4: 1.72, 5: 1.95, 6: 2.0, 8: 2.11, 12: 2.55, 16: 2.96}
DEFAULT_COSTS = {"cpu": (CPU_VERIFY_COST, 0.2), "gpu": (0.035, 0.3)}
WIDE_ENV = "DFLASH_WINDOW_WIDE"  # 1: the whole block or a plain step, measured; 0: the model's best k
TRACE_ENV = "DFLASH_WINDOW_TRACE"  # a file: one JSON line per observed cycle (what the policy saw and chose)
CONFIDENCE_ENV = "DFLASH_WINDOW_CONFIDENCE"  # 1: a drafted block's window re-chosen by its confidence
RECALL_ENV = "DFLASH_WINDOW_RECALL_ACCEPTANCE"  # 1: a remembered acceptance seeds the next run too
COPY_OVERHEAD = 0.05  # o's prior: a copy cycle has no draft pass, only a host-side lookup
SHORT_D_PRIOR = 0.5  # d_short's prior, a share of d: a cut block's draft pass is ~half the whole's


def expected_tokens(p: float, k: int) -> float:
    """Tokens a window of k emits at per-token acceptance p: 1 + p + ... + p^(k-1)."""
    p = min(p, 0.999)
    return (1.0 - p**k) / (1.0 - p)


def rate(p: float, k: int, overhead: float, verify_cost: float) -> float:
    """Expected tokens per decode-step time of a window k at per-token acceptance p, when its
    verify costs `verify_cost` decode steps and the cycle `overhead` more."""
    return expected_tokens(p, k) / (verify_cost + overhead)


def verify_costs(prior: float | dict[int, float], block_size: int) -> list[float]:
    """v(k) for k = 0..block_size (index k; v(0) unused): 1 + prior*(k-1) for a linear prior,
    else the table interpolated linearly (and extended past its last point by its last slope)."""
    ks = range(block_size + 1)
    if not isinstance(prior, dict):
        return [1.0 + prior * (k - 1) for k in ks]
    xs, ys = zip(*sorted(prior.items()))
    k1, v1 = xs[-1], ys[-1]
    slope = (v1 - ys[-2]) / (k1 - xs[-2])
    return [1.0] + [float(np.interp(k, xs, ys)) if k <= k1 else v1 + slope * (k - k1) for k in ks[1:]]


PRIOR_WEIGHT = 2.5  # cycles' worth of a remembered acceptance (as much as the built-in prior)
PROBE_GAP = 128  # the longest run of plain steps between probes (narrow windows: a CPU's)
WIDE_PROBE_GAP = 16  # the same with wide windows (a GPU's), where whole blocks pay most
FULL_DECAY = 0.97  # the memory of tokens per whole-block cycle (wide windows): ~33 cycles
PROBE_SHARE = 0.04  # narrow windows: failed probes cost at most this share of a plain stretch
MIN_PLAIN_SAMPLES = 3  # pipelined plain steps a run needs before it estimates its speedup
# A measured overhead (d, d_short, o) is the median of its last few measurements, as a plain step
# is: a shared VM stalls a cycle now and then (session 39, the demo prompt on a 2-core Xeon,
# DFLASH_WINDOW_TRACE: 2-3 cycles a 160-token job took 140-200 ms where their kind took 35-50), and
# a running mean moved d_short from 0.21 to 0.76 on one such 2-token cycle, which sent the job into
# plain steps for 17+ cycles and, handed on, started the daemon's next job at 0.93.
OVERHEAD_SAMPLES = 7


@dataclass
class WindowMemory:
    """What earlier generations of one pair measured (None: not yet), for the next one's priors."""

    d: float | None = None  # a draft cycle's overhead, in plain steps
    d_short: float | None = None  # the same for a block cut to its window (short_max)
    o: float | None = None  # a copy cycle's overhead
    p: float | None = None  # per-token acceptance of the model's draft
    full_tokens: float | None = None  # tokens a whole-block draft cycle emitted (wide windows)
    copy_p: float | None = None  # per-token acceptance of copies


def fixed_window(policy: str | int, block_size: int, allow_plain: bool = True) -> int | None:
    """The window a policy pins ("full": the block; a count), None for "auto"; ValueError for a
    policy the draft's block (or, with `allow_plain=False`, the target's caches) cannot take.
    The daemon checks a job's window here before it runs (daemon/compute.py)."""
    if policy == "auto":
        return None
    if policy == "full":
        return block_size
    try:
        k = int(policy)
    except (TypeError, ValueError):
        raise ValueError(f"verify window must be 1..{block_size}, 'auto' or 'full'; got {policy!r}") from None
    if k > block_size:
        raise ValueError(f"verify window {k} is larger than this draft's block of {block_size} tokens")
    if k < 1:
        raise ValueError(f"verify window must be 1..{block_size}, 'auto' or 'full'; got {policy}")
    if k == 1 and not allow_plain:
        raise ValueError("verify window 1 (plain steps) is not available for this target: "
                         "its sliding-window cache cannot undo a single token; use 2 or more")
    return k


class VerifyWindow:
    """Chooses the verify window each cycle; `fixed` pins it (tests, the published method).

    A fixed window of 1 is plain greedy decoding through the same loop (no draft pass);
    `allow_plain=False` (targets whose caches cannot undo one token) keeps every window >= 2.
    """

    def __init__(self, block_size: int, policy: str | int = "auto", allow_plain: bool = True,
                 decay: float = 0.9, probe_every: int = 8, max_probe_gap: int | None = None,
                 remeasure_every: int = 64, probe_window: int = 2,
                 memory: WindowMemory | None = None, short_max: int = 0,
                 full_decay: float = FULL_DECAY):
        self.block_size = block_size
        self.short_max = short_max  # windows up to this draft with a block cut to k rows
        self.probe_window = probe_window
        self.allow_plain = allow_plain
        self.fixed = fixed_window(policy, block_size, allow_plain)
        self.decay = decay
        self.probe_every = probe_every
        self.wide = wide_windows()
        if max_probe_gap is None:
            max_probe_gap = WIDE_PROBE_GAP if self.wide else PROBE_GAP
        self.max_probe_gap = max_probe_gap
        self.full_decay = full_decay
        self._probe_gap = probe_every
        self.remeasure_every = remeasure_every
        self.successes, self.failures = 2.0, 0.5  # prior: p = 0.8, worth ~2.5 cycles
        prior, self.d = _costs()
        self.d_short = self.d * SHORT_D_PRIOR
        # each overhead's recent measurements (see OVERHEAD_SAMPLES; none yet: the prior stands);
        # the first replaces the prior
        self._d_samples: deque[float] = deque(maxlen=OVERHEAD_SAMPLES)
        self._d_short_samples: deque[float] = deque(maxlen=OVERHEAD_SAMPLES)
        self.v = verify_costs(prior, block_size)  # v[k]: a k-token verify, in decode steps
        self.step_s: float | None = None  # measured seconds of a plain step (recent median)
        self._steps: deque[float] = deque(maxlen=9)
        # every pipelined plain step of the run (one right after another plain step), for the
        # speedup estimate: its mean, not the policy's median, as a whole plain run would pay
        self._plain_total, self._plain_count, self._last_plain = 0.0, 0, False
        self._draft_cycles = 0  # observed draft cycles; the first one's time is not used
        # a probe came right after plain steps: its time holds the plain stretch's deferred work,
        # so the next cycle drafts again and is timed (narrow windows; see _steady)
        self._retime = False
        self.cycles = 0
        self._since_draft = 0  # cycles without the model's draft since its last one
        self._since_step = 0  # draft and copy cycles since the last timed plain step
        # windows re-chosen from the draft's confidence (see the module doc): the model's window only
        self.confident = confidence_windows() and self.fixed is None and not self.wide
        # wide windows: tokens per whole-block draft cycle, a decayed mean (prior: the geometric
        # value at the prior p, worth as many cycles as p's prior)
        self._full_n = PRIOR_WEIGHT
        self._full_sum = PRIOR_WEIGHT * expected_tokens(self.p, block_size)
        self._full_seen = False
        self._best = self.best()  # changes only when a draft cycle is observed
        self.copy = CopyAcceptance()  # per-token acceptance of copy proposals
        self.o = COPY_OVERHEAD  # a copy cycle's overhead beyond its verify, in plain steps
        if memory is not None and self.fixed is None:
            self._recall(memory)
        # copies are timed after plain stretches too, so o's prior stays one of its samples
        self._o_samples: deque[float] = deque([self.o], maxlen=OVERHEAD_SAMPLES)
        # the policy's own view, cycle by cycle, where a run's speed needs explaining (a daemon's
        # job spending most cycles on plain steps where one process did not: session 34)
        trace = os.environ.get(TRACE_ENV)
        self._trace = open(trace, "a", buffering=1) if trace and self.fixed is None else None

    @property
    def p(self) -> float:
        return self.successes / (self.successes + self.failures)

    def _recall(self, m: WindowMemory) -> None:
        """Priors from earlier generations of this pair (see WindowMemory)."""
        # remembered overheads are priors that this run's first steady measurement replaces
        # (_steady): a machine's load moves between jobs, and a stored value that was too high
        # once made every later job decode plainly (session 35)
        if m.d is not None:
            self.d = m.d
            self.d_short = m.d * SHORT_D_PRIOR
        if m.d_short is not None and self.short_max:
            self.d_short = m.d_short
        if m.o is not None:
            self.o = m.o
        if recall_acceptance():  # the text's, not the machine's: off by default (see there)
            if m.p is not None:
                self.successes, self.failures = m.p * PRIOR_WEIGHT, (1.0 - m.p) * PRIOR_WEIGHT
            if m.full_tokens is not None:
                self._full_n, self._full_sum = PRIOR_WEIGHT, m.full_tokens * PRIOR_WEIGHT
            if m.copy_p is not None:
                w = self.copy.successes + self.copy.failures
                self.copy.successes, self.copy.failures = m.copy_p * w, (1.0 - m.copy_p) * w
        self._best = self.best()

    def remember(self, m: WindowMemory) -> None:
        """Hand what this generation measured to the next one (auto windows only)."""
        if self.fixed is not None:
            return
        if self._d_samples:
            m.d = self.d
        if self._d_short_samples:
            m.d_short = self.d_short
        if self._draft_cycles:
            m.p = self.p
        if self._full_seen:
            m.full_tokens = self.full_tokens
        if self.copy.observed:
            m.copy_p, m.o = self.copy.p, self.o

    @property
    def plain_step_mean(self) -> float | None:
        """Mean seconds of this run's pipelined plain steps: what a token of plain decoding costs
        here, the VM's stalls included as they hit every cycle alike. None below
        MIN_PLAIN_SAMPLES of them: one or two steps queued right behind another measure the
        overlap more than the step (session 23: a code answer's stats line read "~0.27x" from
        one)."""
        if self._plain_count < MIN_PLAIN_SAMPLES:
            return None
        return self._plain_total / self._plain_count

    @property
    def full_tokens(self) -> float:
        """Tokens a whole-block draft cycle emits, as measured (wide windows; see the module doc)."""
        return self._full_sum / self._full_n

    def best(self) -> tuple[int, float]:
        """The window k >= 2 with the highest expected tokens per decode-step time, and that rate;
        with wide windows the whole block, at its measured rate."""
        B = self.block_size
        if self.wide:
            return B, self.full_tokens / (self.v[B] + self.overhead(B))
        return max(((k, rate(self.p, k, self.overhead(k), self.v[k])) for k in range(2, B + 1)),
                   key=lambda t: t[1])

    def overhead(self, window: int) -> float:
        """A draft cycle's cost beyond its verify, in plain steps, for this window's block."""
        return self.d_short if window <= self.short_max else self.d

    def likely_full(self, window: int) -> bool:
        """Whether a cycle of this window is likelier than not to have every draft accepted
        (p^(k-1) >= 1/2): then the next cycle's draft is worth queueing before it is read."""
        return window >= 2 and self.p ** (window - 1) >= 0.5

    def reads_draft(self, window: int) -> bool:
        """Whether a cycle of this window drafts the whole block and lets its confidence choose
        the window (after_draft)."""
        return self.confident and window > self.short_max

    def after_draft(self, confidence: list[float]) -> int:
        """The window for a drafted whole block whose proposals the draft gives probabilities
        `confidence` (c_1..c_(B-1)): the most expected tokens per cost (see the module doc)."""
        best_k, best, expected, run = 2, -1.0, 1.0, 1.0
        for k in range(2, self.block_size + 1):
            run *= min(max(confidence[k - 2], 0.0), 1.0)
            expected += run
            r = expected / (self.v[k] + self.d)
            if r > best:
                best_k, best = k, r
        return best_k

    def next(self) -> int:
        """The window of the next cycle without copy drafting (1: a plain step)."""
        return self._model()[0]

    def _model(self) -> tuple[int, float | None]:
        """The model draft's (or a plain step's) window, and the rate a copy must beat to
        replace it (None: it must run, a timing step, a probe or plain decoding)."""
        if self.fixed is not None:
            if self.fixed == 1:
                return 1, None
            return self.fixed, rate(self.p, self.fixed, self.overhead(self.fixed), self.v[self.fixed])
        k, best_rate = self._best
        if not self.allow_plain:
            return k, best_rate
        if self.cycles >= 1 and (self.step_s is None or self._since_step >= self.remeasure_every):
            return 1, None  # time a plain step: early, then again as the context grows
        if best_rate < 1.0:
            if self._retime:  # the probe's second cycle, the one that times a draft cycle (a copy
                return min(k, self.probe_window), 1.0  # that beats a plain step may take it instead)
            if self._since_draft < self._probe_gap:
                return 1, 1.0  # drafting does not pay at this acceptance: decode plainly for a while
            # a probe: the cheapest window testing the draft (wide: the whole block, which is
            # what the measured rate needs, and costs little more on the devices that use it)
            return (k if self.wide else min(k, self.probe_window)), None
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
        k_copy, copy_rate = max(((j, rate(p, j, self.o, self.v[j])) for j in windows),
                                key=lambda t: t[1])
        return (k_copy, True) if copy_rate > to_beat else (k, False)

    def _overhead(self, seconds: float, window: int) -> float:
        """A cycle's cost beyond its verify (v(k) steps), in plain steps, clipped to 0..8."""
        return min(max(seconds / self.step_s - self.v[window], 0.0), 8.0)

    def observe(self, window: int, accepted: int, seconds: float | None = None,
                copied: bool = False, whole_block: bool = False) -> None:
        """A cycle verified window-1 drafts (`copied`: a copy proposal's), accepted the first
        `accepted`, and took `seconds`; `whole_block`: the draft ran whole whatever the window
        (after_draft), so its time is a whole block's even for a window short_max would cut."""
        self.cycles += 1
        after_plain, self._last_plain = self._last_plain, window == 1 and not copied
        retimed, self._retime = self._retime, False
        if copied:  # not a draft cycle: the model's estimates and the probe schedule stay
            self._since_draft += 1
            self._since_step += 1
            self.copy.observe(window - 1, accepted)
            if self.fixed is None and seconds is not None and self.step_s:
                self.o = _measured(self._o_samples, self._overhead(seconds, window))
            self._log(window, accepted, seconds, copied)
            return
        if window == 1:
            self._since_draft += 1
            self._since_step = 0
            if seconds is not None and seconds > 0:
                self._steps.append(seconds)
                self.step_s = statistics.median(self._steps)
                if after_plain:
                    self._plain_total += seconds
                    self._plain_count += 1
            self._log(window, accepted, seconds, copied)
            return
        self._since_draft = 0
        self._since_step += 1
        self._draft_cycles += 1
        steady = self._steady(after_plain)
        self._retime = not steady and self.fixed is None  # time the next one (a probe's second cycle)
        self.successes = self.successes * self.decay + accepted
        self.failures = self.failures * self.decay + (1 if accepted < window - 1 else 0)
        if window == self.block_size:
            self._full_n = self._full_n * self.full_decay + 1.0
            self._full_sum = self._full_sum * self.full_decay + accepted + 1.0
            self._full_seen = True
        if (self.fixed is None and seconds is not None and self.step_s
                and self._draft_cycles > 1 and steady):
            d = self._overhead(seconds, window)
            if window <= self.short_max and not whole_block:
                self.d_short = _measured(self._d_short_samples, d)
            else:
                self.d = _measured(self._d_samples, d)
        self._best = self.best()
        if accepted < window - 1 and self._best[1] < 1.0:  # drafting does not pay: probe less often
            # (a probe's second cycle: the gap grew on its first; its measured cost may cap it)
            self._probe_gap = min(self._probe_gap * (1 if retimed else 2), self._gap_cap())
        else:  # it pays, or every verified draft was taken: look again soon
            self._probe_gap = self.probe_every
        self._log(window, accepted, seconds, copied)

    def _gap_cap(self) -> int:
        """The longest plain stretch between probes: max_probe_gap, and with narrow windows no
        longer than keeps a probe that accepts nothing within PROBE_SHARE of the stretch's time.

        A 2-token probe of a cut block costs v(2) + d_short - 1 ~ 0.25 plain steps more than the
        step it replaces (0.5 for the pair of cycles that times it), while a stretch wrongly
        plain loses ~20% of the text's speed: at acceptance ~0.45 a run of misses can drag the
        estimate p below the bar, and a gap doubling to 128 after each failed probe then kept
        109-120 of 135 cycles plain (session 35, the demo prompt in one process and in the
        daemon; the same text drafts at 26-28 tok/s against 22-23)."""
        if self.wide:
            return self.max_probe_gap
        k = self.probe_window
        cost = 2.0 * max(self.v[k] + self.overhead(k) - 1.0, 0.0)
        return int(min(self.max_probe_gap, max(self.probe_every, math.ceil(cost / PROBE_SHARE - 1e-9))))

    def _steady(self, after_plain: bool) -> bool:
        """Whether a draft cycle's time is a draft cycle's own (narrow windows): not when it came
        right after a plain step. Plain steps are queued one ahead and feed the draft's context
        nothing until the next draft, so the first draft cycle after them also drains the last
        queued step and adds every row of the plain stretch to the draft's context. Session 35,
        SmolLM2-135M fp32 on the 2-core CPU (DFLASH_WINDOW_TRACE): in a daemon gone plain,
        2-token probes after 16-32 plain steps took 74-85 ms (a plain step 49 ms), where a daemon
        drafting steadily ran 2-token cycles in 56-60 ms, so each probe measured d_short 0.5-0.7
        and kept it there. In one process such probes cost what the next cycles did (1.24-1.26
        steps against 1.22-1.28), so skipping them costs nothing there. Wide windows (a GPU's)
        keep timing every draft cycle, as measured there (module doc)."""
        return self.wide or not after_plain

    def _log(self, window: int, accepted: int, seconds: float | None, copied: bool) -> None:
        """One line of DFLASH_WINDOW_TRACE: this cycle and the estimates it left."""
        if self._trace is None:
            return
        self._trace.write(json.dumps({
            "cycle": self.cycles, "window": window, "accepted": accepted, "copied": copied,
            "seconds": seconds, "step_s": self.step_s, "d": self.d, "d_short": self.d_short,
            "o": self.o, "p": self.p, "best": list(self._best), "probe_gap": self._probe_gap}) + "\n")


def _measured(samples: deque[float], new: float) -> float:
    """An overhead's estimate after a new measurement: the median of its recent ones (a stalled
    cycle does not move it; see OVERHEAD_SAMPLES)."""
    samples.append(new)
    return statistics.median(samples)


def wide_windows() -> bool:
    """Whether "auto" chooses between the whole block and a plain step only (wide windows): on a
    GPU, unless DFLASH_WINDOW_WIDE says otherwise (1 or 0)."""
    return env_switch(WIDE_ENV, mx.default_device() == mx.gpu)


def recall_acceptance() -> bool:
    """Whether a WindowMemory's acceptances (p, full_tokens, copy_p) seed the next run's priors
    beside its costs: DFLASH_WINDOW_RECALL_ACCEPTANCE=1 (off by default since session 37).

    Costs (a draft or copy cycle's overhead in plain steps) belong to the machine and the pair,
    and every job meets the same ones. Acceptance belongs to the text: with the same draft the
    five chat questions run 1.3-9.8 tokens a cycle on the CPU, so one job's acceptance is a poor
    prior for the next, and a low one sends an easy prompt into plain steps until a probe finds
    out. Measured in one process on the 2-core CPU (`scripts/arms_ab.py --heldout 7 --rounds 2`,
    24 pairs an arm, against a fresh window every run): carrying everything 0.944x (0.905-0.985),
    2.38 tokens a cycle against 2.77; again, beside costs only: everything 0.976x (0.949-1.005),
    2.63 tokens a cycle, costs only 0.984x (0.956-1.012), 2.78, fresh 2.80. On an H100 the
    daemon, which carried everything, ran 2.84-3.54 tokens a cycle where the same prompts
    in-process ran 3.58."""
    return env_switch(RECALL_ENV, False)


def confidence_windows() -> bool:
    """Whether "auto" without wide windows lets the draft's confidence choose a drafted whole
    block's window (greedy; see the module doc): DFLASH_WINDOW_CONFIDENCE=1 (off by default)."""
    return env_switch(CONFIDENCE_ENV, False)


def _costs() -> tuple[float | dict[int, float], float]:
    """(verify cost prior, d prior) for this backend; DFLASH_VERIFY_COST="c,d" sets a linear one."""
    env = os.environ.get("DFLASH_VERIFY_COST")
    if env:
        c, d = (float(x) for x in env.split(","))
        return c, d
    return DEFAULT_COSTS["gpu" if mx.default_device() == mx.gpu else "cpu"]
