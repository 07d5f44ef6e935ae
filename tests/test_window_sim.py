"""scripts/window_sim.py: acceptance traces at every position, replayed through VerifyWindow."""

from __future__ import annotations


import pytest

from dflash.engine.drafters import OracleDrafter
from dflash.engine.generate import Finished, stream_dflash_generate

from helpers import load_script


def _module():
    return load_script("window_sim")


def _engine_full(pair, drafter, ids, max_tokens):
    """The engine's own whole-block cycles on the same prompt: (ids, cycles, accepted drafts)."""
    final = None
    for ev in stream_dflash_generate(pair.target, drafter, pair.tokenizer, ids, max_tokens,
                                     verify_window="full", copy_draft=False):
        if isinstance(ev, Finished):
            final = ev
    return list(final.token_ids), final.stats.cycles, final.stats.accepted_drafts


@pytest.mark.parametrize("drafter_kind", ["oracle", "model"])
def test_a_trace_replays_the_engines_whole_block_cycles(pairs, drafter_kind):
    """Walking a(t) with the whole block every cycle gives the engine's own cycles and accepted
    drafts on the same prompt: a(t) is indexed as the engine anchors its cycles."""
    mod = _module()
    pair = pairs("llama")
    ids = pair.tokenizer.encode("The quick brown fox jumps over")
    from dflash.engine.bench.timing import run_baseline

    ref, _ = run_baseline(pair, ids, 40)
    drafter = (OracleDrafter(ref, len(ids), 16, corrupt_at=(5,), vocab_size=pair.target.vocab_size)
               if drafter_kind == "oracle" else pair.drafter)
    [tr] = mod.trace_answers(pair, drafter, [ids], 40)
    assert tr["answer"] == ref and len(tr["accepted"]) == len(ref) - 1
    if drafter_kind == "oracle":  # wrong at its 5th draft: 4 accepted wherever 4 more tokens follow
        assert tr["accepted"][: len(ref) - 6] == [4] * (len(ref) - 6)
    got, cycles, accepted = _engine_full(pair, drafter, ids, 40)
    assert got == ref
    sim = mod.simulate(tr["accepted"], "full")
    walked, pos = 0, 0
    while pos < len(tr["accepted"]):
        take = min(tr["accepted"][pos], len(tr["accepted"]) - pos - 1)
        walked, pos = walked + take, pos + take + 1
    assert sim["cycles"] == cycles
    # the engine counts its last cycle's drafts past max_tokens too; the trace stops at the answer
    assert 0 <= accepted - walked <= 15


def test_policies_on_a_trace_and_the_oracle_ceiling():
    mod = _module()
    good = [12] * 60  # a predictable stretch: whole blocks pay
    bad = [0] * 60  # nothing accepted: plain steps pay
    for acc in (good, bad, good[:30] + bad[:30]):
        best = mod.oracle(acc)
        assert best["tokens"] == len(acc)
        for pol in ("auto", "full", 4):
            r = mod.simulate(acc, pol)
            assert r["tokens"] == len(acc)
            assert r["tokens"] / r["time"] <= best["tokens"] / best["time"] + 1e-9
    assert mod.simulate(bad, "auto")["plain"] > 40  # the policy finds plain decoding
    assert mod.simulate(good, "auto")["plain"] <= 2  # and keeps whole blocks (a timing step)
    assert mod.oracle(bad)["time"] == pytest.approx(len(bad))  # a plain step each


def test_a_shorter_probe_gap_probes_more_where_nothing_is_accepted():
    mod = _module()
    bad = [0] * 400
    slow, eager = mod.simulate(bad, "auto", slope=0, d=1.0), mod.simulate(bad, "auto", slope=0, d=1.0,
                                                                          max_probe_gap=8)
    assert eager["plain"] < slow["plain"] < 400  # more probes (draft cycles), fewer plain steps
    assert eager["tokens"] / eager["time"] < slow["tokens"] / slow["time"] < 1.0


def test_a_longer_memory_of_whole_blocks_rides_out_a_short_run_of_misses():
    """Wide windows: a few cycles that accept nothing inside a predictable answer send a
    ~10-cycle mean of tokens per whole block below the bar; a ~33-cycle mean stays above it."""
    mod = _module()
    acc = [2] * 120 + [0] * 8 + [2] * 300  # 3 tokens a 2-step cycle: whole blocks pay 1.5x
    short, long = (mod.simulate(acc, "auto", slope=0, d=1.0, full_decay=f) for f in (0.9, 0.97))
    assert long["plain"] < short["plain"]
    assert long["tokens"] / long["time"] > short["tokens"] / short["time"]
