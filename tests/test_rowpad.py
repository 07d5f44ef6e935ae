"""One-row products done as two rows (engine/rowpad.py): same logits, same ids as mlx-lm greedy,
padding only inside the target's own forwards (mlx-lm on the same model object runs unpadded)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from conftest import ARCHS
from dflash.engine import rollback, rowpad
from dflash.engine.loading import load_pair
from helpers import cut_at_eos, greedy_reference, run_dflash

PROMPT = "def fibonacci(n):\n    a, b = 0, 1\n"


@pytest.fixture
def doubled(monkeypatch):
    """Count the one-row inputs rowpad doubles (the real function still runs)."""
    calls = []
    real = rowpad._double

    def counting(x):
        calls.append(tuple(x.shape))
        return real(x)

    monkeypatch.setattr(rowpad, "_double", counting)
    return calls


def test_padded_modules_give_the_same_rows_and_pad_only_when_active(doubled):
    lin, emb = nn.Linear(24, 40), nn.Embedding(50, 24)
    x = mx.random.normal((1, 1, 24), key=mx.random.key(1))
    want_lin, want_emb = lin(x), emb.as_linear(x)
    wide = mx.random.normal((1, 3, 24), key=mx.random.key(2))
    want_wide = lin(wide)
    model = nn.Sequential(lin, emb)
    assert rowpad.pad_single_rows(model) == 2
    assert type(lin).__name__ == "RowPaddedLinear" and type(emb).__name__ == "RowPaddedEmbedding"
    assert mx.array_equal(lin(x), want_lin) and not doubled  # outside active(): untouched
    with rowpad.active():
        assert lin(x).shape == (1, 1, 40) and emb.as_linear(x).shape == (1, 1, 50)
        assert mx.allclose(lin(x), want_lin, atol=1e-6) and mx.allclose(emb.as_linear(x), want_emb, atol=1e-6)
        assert mx.array_equal(lin(wide), want_wide)  # more than one row: never padded
        assert mx.array_equal(emb(mx.array([[3]])), emb.weight[3][None, None])  # lookups untouched
    assert doubled == [(1, 1, 24)] * 4


def test_quantized_and_half_precision_modules_are_left_alone():
    lin = nn.Linear(64, 64)
    half = nn.Linear(64, 64)
    half.set_dtype(mx.bfloat16)
    q = nn.QuantizedLinear(64, 64, group_size=32, bits=4)
    assert rowpad.pad_single_rows(nn.Sequential(lin, half, q)) == 1
    assert type(half) is nn.Linear and type(q) is nn.QuantizedLinear


def test_the_decision_can_be_forced_and_is_measured_once_per_weight_shape(monkeypatch):
    model = nn.Sequential(nn.Linear(32, 512), nn.Linear(32, 16))
    for forced, want in (("1", True), ("0", False)):
        monkeypatch.setenv(rowpad.ENV, forced)
        assert rowpad.pays(model) is want
    monkeypatch.delenv(rowpad.ENV)
    rowpad._measured.pop((512, 32), None)
    first = rowpad.pays(model)
    assert (512, 32) in rowpad._measured  # timed on the largest weight
    assert rowpad.pays(model) is first


@pytest.mark.parametrize("arch", ARCHS)
def test_padded_target_decodes_mlx_lm_greedy_ids(tiny_dirs, monkeypatch, doubled, arch):
    """Forced on, every window gives mlx-lm's greedy ids, and mlx-lm itself (the benchmark's
    baseline, same model object) is never padded."""
    monkeypatch.setenv(rowpad.ENV, "1")
    pair = load_pair(tiny_dirs[arch], tiny_dirs[arch] / "draft")  # its own copy: classes swapped
    assert pair.target.row_padding
    ids = pair.tokenizer.encode(PROMPT)
    ref = cut_at_eos(greedy_reference(pair.target.model, ids, 40), set(pair.tokenizer.eos_token_ids))
    assert not doubled, "mlx-lm's own decode loop was padded"
    plain = rollback.plain_step_undoable(pair.target.make_cache())  # not Gemma's sliding window
    for window in (1, "auto", 3) if plain else ("auto", 3):
        final, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 40, verify_window=window)
        assert final.token_ids == ref, f"{arch}: window {window} diverged from mlx-lm greedy"
    assert doubled, "no one-row product was padded"


def test_the_workers_status_line_says_whether_rows_are_padded(tiny_dirs, monkeypatch):
    from dflash.daemon.worker import _row_padding

    assert _row_padding(None) == ""  # still loading
    for forced, want in (("1", "; one-row products padded"), ("0", "")):
        monkeypatch.setenv(rowpad.ENV, forced)
        assert _row_padding(load_pair(tiny_dirs["qwen3"], tiny_dirs["qwen3"] / "draft")) == want
