"""DFLASH_PIPELINE (engine/target.py): a verify queued on the device in parts as it is built.

On a GPU the cycle queues the draft's ids and each captured target layer's output as soon as
they exist (mx.async_eval), so the device runs them while Python builds the rest. Only the
schedule of evaluation changes, never the maths: here, on the CPU with the switch forced on,
the verifies queue their captured layers, plain steps and prefill do not, and the ids stay
mlx-lm's greedy ids with every verify window.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from conftest import ARCHS
from dflash.engine import target as target_mod
from dflash.engine.loading import load_pair
from helpers import cut_at_eos, greedy_reference, run_dflash

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"


def test_the_setting_is_resolved_and_a_bad_one_is_a_clear_error(monkeypatch):
    for value, want in (("", False), ("auto", False), ("0", False), ("1", True)):
        monkeypatch.setenv(target_mod.PIPELINE_ENV, value)  # "" and auto: this machine has no GPU
        assert target_mod.pipelined_default() is want
    for bad in ("yes", "2", "gpu"):
        monkeypatch.setenv(target_mod.PIPELINE_ENV, bad)
        with pytest.raises(ValueError, match=target_mod.PIPELINE_ENV):
            target_mod.pipelined_default()


@pytest.fixture
def queued(monkeypatch):
    """Counts mx.async_eval calls by the number of arrays each one queues."""
    calls: list[int] = []
    real = mx.async_eval

    def counting(*arrays):
        calls.append(len(arrays))
        return real(*arrays)

    monkeypatch.setattr(mx, "async_eval", counting)
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_pipelined_verifies_keep_mlx_lm_greedy_ids(tiny_dirs, monkeypatch, queued, arch):
    assert arch in ARCHS
    monkeypatch.setenv(target_mod.PIPELINE_ENV, "1")
    pair = load_pair(tiny_dirs[arch], tiny_dirs[arch] / "draft")
    assert pair.target.pipelined
    ids = pair.tokenizer.encode(PROMPT)
    ref = cut_at_eos(greedy_reference(pair.target.model, ids, 40), set(pair.tokenizer.eos_token_ids))
    for window in ("full", 4, 1):
        queued.clear()
        final, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 40, verify_window=window)
        assert final.token_ids == ref, f"{arch}: window {window} diverged from mlx-lm greedy"
        layers = len(pair.target.layer_ids)
        one = queued.count(1)  # captured layer outputs and draft ids are queued one by one
        if window == 1:  # plain steps: no drafts, no early layers (the step ahead is the overlap)
            assert one == 0, queued
        else:  # each draft cycle: its drafts + every captured layer
            cycles = final.stats.cycles - final.stats.copy_cycles
            assert one >= cycles * (layers + 1) > 0, (one, cycles, layers)


def test_not_pipelined_nothing_is_queued_early(tiny_dirs, monkeypatch, queued):
    monkeypatch.setenv(target_mod.PIPELINE_ENV, "0")
    pair = load_pair(tiny_dirs["qwen3"], tiny_dirs["qwen3"] / "draft")
    ids = pair.tokenizer.encode(PROMPT)
    run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 24, verify_window="full")
    assert queued.count(1) == 0, queued


def test_pipelining_never_changes_a_seeded_sampled_run(tiny_dirs, monkeypatch):
    """Only the order of evaluation changes: the same seed and window give the same draws."""
    ids_by_mode = {}
    for mode in ("0", "1"):
        monkeypatch.setenv(target_mod.PIPELINE_ENV, mode)
        pair = load_pair(tiny_dirs["llama"], tiny_dirs["llama"] / "draft")
        assert pair.target.pipelined is (mode == "1")
        ids = pair.tokenizer.encode(PROMPT)
        final, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 32, verify_window=4,
                              temperature=0.8, top_p=0.95, seed=11)
        assert final.stats.cycles > 0
        ids_by_mode[mode] = final.token_ids
    assert ids_by_mode["0"] == ids_by_mode["1"]
