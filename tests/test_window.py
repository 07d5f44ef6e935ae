"""engine/window.py's "auto" policy at acceptance ~0, and how the loop feeds the draft.

Speed itself is measured by `dflash benchmark` (docs/benchmark.md), never asserted here: these
tests pin the decisions that make it (how soon drafting stops, how rarely it probes, what the
measurements are made of) on a synthetic clock, and count the loop's calls on a tiny pair.
"""

from __future__ import annotations

import pytest

from dflash.engine.window import VerifyWindow
from helpers import greedy_reference, run_dflash

STEP = 0.010  # seconds of a plain step


def _run(w: VerifyWindow, cycles: int, accept, draft_cost: float) -> list[int]:
    """Drive the policy: accept(k) drafts accepted, a draft cycle costs draft_cost plain steps."""
    ks = []
    for _ in range(cycles):
        k = w.next()
        ks.append(k)
        w.observe(k, 0 if k == 1 else accept(k), STEP if k == 1 else draft_cost * STEP)
    return ks


def test_at_acceptance_zero_drafting_stops_within_a_few_cycles_and_probes_rarely() -> None:
    w = VerifyWindow(16, "auto")
    ks = _run(w, 512, lambda k: 0, draft_cost=2.5)
    drafts = [i for i, k in enumerate(ks) if k > 1]
    assert len([i for i in drafts if i < 12]) <= 3  # found out early
    # then probes, each two draft cycles in a row (the second is the one timed), with a gap that
    # doubles up to what keeps their cost ~4% of the plain stretch (_gap_cap: 75 steps here,
    # where a 2-token probe costs 2.5 steps)
    firsts = drafts[3::2]
    assert all(b == a + 1 for a, b in zip(drafts[3::2], drafts[4::2]))
    gaps = [b - a for a, b in zip(firsts, firsts[1:])]
    assert gaps == sorted(gaps) and max(gaps) == w._gap_cap() + 2 and len(drafts) <= 20
    assert max(ks[12:]) <= 4  # probes are short windows: the cheap ones
    cost = sum(1 if k == 1 else 2.5 for k in ks)
    assert len(ks) / cost > 0.94  # tokens per plain-step time: within 6% of plain decoding


def test_a_good_draft_keeps_drafting() -> None:
    w = VerifyWindow(16, "auto")
    ks = _run(w, 100, lambda k: k - 1, draft_cost=2.5)
    assert ks.count(1) <= 3 and ks[-1] == 16  # one timed plain step, then whole blocks


def test_first_draft_cycle_time_is_not_used_and_the_first_measurement_replaces_the_prior() -> None:
    w = VerifyWindow(16, "auto")
    prior = w.d
    k = w.next()
    w.observe(k, 0, 50 * STEP)  # prefill's draft context is projected in this one
    assert w.d == prior
    assert w.next() == 1  # then a plain step is timed
    w.observe(1, 0, STEP)
    k = w.next()
    assert k > 1
    w.observe(k, 0, 9 * STEP)  # right after a plain step: not used either (_steady)
    assert w.d == prior
    w.observe(k, 0, 4 * STEP)
    assert w.d == pytest.approx(4 - w.v[k])  # replaced, not averaged with the prior


def test_step_time_is_a_median_an_unpipelined_step_does_not_skew_it() -> None:
    w = VerifyWindow(16, "auto")
    for s in (STEP, STEP, 9 * STEP, STEP, STEP):
        w.observe(1, 0, s)
    assert w.step_s == pytest.approx(STEP)


def test_the_speedup_estimate_uses_the_mean_of_pipelined_plain_steps() -> None:
    """The policy decides on a median; the estimate (stats.est_speedup) needs what plain decoding
    would pay per token, the VM's stalls included: the mean, over plain steps that follow a
    plain step (the first one, and one after a draft or copy cycle, is not pipelined)."""
    w = VerifyWindow(16, "auto")
    assert w.plain_step_mean is None
    w.observe(1, 0, 5 * STEP)  # the first: not pipelined
    for s in (STEP, 3 * STEP):  # a stall counts in the mean (not in the median of the policy)
        w.observe(1, 0, s)
    assert w.plain_step_mean is None  # two pipelined steps are not an estimate yet
    w.observe(4, 0, 6 * STEP)  # a draft cycle
    w.observe(1, 0, 9 * STEP)  # right after it: not pipelined
    w.observe(3, 2, 2 * STEP, copied=True)  # a copy cycle
    w.observe(1, 0, 9 * STEP)  # right after it: not pipelined
    w.observe(1, 0, 2 * STEP)
    assert w.plain_step_mean == pytest.approx(2 * STEP)  # (1 + 3 + 2) / 3
    assert w.step_s == pytest.approx(4 * STEP)  # the median of all six plain steps


def test_fixed_windows_and_targets_without_plain_steps() -> None:
    assert VerifyWindow(16, 1).next() == 1
    w = VerifyWindow(16, "auto", allow_plain=False)
    ks = _run(w, 200, lambda k: 0, draft_cost=2.5)
    assert min(ks) >= 2
    with pytest.raises(ValueError, match="sliding-window"):
        VerifyWindow(16, 1, allow_plain=False)


class CountingDrafter:
    """Wraps a drafter and counts add_context calls and rows."""

    def __init__(self, inner):
        self.inner = inner
        self.block_size, self.layer_ids = inner.block_size, inner.layer_ids
        self.calls = 0
        self.rows = 0
        self.proposals = 0

    def reset(self, *a, **k):
        self.inner.reset(*a, **k)

    def jump(self, p):
        self.inner.jump(p)

    def add_context(self, features):
        self.calls += 1
        self.rows += features.shape[1]
        self.inner.add_context(features)

    def propose(self, anchor, anchor_pos, count=None):
        self.proposals += 1
        return self.inner.propose(anchor, anchor_pos, count)


def test_the_loop_feeds_the_draft_once_per_draft_cycle(pairs) -> None:
    """Plain steps buffer their feature rows; a draft cycle adds them in one call; a fixed
    window of 1 never drafts and feeds nothing. The output is the target's either way."""
    from dflash.engine.drafters import DFlashDrafter

    pair = pairs("qwen3")
    ids = pair.tokenizer.encode("Once upon a time")
    n = 48
    ref = greedy_reference(pair.target.model, ids, n)
    eos = set(pair.tokenizer.eos_token_ids)
    if any(t in eos for t in ref):
        ref = ref[: next(i for i, t in enumerate(ref) if t in eos)]
    for window in ("auto", 1, "full"):
        d = CountingDrafter(DFlashDrafter(pair.drafter.draft, pair.target))
        final, _ = run_dflash(pair.target, d, pair.tokenizer, ids, n, verify_window=window)
        assert final.token_ids == ref, window
        prefill_calls = 1  # a short prompt: one chunk
        if window == 1:
            assert d.calls == prefill_calls and d.proposals == 0
        else:
            # prefill, then at most one call per draft cycle (the rows of the plain steps and
            # cycles since the previous one)
            assert d.calls - prefill_calls <= d.proposals
            assert d.rows <= len(ids) + len(final.token_ids)


def test_stats_estimate_the_speedup_from_timed_plain_steps(pairs) -> None:
    """`est_speedup` = decode tok/s x the pipelined plain-step time measured in the same run: set
    when the run took plain steps back to back, 0 when a fixed window never took one. Window 1
    (plain decoding through the same loop) takes them for certain; whether "auto" does depends on
    this machine's timings (under load a CI run once timed too few), so it is not the case here."""
    pair = pairs("qwen3")
    ids = pair.tokenizer.encode("Once upon a time")
    saved, pair.tokenizer.eos_token_ids = pair.tokenizer.eos_token_ids, set()  # run all 48 tokens
    try:
        plain, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 48, verify_window=1)
        full, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 48, verify_window="full")
    finally:
        pair.tokenizer.eos_token_ids = saved
    assert plain.stats.plain_steps == plain.stats.cycles == 47  # the first token is the prefill's
    # every token of that run is one of the timed steps, so the estimate is ~1x of itself
    assert 0.2 < plain.stats.est_speedup < 5
    assert full.stats.plain_steps == 0 and full.stats.est_speedup == 0.0


def test_plain_step_mean_counts_only_steps_queued_behind_a_plain_step() -> None:
    """A plain step right after a draft cycle was not pipelined and costs more: left out, and no
    mean at all below MIN_PLAIN_SAMPLES samples (one or two measure the overlap, not the step)."""
    from dflash.engine.window import MIN_PLAIN_SAMPLES

    w = VerifyWindow(16, "auto")
    w.observe(4, 1, 9.0)  # a draft cycle
    w.observe(1, 0, 5.0)  # after it: not pipelined, not counted
    for _ in range(MIN_PLAIN_SAMPLES - 1):
        w.observe(1, 0, 1.0)
    assert w.plain_step_mean is None
    w.observe(1, 0, 3.0)
    assert w.plain_step_mean == pytest.approx((MIN_PLAIN_SAMPLES - 1 + 3.0) / MIN_PLAIN_SAMPLES)


def test_verify_costs_linear_or_interpolated_from_measured_widths() -> None:
    from dflash.engine.window import CPU_VERIFY_COST, verify_costs

    assert verify_costs(0.5, 4)[1:] == [1.0, 1.5, 2.0, 2.5]
    v = verify_costs({1: 1.0, 2: 1.0, 4: 2.0, 8: 3.0}, 10)
    assert v[1:5] == [1.0, 1.0, 1.5, 2.0] and v[6] == pytest.approx(2.5)
    assert v[9] == pytest.approx(3.25) and v[10] == pytest.approx(3.5)  # past the table: last slope
    cpu = verify_costs(CPU_VERIFY_COST, 16)
    assert all(a <= b for a, b in zip(cpu[1:], cpu[2:]))  # a wider verify never costs less
    assert cpu[2] == 1.0 and cpu[16] == CPU_VERIFY_COST[16]


def test_a_two_token_copy_that_costs_a_plain_step_is_taken_unless_its_overhead_says_otherwise() -> None:
    """CPU prior (2 tokens = 1 step): a copy at the prior is worth verifying; once its cycles are
    measured slower than a plain step (the host read before each), a weak copy is not."""
    w = VerifyWindow(16, "auto")
    w.v = [1.0] * 3 + [w.v[k] for k in range(3, 17)]
    w.observe(1, 0, STEP)
    w.successes, w.failures, w._best = 0.0, 10.0, (2, 0.5)
    w._probe_gap = 10**6
    assert w.plan(15)[1]
    for _ in range(30):
        k, copying = w.plan(15)
        if copying:
            w.observe(k, 0, (w.v[k] + 0.2) * STEP, copied=True)
    assert w.plan(15) == (1, False)


def test_a_remembered_window_starts_where_the_last_generation_ended(monkeypatch) -> None:
    """With DFLASH_WINDOW_RECALL_ACCEPTANCE=1 (opt-in since session 37) the remembered acceptance
    seeds the next run; by default only the costs do (see the next test)."""
    from dflash.engine.window import RECALL_ENV, WindowMemory

    monkeypatch.setenv(RECALL_ENV, "1")
    mem = WindowMemory()
    first = VerifyWindow(16, "auto", memory=mem)
    assert first.next() > 1  # no memory: the built-in prior (p = 0.8) drafts at once
    ks = _run(first, 40, lambda k: 0, draft_cost=2.5)
    first.remember(mem)
    assert mem.p is not None and mem.p < 0.5 and mem.d is not None and mem.d > 0.5
    again = VerifyWindow(16, "auto", memory=mem)
    assert again.next() == 1 and again.d == mem.d  # drafting did not pay: plain steps first
    ks2 = _run(again, 40, lambda k: 0, draft_cost=2.5)
    assert sum(k > 1 for k in ks2) < sum(k > 1 for k in ks)
    good = WindowMemory(p=0.95, d=0.3)
    assert VerifyWindow(16, "auto", memory=good).next() == 16  # a good draft: whole blocks at once
    fixed = VerifyWindow(16, 4, memory=mem)
    assert fixed.next() == 4
    fixed.remember(before := WindowMemory())
    assert before == WindowMemory()  # a pinned window measures nothing to hand on


def test_a_remembered_window_starts_from_the_costs_only_by_default(monkeypatch) -> None:
    """A WindowMemory's costs are the machine's and seed every run; its acceptances are the
    last text's and do not (engine/window.py, recall_acceptance): a run after one whose drafts
    all failed still opens at the built-in prior, with the measured draft cost."""
    from dflash.engine.window import RECALL_ENV, WindowMemory

    monkeypatch.delenv(RECALL_ENV, raising=False)
    mem = WindowMemory()
    first = VerifyWindow(16, "auto", memory=mem)
    _run(first, 40, lambda k: 0, draft_cost=2.5)
    first.remember(mem)
    assert mem.p is not None and mem.p < 0.5 and mem.d is not None and mem.d > 0.5  # still kept
    again = VerifyWindow(16, "auto", memory=mem)
    assert again.d == mem.d and again.p == pytest.approx(0.8)  # the cost, not the acceptance
    assert again.next() > 1  # drafts at once, as a fresh window does


def test_generations_sharing_a_memory_explore_less_and_stay_lossless(pairs, monkeypatch) -> None:
    from dflash.engine.window import RECALL_ENV, WindowMemory

    monkeypatch.setenv(RECALL_ENV, "1")  # the opt-in: a remembered acceptance seeds the next run
    pair = pairs("qwen3")  # its random 1-layer draft: acceptance ~0
    ids = pair.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    ref = greedy_reference(pair.target.model, ids, 48)
    saved, pair.tokenizer.eos_token_ids = pair.tokenizer.eos_token_ids, set()
    try:
        mem = WindowMemory()
        runs = [run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 48, window_memory=mem,
                           copy_draft=False)[0] for _ in range(2)]
    finally:
        pair.tokenizer.eos_token_ids = saved
    assert all(r.token_ids == ref for r in runs)
    drafts = [r.stats.cycles - r.stats.plain_steps for r in runs]
    assert mem.p is not None and drafts[1] < drafts[0], drafts


def test_cut_block_windows_measure_their_own_overhead(monkeypatch) -> None:
    """Windows up to short_max draft from a cut block: their overhead (d_short) is measured apart
    from whole blocks' (d), so a cheap 2-row pass is not averaged with a 16-row one; both carry
    over through WindowMemory."""
    # priors set through a WindowMemory's acceptance: the opt-in recall
    monkeypatch.setenv("DFLASH_WINDOW_RECALL_ACCEPTANCE", "1")
    from dflash.engine.window import WindowMemory

    w = VerifyWindow(16, "auto", short_max=2)
    assert w.d_short < w.d and w.overhead(2) == w.d_short and w.overhead(3) == w.d
    w.observe(8, 3, 10 * STEP)  # the first draft cycle: not used
    w.observe(1, 0, STEP)
    w.observe(2, 1, (w.v[2] + 0.9) * STEP)  # right after a plain step: not used
    w.observe(2, 1, (w.v[2] + 0.1) * STEP)
    w.observe(8, 7, (w.v[8] + 0.6) * STEP)
    assert w.d_short == pytest.approx(0.1) and w.d == pytest.approx(0.6)
    w.remember(mem := WindowMemory())
    assert mem.d_short == pytest.approx(0.1) and mem.d == pytest.approx(0.6)
    again = VerifyWindow(16, "auto", memory=mem, short_max=2)
    assert again.d_short == pytest.approx(0.1)
    older = VerifyWindow(16, "auto", memory=WindowMemory(d=0.6), short_max=2)  # no d_short kept yet
    assert older.d_short == pytest.approx(0.3)  # the prior follows the remembered d
    # a cheaper short pass makes window 2 pay at an acceptance where it otherwise would not
    mem = WindowMemory(p=0.45, d=0.5)
    assert VerifyWindow(16, "auto", memory=mem).best()[1] < 1.0
    assert VerifyWindow(16, "auto", memory=WindowMemory(p=0.45, d=0.5, d_short=0.15), short_max=2).best() \
        == (2, pytest.approx(1.45 / 1.15))


def _cpu_like(w: VerifyWindow, tokens: int, p: float, seed: int = 0) -> dict:
    """Drive a narrow window on a clock like session 35's CPU traces: a plain step 1.0, a 2-token
    cycle of a cut block 1.2, any wider one 1.0 + 0.1 a token + 0.3, and a draft cycle right after
    plain steps 0.8 more (it drains the queued step and feeds the stretch to the draft's context);
    each draft accepted with probability p. Returns the counts and the final estimates."""
    import random

    rng = random.Random(seed)
    out, after_plain, plain, cycles = 0, False, 0, 0
    while out < tokens:
        k = w.next()
        cycles += 1
        if k == 1:
            w.observe(1, 0, STEP)
            out, plain, after_plain = out + 1, plain + 1, True
            continue
        accepted = 0
        while accepted < k - 1 and rng.random() < p:
            accepted += 1
        cost = (1.2 if k <= w.short_max else 1.3 + 0.1 * k) + (0.8 if after_plain else 0.0)
        w.observe(k, accepted, cost * STEP)
        out, after_plain = out + accepted + 1, False
    return {"plain": plain, "cycles": cycles, "d_short": w.d_short, "p": w.p}


def test_one_stalled_cycle_does_not_send_a_paying_draft_plain() -> None:
    """Session 39: on a shared 2-core VM a cycle now and then takes 3-5x its kind's time (a
    stall, not the draft). Overheads are medians of recent measurements, so one 4-step 2-token
    cycle among 1.2-step ones neither moves d_short (a running mean took it from 0.2 to 0.76,
    and the window to plain steps) nor reaches the next job through WindowMemory."""
    from dflash.engine.window import WindowMemory

    w = VerifyWindow(16, "auto", short_max=2)
    w.observe(8, 3, 10 * STEP)  # the first draft cycle: not used
    w.observe(1, 0, STEP)
    for i in range(24):
        k = w.next()
        assert k == 2 or i < 8  # after the first misses, 2 tokens: ~1.5 tokens a 1.2-step cycle
        cost = 1.2 if k <= 2 else 1.3 + 0.1 * k
        w.observe(k, min(i % 2, k - 1), (4.0 if i == 16 else cost) * STEP)
        if i >= 12:
            assert w.d_short == pytest.approx(0.2)  # the stalled cycle included
    w.remember(mem := WindowMemory())
    assert mem.d_short == pytest.approx(0.2)
    for _ in range(4):  # a machine that really got slower is followed within a few cycles
        w.observe(2, 1, 2.2 * STEP)
    assert w.d_short == pytest.approx(1.2)


def test_a_probe_after_plain_steps_is_timed_on_its_second_cycle(monkeypatch) -> None:
    """Plain steps run one ahead and leave the draft's context behind, so the first draft cycle
    after them pays for the stretch as well: it is not timed, and a probe (rate < 1) drafts one
    more cycle, the one that measures d_short, which then caps the probe gap (_gap_cap)."""
    # priors set through a WindowMemory's acceptance: the opt-in recall
    monkeypatch.setenv("DFLASH_WINDOW_RECALL_ACCEPTANCE", "1")
    from dflash.engine.window import WindowMemory

    w = VerifyWindow(16, "auto", short_max=2, memory=WindowMemory(p=0.2, d=0.5, d_short=0.6))
    w.observe(8, 0, 10 * STEP)  # the run's first cycle
    while (k := w.next()) == 1:
        w.observe(1, 0, STEP)
    assert k == 2 and w.best()[1] < 1.0  # a probe
    w.observe(2, 0, 3.0 * STEP)  # drains the queued step, feeds the stretch: not timed
    assert w.d_short == 0.6 and w.next() == 2  # drafts once more, though drafting does not pay
    w.observe(2, 0, 1.2 * STEP)
    assert w.d_short == pytest.approx(0.2)  # the run's first steady measurement replaces a remembered one
    assert w.next() == 1 and w._probe_gap == w._gap_cap() == 10  # capped at the cost it measured


def test_cheap_probes_keep_the_plain_stretches_short() -> None:
    """Narrow windows cap the probe gap where a probe that accepts nothing costs ~4% of the
    stretch: at d_short 0.2 a probe pair costs 0.4 steps (gap 10), at 1.0 two steps (gap 50)."""
    from dflash.engine.window import WindowMemory

    assert VerifyWindow(16, "auto", short_max=2, memory=WindowMemory(d_short=0.2))._gap_cap() == 10
    assert VerifyWindow(16, "auto", short_max=2, memory=WindowMemory(d_short=1.0))._gap_cap() == 50
    assert VerifyWindow(16, "auto", short_max=2, memory=WindowMemory(d_short=0.0))._gap_cap() == 8


def test_a_pessimistic_memory_does_not_lock_a_paying_draft_into_plain_steps() -> None:
    """Session 35: a daemon's stored d_short of 0.8 (measured on probes right after plain steps)
    kept the demo prompt 120 of 135 cycles plain where its cut 2-token cycles pay (acceptance
    ~0.45, 1.2 steps a cycle: 1.45 tokens a 1.2-step cycle). Timed on steady cycles and probed
    often while probes are cheap, the window finds it again and hands on a sound d_short."""
    from dflash.engine.window import WindowMemory

    plain = cycles = 0
    for seed in range(8):  # runs of misses still send a run plain for a while: count them all
        mem = WindowMemory(p=0.6, d=0.37, d_short=0.8)
        w = VerifyWindow(16, "auto", short_max=2, memory=mem)
        run = _cpu_like(w, 160, p=0.45, seed=seed)
        plain, cycles = plain + run["plain"], cycles + run["cycles"]
        w.remember(mem)
        assert mem.d_short == pytest.approx(0.2)  # what its 2-token cycles cost, handed on
    assert plain < 0.35 * cycles  # 0.28 (0.19 from a sound memory); stored 0.8 once meant ~0.9


def test_wide_windows_verify_the_whole_block_whenever_it_pays(monkeypatch) -> None:
    """DFLASH_WINDOW_WIDE=1 (a GPU's default): the whole block once it pays, plain steps when
    nothing does; =0: the geometric model's own window, shorter at the same acceptance."""
    import random

    def accept(rng):  # each draft accepted with probability 0.7, the run ends at the first miss
        def f(k):
            n = 0
            while n < k - 1 and rng.random() < 0.7:
                n += 1
            return n
        return f

    monkeypatch.setenv("DFLASH_VERIFY_COST", "0.035,0.3")  # the GPU's prior on this CPU
    chosen = {}
    for wide in ("1", "0"):
        monkeypatch.setenv("DFLASH_WINDOW_WIDE", wide)
        w = VerifyWindow(16, "auto")
        assert w.wide is (wide == "1")
        ks = _run(w, 200, accept(random.Random(0)), draft_cost=1.6)
        chosen[wide] = [k for k in ks[20:] if k > 1]
    assert chosen["1"] and set(chosen["1"]) == {16}
    assert chosen["0"] and max(chosen["0"]) < 16
    w = VerifyWindow(16, "auto")  # wide, at acceptance zero: drafting still stops
    ks = _run(w, 256, lambda k: 0, draft_cost=2.5)
    assert ks[-64:].count(1) >= 60
    monkeypatch.setenv("DFLASH_WINDOW_WIDE", "yes")
    with pytest.raises(ValueError, match="DFLASH_WINDOW_WIDE must be 0 or 1"):
        VerifyWindow(16, "auto")


def test_wide_windows_follow_the_measured_whole_block_rate_and_recover(monkeypatch) -> None:
    """Wide: the whole block while what its cycles emit pays for them, plain steps (probing with
    the whole block) once it stops, the whole block again when the text turns predictable; the
    measured tokens per whole-block cycle carry to the next generation (with the opt-in
    DFLASH_WINDOW_RECALL_ACCEPTANCE=1)."""
    # priors set through a WindowMemory's acceptance: the opt-in recall
    monkeypatch.setenv("DFLASH_WINDOW_RECALL_ACCEPTANCE", "1")
    from dflash.engine.window import WindowMemory

    monkeypatch.setenv("DFLASH_VERIFY_COST", "0.035,0.3")
    monkeypatch.setenv("DFLASH_WINDOW_WIDE", "1")
    w = VerifyWindow(16, "auto")
    ks = _run(w, 40, lambda k: k - 1, draft_cost=2.0)  # every draft accepted: 16 tokens a cycle
    assert [k for k in ks[5:] if k > 1] and set(k for k in ks[5:] if k > 1) == {16}
    assert w.full_tokens > 12
    ks = _run(w, 200, lambda k: 0, draft_cost=2.0)  # nothing accepted: plain steps, whole-block probes
    assert ks[-100:].count(1) >= 90 and set(ks[-100:]) <= {1, 16}  # a probe at most 16 steps apart
    assert w.full_tokens < 2 and w.best()[1] < 1.0  # a whole block no longer pays
    ks = _run(w, 300, lambda k: k - 1, draft_cost=2.0)  # predictable again: back to whole blocks
    assert ks[-50:].count(16) >= 45
    m = WindowMemory()
    w.remember(m)
    assert m.full_tokens == w.full_tokens > 12
    assert VerifyWindow(16, "auto", memory=m).full_tokens == pytest.approx(m.full_tokens)


def test_the_drafts_confidence_chooses_a_drafted_blocks_window(monkeypatch) -> None:
    """DFLASH_WINDOW_CONFIDENCE=1 (opt-in), without wide windows: a window wider than short_max
    drafts the whole block and its window is then chosen from the draft's confidence, as far as
    its drafts are likely right; its time counts as a whole block's (d), not a cut one's."""
    monkeypatch.setenv("DFLASH_WINDOW_WIDE", "0")
    monkeypatch.delenv("DFLASH_WINDOW_CONFIDENCE", raising=False)
    monkeypatch.delenv("DFLASH_VERIFY_COST", raising=False)
    assert not VerifyWindow(16, "auto", short_max=2).confident  # off by default
    monkeypatch.setenv("DFLASH_WINDOW_CONFIDENCE", "1")
    w = VerifyWindow(16, "auto", short_max=2)
    assert w.confident and not w.reads_draft(2) and w.reads_draft(3) and w.reads_draft(16)
    assert w.after_draft([0.999] * 15) == 16  # every draft near-certain: the whole block
    assert w.after_draft([0.01] * 15) == 2  # nothing likely: the narrowest window
    sure_then_lost = [0.99] * 6 + [0.05] * 9
    assert 6 <= w.after_draft(sure_then_lost) <= 8  # stops where the drafts stop being likely
    assert w.after_draft([0.9] * 15) > w.after_draft([0.6] * 15)
    w.observe(8, 3, 10 * STEP)  # the first draft cycle: not used
    w.observe(1, 0, STEP)
    w.observe(8, 3, 10 * STEP)  # right after a plain step: not used
    d_short = w.d_short
    w.observe(2, 1, (w.v[2] + 0.5) * STEP, whole_block=True)  # a whole block verified at 2
    assert w.d_short == d_short and w.d == pytest.approx(0.5)
    # fixed windows, wide windows and DFLASH_WINDOW_CONFIDENCE=0 keep the drafted window
    assert not VerifyWindow(16, 8).confident
    monkeypatch.setenv("DFLASH_WINDOW_CONFIDENCE", "0")
    assert not VerifyWindow(16, "auto").reads_draft(8)
    monkeypatch.setenv("DFLASH_WINDOW_CONFIDENCE", "1")
    monkeypatch.setenv("DFLASH_WINDOW_WIDE", "1")
    assert not VerifyWindow(16, "auto").confident
    monkeypatch.setenv("DFLASH_WINDOW_CONFIDENCE", "2")
    with pytest.raises(ValueError, match="DFLASH_WINDOW_CONFIDENCE must be 0 or 1"):
        VerifyWindow(16, "auto")


def test_the_window_trace_has_one_line_per_cycle_of_a_real_run(pairs, tmp_path, monkeypatch) -> None:
    """DFLASH_WINDOW_TRACE: the auto policy writes what it saw and chose, one JSON line per cycle
    (plain, copy and draft cycles alike), for runs whose speed needs explaining; a fixed window
    writes nothing (no policy runs)."""
    import json

    trace = tmp_path / "window.jsonl"
    monkeypatch.setenv("DFLASH_WINDOW_TRACE", str(trace))
    pair = pairs("qwen3")
    ids = pair.tokenizer.encode("Once upon a time")
    saved, pair.tokenizer.eos_token_ids = pair.tokenizer.eos_token_ids, set()  # run all 40 tokens
    try:
        auto, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 40)
        lines = [json.loads(line) for line in trace.read_text().splitlines()]
        run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 40, verify_window="full")
    finally:
        pair.tokenizer.eos_token_ids = saved
    assert len(lines) == auto.stats.cycles > 0
    assert [e["cycle"] for e in lines] == list(range(1, len(lines) + 1))
    assert sum(e["window"] == 1 and not e["copied"] for e in lines) == auto.stats.plain_steps
    assert sum(e["accepted"] for e in lines) == sum(i * n for i, n in enumerate(auto.stats.accept_histogram))
    assert {"seconds", "step_s", "d", "d_short", "o", "p", "best", "probe_gap"} <= set(lines[0])
    assert len(trace.read_text().splitlines()) == len(lines)  # the fixed window added nothing
