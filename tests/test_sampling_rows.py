"""Sampled cycles of several draft rows are exact (engine/sampling.py `accept_rows`).

Row 0 is a block drawn from the draft's block-parallel q, each other row one more draw at one
position (without replacement among that position's draws); the target verifies all rows in one pass and the walk over that tree
(multi-candidate speculative sampling) must emit tokens distributed exactly as the target's own
sampler. Tested like the one-row rule (tests/test_sampling_dist.py, whose chi-square and
total-variation tests these reuse):

* the rule, vectorised over 200k chains of a Markov "model" over 8 tokens, 4 tokens deep, 3
  drafts and 4 rows a cycle, alternates at fixed positions, for three sampler settings and
  three drafts; and the same test rejecting the rule with the residual step left out;
* the engine end to end on a tiny qwen3 with DFLASH_SAMPLED_ROWS=1 and 4 rows: the joint law
  of the first three tokens (window 4: a 3-draft cycle) for the untrained DFlash draft (flat
  q: rejections at the first position, alternates there) and a block-parallel draft built
  from the target (most first drafts kept, alternates further in).
"""

from __future__ import annotations

import zlib
from dataclasses import replace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from dflash.engine import branches, sampling
from dflash.engine.sampling import DraftSampling, KeyChain, SamplingParams
from test_sampling_dist import (
    CHAINS,
    DEPTH,
    PARAMS,
    V,
    _setup,
    advance,
    assert_rejected,
    assert_same_distribution,
    counts_of,
    engine_counts,
    engine_exact,
    markov_exact,
)

DRAFTS, ROWS = 3, 4


def block_tables(params: SamplingParams, draft: str) -> tuple[mx.array, mx.array]:
    """Target table T[prev] = p(next | prev) and the draft's Q[j, anchor] = q_j (block-parallel:
    position j's q depends on the anchor only)."""
    logits = mx.random.normal((V, V), key=mx.random.key(7)) * 1.5
    t = sampling.probs(logits, params)
    if draft == "close":  # position 0 near the target's, later ones the target's along its argmax path
        first = sampling.probs(logits + 0.6 * mx.random.normal((V, V), key=mx.random.key(8)), params)
        path, qs = mx.arange(V), [first]
        for _ in range(DRAFTS - 1):
            path = mx.argmax(t[path], axis=-1)
            qs.append(t[path])
        return t, mx.stack(qs)
    other = mx.random.normal((DRAFTS, V, V), key=mx.random.key(9)) * (1.5 if draft == "random" else 0.2)
    return t, sampling.probs(other, params)


def simulate_rows(t: mx.array, qt: mx.array, alternates: list[int], seed: int) -> np.ndarray:
    """CHAINS generations of DEPTH tokens after token 0, DRAFTS drafts in ROWS rows a cycle."""
    keys = KeyChain(seed)
    anchor = mx.zeros((CHAINS,), mx.int32)
    out = np.full((CHAINS, DEPTH), -1, np.int64)
    length = np.zeros(CHAINS, np.int64)
    alt = mx.broadcast_to(mx.array(alternates, mx.int32), (CHAINS, ROWS - 1))
    while (length < DEPTH).any():
        q = mx.transpose(qt[:, anchor], (1, 0, 2))  # [C, DRAFTS, V]
        drafts = branches.draw_rows(q, alt, keys.next())  # [C, R, DRAFTS]
        prev = mx.concatenate([mx.broadcast_to(anchor[:, None, None], (CHAINS, ROWS, 1)), drafts], axis=2)
        p = t[prev]  # [C, R, DRAFTS + 1, V]
        acc, toks, _ = sampling.accept_rows(p, drafts, q, alt, keys.next())
        anchor = advance(out, length, acc, toks)
    return out


@pytest.mark.parametrize("alternates", [[0, 0, 1], [1, 2, 2]])
@pytest.mark.parametrize("draft", ["random", "close", "flat"])
@pytest.mark.parametrize("pname", list(PARAMS))
def test_rows_rule_is_exact(pname, draft, alternates):
    t, q = block_tables(PARAMS[pname], draft)
    seed = zlib.crc32(f"{pname}/{draft}/{alternates}".encode())
    samples = simulate_rows(t, q, alternates, seed)
    assert (samples >= 0).all()
    assert_same_distribution(counts_of(samples), markov_exact(t), CHAINS)


def test_rows_rule_without_the_residual_step_is_rejected(monkeypatch):
    """Power: trying the alternates against p itself (nothing subtracted after a rejection) and
    drawing from it is caught."""
    t, q = block_tables(PARAMS["t1.0"], "close")
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    r = assert_rejected(counts_of(simulate_rows(t, q, [0, 0, 1], seed=3)), markov_exact(t), CHAINS)
    print("rows without the residual (rule, n=200k):", r)


def test_rows_rule_keeps_row_0_when_it_is_accepted_whole():
    """q = p at every position: every draft of row 0 is kept, the bonus comes from row 0."""
    t, _ = block_tables(PARAMS["t1.0"], "random")
    v = t.shape[-1]
    q = mx.broadcast_to(t[0], (DRAFTS, v))
    drafts = branches.sampled_rows(q, ROWS, mx.random.key(1))
    p = mx.broadcast_to(t[0], (ROWS, DRAFTS + 1, v))
    acc, toks, row = sampling.accept_rows(p, drafts, q, branches.alternate_positions(q, ROWS), mx.random.key(2))
    assert acc.item() == DRAFTS and row.item() == 0
    assert toks[:DRAFTS].tolist() == drafts[0].tolist()


def test_alternates_go_where_the_draft_expects_misses():
    """alternate_positions: from q alone, sorted; a sure position gets none, an unsure early one
    several; the sampled rows differ from row 0 at most at their own position."""
    v = 6
    sure = mx.array([1.0, 0, 0, 0, 0, 0])
    unsure = mx.full((v,), 1.0 / v)
    q = mx.stack([sure, unsure, unsure, sure])
    at = branches.alternate_positions(q, 5).tolist()
    assert at == sorted(at) and 0 not in at and 3 not in at and at.count(1) >= 2
    rows = np.array(branches.sampled_rows(q, 5, mx.random.key(0)))
    for r, j in enumerate(at, start=1):  # each row differs from row 0 at its own position only
        assert np.nonzero(rows[r] != rows[0])[0].tolist() == [j]
    for j in set(at):  # without replacement: the draws at a position are all different
        drawn = [rows[0, j]] + [rows[r, j] for r, a in enumerate(at, start=1) if a == j]
        assert len(set(drawn)) == len(drawn)
    assert (rows[:, 0] == 0).all() and (rows[:, 3] == 0).all()  # a sure position is never redrawn


# --- the engine ----------------------------------------------------------------------------------
class ParallelDrafter:
    """A block-parallel draft built from the (sharpened) target: q_0 the target's next-token p
    after the anchor at a wider temperature, q_j for j > 0 the target's p after its own argmax
    path from the anchor (not after the draws: one q per position, as a DFlash draft gives).
    Rows come from branches.sampled_rows, the engine's own drawing."""

    def __init__(self, sharp: Any, prompt: list[int], widen: float = 1.5, block_size: int = 16):
        self.sharp, self.prompt, self.widen = sharp, prompt, widen
        self.block_size, self.layer_ids = block_size, [0]
        self.short_max = 0

    def reset(self, positioned: bool = False) -> None:
        self.seq = list(self.prompt)

    def jump(self, position: int) -> None: ...

    def add_context(self, features: mx.array) -> None: ...

    def trim(self, rows: int) -> None: ...

    def propose(self, anchor: mx.array, anchor_pos: int, count: int | None = None,
                sampling: DraftSampling | None = None, rows: int = 1):
        count = self.block_size - 1 if count is None else count
        params = replace(sampling.params, temperature=sampling.params.temperature * self.widen)
        seq, qs = list(self.prompt) + [anchor.item()], []
        for _ in range(count):
            q = _probs(self.sharp.last_logits([seq])[0], params)
            qs.append(q)
            seq.append(int(mx.argmax(q).item()))
        q = mx.stack(qs)
        return branches.sampled_rows(q, rows, sampling.key) if rows > 1 else q.argmax(-1), q


def _probs(logits: mx.array, params: SamplingParams) -> mx.array:
    return sampling.probs(logits, params)


@pytest.mark.parametrize("draft", ["dflash", "parallel"])
def test_engine_rows_are_exact(pairs, monkeypatch, draft):
    """DFLASH_SAMPLED_ROWS=1, 4 rows, window 4, temperature 1 (the DFlash draft) or 0.7 with top-p
    0.9 (the parallel draft): the first three tokens' joint law is the target's."""
    from dflash.engine import verify as verify_mod

    monkeypatch.setenv(branches.SAMPLED_ENV, "1")
    verified_rows = []
    real = verify_mod.verify_rows

    def counted(*args, **kwargs):
        verified_rows.append(args[3].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(verify_mod, "verify_rows", counted)
    params = SamplingParams(temperature=1.0) if draft == "dflash" else SamplingParams(temperature=0.7, top_p=0.9)
    pair, sharp, ids = _setup(pairs, "qwen3", params)
    make = (lambda: pair.drafter) if draft == "dflash" else (lambda: ParallelDrafter(sharp, ids))
    saved, pair.target.branches = pair.target.branches, ROWS
    try:
        n = 600
        counts = engine_counts(pair, sharp, make, ids, params, n, window=4)
    finally:
        pair.target.branches = saved
    assert len(verified_rows) >= n and set(verified_rows) == {ROWS}  # every run verified rows
    print(draft, assert_same_distribution(counts, engine_exact(sharp, ids, params, n), n))


def test_engine_samples_rows_only_when_asked(pairs, monkeypatch):
    """Unset DFLASH_SAMPLED_ROWS: a sampled generation verifies one row even where greedy ones
    take four; set: the rows run (branch cycles counted) and the same seed repeats its ids."""
    from helpers import run_dflash

    pair = pairs("qwen3")
    ids = pair.tokenizer.encode("Once upon a time")
    kw = dict(verify_window="full", branches=ROWS, temperature=0.8, seed=5)
    monkeypatch.delenv(branches.SAMPLED_ENV, raising=False)
    off, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 24, **kw)
    assert off.stats.branch_rows == 1 and off.stats.branch_cycles == 0
    monkeypatch.setenv(branches.SAMPLED_ENV, "1")
    on, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 24, **kw)
    again, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 24, **kw)
    assert on.stats.branch_rows == ROWS and on.stats.branch_cycles >= 1
    assert on.token_ids == again.token_ids


def test_engine_rows_without_the_residual_step_are_rejected(pairs, monkeypatch):
    """Power at engine scale: the same test rejects rows tried against p itself after a
    rejection (the parallel draft at 2.5x the temperature, 600 runs)."""
    monkeypatch.setenv(branches.SAMPLED_ENV, "1")
    params = SamplingParams(temperature=1.0)
    pair, sharp, ids = _setup(pairs, "qwen3", params)
    saved, pair.target.branches = pair.target.branches, ROWS
    try:
        with monkeypatch.context() as m:
            m.setattr(sampling, "residual", lambda p, q: p)
            n = 600
            counts = engine_counts(pair, sharp, lambda: ParallelDrafter(sharp, ids, 2.5), ids, params, n, window=4)
    finally:
        pair.target.branches = saved
    print("engine rows, no residual:", assert_rejected(counts, engine_exact(sharp, ids, params, n), n))


def test_tokens_a_cycle_script_reports_each_row_count(tiny_dirs, tmp_path):
    """scripts/sampled_rows_tpc.py on a tiny pair: every row count measured, rows verified."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts/sampled_rows_tpc.py"
    out = tmp_path / "tpc.json"
    d = tiny_dirs["qwen3"]
    r = subprocess.run([sys.executable, str(script), "--model", str(d), "--draft", str(d / "draft"),
                        "--prompts", "2", "--max-tokens", "12", "--rows", "1,3", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert set(rep["summary"]) == {"1", "3"} and rep["summary"]["1"]["vs_one_row"] == 1.0
    assert all(x["row_cycles"] == 0 for x in rep["runs"]["1"])
    assert all(x["row_cycles"] >= 1 for x in rep["runs"]["3"])
    assert all(s["tokens_per_cycle"] >= 1.0 for s in rep["summary"].values())


def test_rows_rule_with_the_wrong_proposal_is_rejected(monkeypatch):
    """Power: judging a later candidate against q itself instead of what it was drawn from (q
    without the node's earlier candidates) is caught."""
    t, q = block_tables(PARAMS["t1.0"], "random")
    monkeypatch.setattr(sampling, "_without", lambda q, x: q)
    r = assert_rejected(counts_of(simulate_rows(t, q, [0, 0, 0], seed=4)), markov_exact(t), CHAINS)
    print("rows judged against q (rule, n=200k):", r)
