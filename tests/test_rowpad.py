"""Few-row products padded to the row count the BLAS does fastest (engine/rowpad.py): same rows,
same ids as mlx-lm greedy, padding only inside the target's own forwards (mlx-lm on the same
model object runs unpadded), plans measured once per weight shape."""

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
def padded(monkeypatch):
    """Record every padding rowpad does as (input shape, padded rows); the real function runs."""
    calls = []
    real = rowpad._pad

    def counting(x, rows):
        calls.append((tuple(x.shape), rows))
        return real(x, rows)

    monkeypatch.setattr(rowpad, "_pad", counting)
    return calls


def test_padded_modules_give_the_same_rows_and_pad_only_when_active(padded):
    lin, emb = nn.Linear(24, 40), nn.Embedding(50, 24)
    x = mx.random.normal((1, 1, 24), key=mx.random.key(1))
    want_lin, want_emb = lin(x), emb.as_linear(x)
    wide = mx.random.normal((1, 3, 24), key=mx.random.key(2))
    want_wide = lin(wide)
    model = nn.Sequential(lin, emb)
    assert rowpad.pad_rows(model, {(40, 24): {1: 2, 3: 16}, (50, 24): {1: 2}}) == 2
    assert type(lin).__name__ == "RowPaddedLinear" and type(emb).__name__ == "RowPaddedEmbedding"
    assert mx.array_equal(lin(x), want_lin) and not padded  # outside active(): untouched
    with rowpad.active():
        assert lin(x).shape == (1, 1, 40) and emb.as_linear(x).shape == (1, 1, 50)
        assert mx.allclose(lin(x), want_lin, atol=1e-6) and mx.allclose(emb.as_linear(x), want_emb, atol=1e-6)
        assert lin(wide).shape == (1, 3, 40) and mx.allclose(lin(wide), want_wide, atol=1e-6)
        assert mx.array_equal(emb.as_linear(wide), emb.as_linear(wide))  # no plan for 3 rows there
        assert mx.array_equal(emb(mx.array([[3]])), emb.weight[3][None, None])  # lookups untouched
    assert padded == [((1, 1, 24), 2)] * 4 + [((1, 3, 24), 16)] * 2


def test_a_model_wrapped_twice_keeps_its_padding_and_takes_the_new_plan(padded):
    lin = nn.Linear(8, 8)
    assert rowpad.pad_rows(lin, {(8, 8): {1: 2}}) == 1
    assert rowpad.pad_rows(lin, {(8, 8): {2: 4}}) == 1  # e.g. a second TargetModel on one model
    with rowpad.active():
        lin(mx.zeros((1, 1, 8)))
        lin(mx.zeros((1, 2, 8)))
    assert padded == [((1, 2, 8), 4)]
    assert rowpad.pad_rows(lin, {}) == 0
    with rowpad.active():
        lin(mx.zeros((1, 2, 8)))
    assert len(padded) == 1


def test_quantized_and_half_precision_modules_are_left_alone():
    lin = nn.Linear(64, 64)
    half = nn.Linear(64, 64)
    half.set_dtype(mx.bfloat16)
    q = nn.QuantizedLinear(64, 64, group_size=32, bits=4)
    assert rowpad.pad_rows(nn.Sequential(lin, half, q), {(64, 64): {1: 2}}) == 1
    assert type(half) is nn.Linear and type(q) is nn.QuantizedLinear


def test_the_plan_pads_to_the_fastest_row_count_at_or_above():
    ms = lambda *t: [x * 1e-3 for x in t]  # noqa: E731
    # session 7's Intel Xeon + MKL, SmolLM2's 49152x576 LM head, 1..16 rows
    head = ms(9.2, 11.6, 13.2, 22.0, 20.4, 20.7, 30.3, 31.0, 31.1, 35.1, 39.0, 38.5, 46.1, 47.3, 48.9, 21.2)
    assert rowpad.choose(head) == {m: 16 for m in range(7, 16)}  # 4-6: 16 rows are not 10% faster
    # session 6's AMD EPYC: two rows faster than one
    assert rowpad.choose(ms(8.9, 6.2, 7.0)) == {1: 2}
    assert rowpad.choose(ms(1.0, 1.0, 2.0)) == {}  # equal: never pad
    assert rowpad.choose(ms(1.0, 0.95)) == {}  # less than 10% faster: not worth it
    # a small weight: 3 rows 11% faster than 2 but by 20 us, within its timing noise;
    # 15 -> 16 rows saves 0.26 ms
    mlp = ms(0.17, 0.18, 0.16, *[0.5] * 11, 0.72, 0.46)
    assert rowpad.choose(mlp) == {15: 16}


def test_the_plan_can_be_forced_and_is_measured_once_per_weight_shape(monkeypatch):
    model = nn.Sequential(nn.Linear(32, 512), nn.Linear(32, 16))
    for forced, want in (("1", rowpad.FORCED), ("0", {})):
        monkeypatch.setenv(rowpad.ENV, forced)
        assert rowpad.plan(model) == {(512, 32): want, (16, 32): want}
    monkeypatch.delenv(rowpad.ENV)
    for k in ((512, 32), (16, 32)):
        rowpad._measured.pop(k, None)
    first = rowpad.plan(model)
    assert set(first) == {(512, 32), (16, 32)} and set(rowpad._measured) >= set(first)
    for rows in first.values():
        assert all(1 <= m < to <= rowpad.MAX_ROWS for m, to in rows.items())
    assert rowpad.plan(model) == first  # measured once


@pytest.mark.parametrize("arch", ARCHS)
def test_padded_target_decodes_mlx_lm_greedy_ids(tiny_dirs, monkeypatch, padded, arch):
    """Forced on (one row as two, every 2..15-row product as 16 rows: the verify windows and the
    draft's LM head), every window gives mlx-lm's greedy ids, and mlx-lm itself (the benchmark's
    baseline, same model object) is never padded."""
    monkeypatch.setenv(rowpad.ENV, "1")
    monkeypatch.setattr(rowpad, "FORCED", {1: 2, **{m: 16 for m in range(2, 16)}})
    pair = load_pair(tiny_dirs[arch], tiny_dirs[arch] / "draft")  # its own copy: classes swapped
    assert pair.target.row_padding
    ids = pair.tokenizer.encode(PROMPT)
    ref = cut_at_eos(greedy_reference(pair.target.model, ids, 40), set(pair.tokenizer.eos_token_ids))
    assert not padded, "mlx-lm's own decode loop was padded"
    plain = rollback.plain_step_undoable(pair.target.make_cache())  # not Gemma's sliding window
    for window in (1, "auto", 3, "full") if plain else ("auto", 3, "full"):
        final, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 40, verify_window=window)
        assert final.token_ids == ref, f"{arch}: window {window} diverged from mlx-lm greedy"
    rows = {x[-2] for x, _ in padded}
    head = pair.drafter.block_size - 1  # the draft's LM head rows
    assert {1, head} <= rows, f"expected 1-row and {head}-row products padded, got {rows}"


def test_the_workers_status_line_says_whether_rows_are_padded(tiny_dirs, monkeypatch):
    from dflash.daemon.worker import _pair_notes

    assert _pair_notes(None) == ""  # still loading
    monkeypatch.setenv("DFLASH_CPU_FAST", "0")
    monkeypatch.setenv("DFLASH_FUSE", "0")  # engine/fuse.py (a GPU's default; tests/test_fuse.py)
    for forced, want in (("1", "; few-row products padded"), ("0", "")):
        monkeypatch.setenv(rowpad.ENV, forced)
        assert _pair_notes(load_pair(tiny_dirs["qwen3"], tiny_dirs["qwen3"] / "draft")) == want
    monkeypatch.setenv("DFLASH_CPU_FAST", "1")  # engine/cpufast.py, the CPU's default
    assert _pair_notes(load_pair(tiny_dirs["qwen3"], tiny_dirs["qwen3"] / "draft")) == \
        "; RoPE and RMSNorm in fewer CPU kernels"
