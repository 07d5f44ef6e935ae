"""Run-ahead (engine/generate.py): the next cycle's draft queued before the verify is read.

On a pipelined target (GPU; here the CPU with DFLASH_PIPELINE=1), a greedy draft cycle likely
to be wholly accepted puts its whole block into the draft's context and queues the next draft
behind its verify. A block not wholly accepted trims the draft's context back to the kept rows.
Here the real DFlash draft runs every pass (its context, its trims), while the proposals are the
target's own ids, wrong at one position of some blocks, so whole and partial blocks alternate:
the ids stay mlx-lm's greedy ids, run-ahead is used, and the draft's context rows are exactly
those of a run without it, row for row.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from dflash.engine import target as target_mod
from dflash.engine.drafters import DFlashDrafter
from dflash.engine.loading import load_pair
from helpers import greedy_reference, run_dflash

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"
N_NEW = 128


class ReferenceThroughDraft(DFlashDrafter):
    """The real draft's context and pass, evaluated; the proposal: the reference's ids, wrong
    at block position 12 when the anchor falls in every third stretch of 16 answer tokens."""

    def __init__(self, drafter: DFlashDrafter, reference: list[int], prompt_len: int):
        self.__dict__.update(drafter.__dict__)
        self.reference, self.prompt_len = reference, prompt_len
        self.vocab = drafter.target.vocab_size

    def propose(self, anchor, anchor_pos, count=None, sampling=None):
        mx.eval(super().propose(anchor, anchor_pos, count))  # the context must fit the anchor
        n = self.block_size - 1 if count is None else count
        start = anchor_pos + 1 - self.prompt_len
        ids = [self.reference[start + j] if start + j < len(self.reference) else 0 for j in range(n)]
        if (start // 16) % 3 == 2 and n > 11:
            ids[11] = (ids[11] + 1) % self.vocab
        ids = mx.array(ids, dtype=mx.int32)
        return ids if sampling is None else (ids, None)  # under sampling: q one-hot at the ids


def _run(tiny_dirs, monkeypatch, arch: str, pipeline: str, window="full"):
    monkeypatch.setenv(target_mod.PIPELINE_ENV, pipeline)
    pair = load_pair(tiny_dirs[arch], tiny_dirs[arch] / "draft")
    ids = pair.tokenizer.encode(PROMPT)
    ref = greedy_reference(pair.target.model, ids, N_NEW + 16)
    drafter = ReferenceThroughDraft(pair.drafter, ref, len(ids))
    saved, pair.tokenizer.eos_token_ids = pair.tokenizer.eos_token_ids, set()
    try:  # no EOS: the whole length runs
        final, _ = run_dflash(pair.target, drafter, pair.tokenizer, ids, N_NEW, verify_window=window)
    finally:
        pair.tokenizer.eos_token_ids = saved
    assert final.token_ids == ref[:N_NEW], f"{arch}, pipeline {pipeline}: diverged from mlx-lm greedy"
    return final, drafter, len(ids)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_run_ahead_keeps_greedy_ids_and_the_drafts_context(tiny_dirs, monkeypatch, arch):
    on, on_drafter, prompt_len = _run(tiny_dirs, monkeypatch, arch, "1")
    off, off_drafter, _ = _run(tiny_dirs, monkeypatch, arch, "0")
    assert off.stats.run_ahead == 0
    assert on.stats.run_ahead >= 1, on.stats
    hist = on.stats.accept_histogram
    assert hist[15] >= 2 and sum(hist[:15]) >= 2, hist  # whole and partial blocks both ran
    # no row past the kept ones (anchor + accepted drafts of each cycle, as the histogram counts
    # them: the last cycle may keep more than max_tokens lets out, which accepted_drafts does
    # not count), and the rows present are the same rows at the same places
    kept = prompt_len + on.stats.cycles + sum(i * n for i, n in enumerate(hist))
    assert on_drafter.context_len <= kept
    rows = min(on_drafter.context_len, off_drafter.context_len)
    assert rows > prompt_len
    for a, b in zip(on_drafter.cache, off_drafter.cache):
        ka, va, kb, vb = a.keys, a.values, b.keys, b.values
        assert mx.allclose(ka[..., :rows, :], kb[..., :rows, :], atol=1e-4).item()
        assert mx.allclose(va[..., :rows, :], vb[..., :rows, :], atol=1e-4).item()


def test_run_ahead_switch_and_where_it_does_not_run(tiny_dirs, monkeypatch):
    monkeypatch.setenv(target_mod.PIPELINE_ENV, "1")
    monkeypatch.setenv(target_mod.RUNAHEAD_ENV, "0")
    pair = load_pair(tiny_dirs["llama"], tiny_dirs["llama"] / "draft")
    assert pair.target.pipelined and not pair.target.run_ahead
    monkeypatch.delenv(target_mod.RUNAHEAD_ENV)
    pair = load_pair(tiny_dirs["llama"], tiny_dirs["llama"] / "draft")
    assert pair.target.run_ahead
    ids = pair.tokenizer.encode(PROMPT)
    ref = greedy_reference(pair.target.model, ids, N_NEW + 16)
    drafter = ReferenceThroughDraft(pair.drafter, ref, len(ids))
    # sampling never runs ahead (its draws would depend on it); nor do plain steps
    for kwargs in ({"temperature": 0.7, "seed": 3}, {"verify_window": 1}):
        final, _ = run_dflash(pair.target, drafter, pair.tokenizer, ids, 40, **kwargs)
        assert final.stats.run_ahead == 0, kwargs
