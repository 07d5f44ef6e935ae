"""DFLASH_VERIFY_ATTN (engine/verifyattn.py), the few-query kernel's maths (engine/fewq.py) and
the CPU's fast-exp attention and SwiGLU (engine/cpuattn.py, engine/fastexp.py).

The CUDA kernel itself only runs on a CUDA GPU (scripts/fewq_check.py checks it there against
fewq.reference). Here, on the CPU: the setting, the shapes the kernel takes, its chunking, that
fewq.reference is MLX's attention, and the routing: with the kernel's place taken by
fewq.reference (the same maths in plain MLX ops), the verify's and the draft's few-query
attentions go through it, mlx-lm's own decode never does, and the ids stay mlx-lm's greedy ids.
The same for the fast-exp attention and SwiGLU, which run here for real; and their maths against
MLX's and mlx-lm's.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from conftest import ARCHS
from dflash.engine import cpuattn, fastexp, fewq, verifyattn
from dflash.engine.loading import load_pair
from helpers import cut_at_eos, greedy_reference, run_dflash

PROMPT = "def fibonacci(n):\n    a, b = 0, 1\n"


def test_the_setting_is_resolved_and_a_bad_one_is_a_clear_error(monkeypatch):
    for value, want in (("", "fastexp"), ("auto", "fastexp"), ("mlx", "mlx"), ("fastexp", "fastexp")):
        monkeypatch.setenv(verifyattn.ENV, value)
        assert verifyattn.mode() == want  # this machine has no CUDA GPU: auto is the CPU's
    monkeypatch.setenv(verifyattn.ENV, "kernel")
    with pytest.raises(ValueError, match="CUDA"):
        verifyattn.mode()
    monkeypatch.setattr(verifyattn, "cuda", lambda: True)
    assert verifyattn.mode() == "kernel"
    monkeypatch.setenv(verifyattn.ENV, "auto")
    monkeypatch.setattr(verifyattn, "_works", True)
    assert verifyattn.mode() == "kernel"
    for bad in ("kernal", "array", "causal"):
        monkeypatch.setenv(verifyattn.ENV, bad)
        with pytest.raises(ValueError, match=verifyattn.ENV):
            verifyattn.mode()


def test_auto_checks_the_kernel_once_and_falls_back_with_a_warning(monkeypatch):
    monkeypatch.setattr(verifyattn, "cuda", lambda: True)
    monkeypatch.setenv(verifyattn.ENV, "auto")
    monkeypatch.setattr(fewq, "DTYPES", (mx.bfloat16, mx.float32))
    monkeypatch.setattr(verifyattn, "_works", None)
    monkeypatch.setattr(fewq, "attention", fewq.reference)  # the kernel's maths, as on a GPU
    assert verifyattn.mode() == "kernel" and verifyattn._works is True

    def broken(*args, **kwargs):
        raise RuntimeError("nvrtc: no bf16 WMMA on this GPU")

    monkeypatch.setattr(verifyattn, "_works", None)
    monkeypatch.setattr(fewq, "attention", broken)
    with pytest.warns(RuntimeWarning, match="nvrtc: no bf16 WMMA"):
        assert verifyattn.mode() == "mlx"
    assert verifyattn.mode() == "mlx"  # checked once: no second warning, no second try

    monkeypatch.setattr(verifyattn, "_works", None)
    def wrong(q, k, v, scale, causal):
        return fewq.reference(q, k, v, scale, not causal)

    monkeypatch.setattr(fewq, "attention", wrong)
    with pytest.warns(RuntimeWarning, match="differs"):
        assert verifyattn.mode() == "mlx"


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(32, 8), (9, 3), (2, 2)])
def test_the_reference_is_mlx_attention(causal, heads):
    hq, hkv = heads
    q = mx.random.normal((1, hq, 7, 64), key=mx.random.key(0))
    k = mx.random.normal((1, hkv, 40, 64), key=mx.random.key(1))
    v = mx.random.normal((1, hkv, 40, 64), key=mx.random.key(2))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal" if causal else None)
    assert mx.allclose(fewq.reference(q, k, v, 0.125, causal), want, atol=1e-5)


def test_the_shapes_the_kernel_takes():
    def shapes(hq, hkv, m, d, dtype=mx.bfloat16):
        q = mx.zeros((1, hq, m, d), dtype=dtype)
        kv = mx.zeros((1, hkv, 100, d), dtype=dtype)
        return fewq.supported(q, kv, kv)

    assert shapes(32, 8, 16, 128) and shapes(9, 3, 16, 64) and shapes(32, 8, 4, 128)
    assert not shapes(32, 8, 3, 128)  # under 4 queries: MLX's own fused decode kernel
    assert not shapes(32, 8, 17, 128)  # prefill chunks
    assert not shapes(32, 8, 16, 96)  # head dim
    assert not shapes(32, 4, 16, 128)  # 8 query heads per KV head: 128 rows, more than a block holds
    assert not shapes(32, 8, 16, 128, mx.float32)  # fp32 stays on MLX's path
    assert shapes(32, 8, 16, 128, mx.float16)


def test_chunks_cover_every_key_tile_and_none_is_empty():
    for keys in (1, 63, 64, 65, 1040, 4096, 8208, 40000):
        for blocks in (1, 3, 8, 64):
            tiles = math.ceil(keys / fewq.TILE)
            nc = fewq.chunks(keys, blocks)
            per = math.ceil(tiles / nc)  # what the kernel computes from its grid
            assert 1 <= nc <= tiles and (nc - 1) * per < tiles <= nc * per
            assert nc * blocks <= max(fewq.TARGET_BLOCKS + blocks, blocks)


@pytest.fixture
def kernel_by_reference(monkeypatch):
    """DFLASH_VERIFY_ATTN=kernel as on a CUDA GPU, with fewq.reference standing in for the CUDA
    kernel; records the (queries, keys, causal) of every call. Undone after the test."""
    calls = []

    def stand_in(q, k, v, scale, causal):
        calls.append((q.shape[2], k.shape[2], causal))
        return fewq.reference(q, k, v, scale, causal)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", mx.fast.scaled_dot_product_attention)
    monkeypatch.setattr(verifyattn, "_real_sdpa", None)
    monkeypatch.setattr(verifyattn, "_chosen", "mlx")
    monkeypatch.setattr(verifyattn, "cuda", lambda: True)
    monkeypatch.setattr(fewq, "attention", stand_in)
    monkeypatch.setattr(fewq, "HEAD_DIMS", (32, 64))  # the tiny draft's head dim too
    monkeypatch.setattr(fewq, "DTYPES", (mx.float32,))  # the tiny models run in fp32
    monkeypatch.setenv(verifyattn.ENV, "kernel")
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_kernel_path_gives_mlx_lm_greedy_ids_and_only_in_the_cycle(tiny_dirs, kernel_by_reference, arch):
    assert arch in ARCHS
    pair = load_pair(tiny_dirs[arch], tiny_dirs[arch] / "draft")  # configure(): the wrapper goes in
    _routed_runs(pair, kernel_by_reference, ("full", 4, "auto"), fewest=4)


def _routed_runs(pair, calls: list, windows: tuple, fewest: int, swiglu_rows: list | None = None) -> None:
    """mlx-lm's decode never reaches our attention (`calls` stays empty) nor our SwiGLU; the
    cycle's ids are mlx-lm's greedy ids at every window; the verifies (fewest..16 causal queries)
    and the draft's 16-query block went through it; with `swiglu_rows`, the target's and the
    draft's MLPs of 2 or more rows (prefill, verifies, the draft's block) went through ours."""
    ids = pair.tokenizer.encode(PROMPT)
    ref = cut_at_eos(greedy_reference(pair.target.model, ids, 40), set(pair.tokenizer.eos_token_ids))
    assert not calls, "mlx-lm's own decode went through our attention"
    assert not swiglu_rows, "mlx-lm's own decode went through our SwiGLU"
    for window in windows:
        final, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 40, verify_window=window)
        assert final.token_ids == ref, f"window {window} diverged from mlx-lm greedy"
    causal = [c for c in calls if c[2]]
    block = [c for c in calls if not c[2]]
    assert causal and all(fewest <= q <= 16 and k >= q for q, k, _ in causal)  # the verifies
    assert block and all(q == 16 for q, _, _ in block)  # the draft's block over its context
    if swiglu_rows is not None:
        assert swiglu_rows and min(swiglu_rows) >= 2  # never a decode step's one row
        assert 16 in swiglu_rows and len(ids) in swiglu_rows  # the draft's block; the prefill


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", [(9, 3, 16, 300), (4, 1, 2, 5), (8, 8, 7, 40), (9, 3, 16, 2000)])
def test_the_fast_exp_attention_is_mlx_attention(causal, shape):
    hq, hkv, m, n = shape
    q, k, v = (mx.random.normal(s, key=mx.random.key(i)) * 3
               for i, s in enumerate(((1, hq, m, 64), (1, hkv, n, 64), (1, hkv, n, 64))))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal" if causal else None)
    got = cpuattn.attention(q, k, v, 0.125, causal)
    assert got.shape == want.shape and got.dtype == mx.float32
    assert mx.allclose(got, want, atol=2e-6, rtol=1e-5).item()


def test_the_fast_softmax_zeroes_masked_keys_and_keeps_extremes_finite():
    scores = mx.array([[0.0, -1.0, -80.0, -200.0, 90.0], [1e4, -1e4, 0.0, 3.0, 3.0]])
    bias = mx.array([[0.0, 0.0, 0.0, 0.0, -math.inf], [0.0, 0.0, 0.0, 0.0, 0.0]])
    got = fastexp.softmax(scores, bias)
    want = mx.softmax(scores + bias, axis=-1)
    assert got[0, 4].item() == 0.0  # a masked key weighs exactly nothing
    assert mx.all(mx.isfinite(got)).item()
    assert mx.allclose(got, want, atol=1e-7, rtol=2e-6).item()
    x = mx.linspace(-87, 0, 10001)[None]  # its max is 0: the weights are exp(x) itself
    p, bits = fastexp._weights(x, mx.zeros((1, 1)))
    e = np.array(p * bits.view(mx.float32), dtype=np.float64)
    want = np.exp(np.array(x, dtype=np.float64))
    assert np.max(np.abs(e - want) / want) < 5e-6  # MLX's own exp: 3.8e-6 here (at -86.4)


def test_the_fast_swiglu_is_mlx_lms_swiglu():
    from mlx_lm.models.activations import swiglu

    gate = mx.concatenate([mx.random.normal((1, 16, 1536), key=mx.random.key(0)) * 6,
                           mx.array([-200.0, -103.0, -87.5, -30.0, -1e-30, 0.0, 1e-30, 30.0, 90.0,
                                     200.0, 1e30, -1e30, 2.5, -2.5, 0.5, -0.5] * 96).reshape(1, 1, 1536)], axis=1)
    up = mx.random.normal(gate.shape, key=mx.random.key(1))
    got, want = fastexp.swiglu(gate, up), swiglu(gate, up)
    assert got.shape == want.shape and got.dtype == mx.float32
    assert mx.all(mx.isfinite(got)).item()
    assert mx.allclose(got, want, atol=1e-36, rtol=3e-6).item()  # relative, down to tiny values
    for rows in (2, 5, 300):  # any row count, one shapeless kernel pair
        g = mx.repeat(gate[:, :1], rows, axis=1)
        assert mx.allclose(fastexp.swiglu(g, g), swiglu(g, g), atol=1e-36, rtol=3e-6).item()


def test_which_calls_the_fast_exp_attention_takes():
    q16, q1 = mx.zeros((1, 9, 16, 64)), mx.zeros((1, 9, 1, 64))
    kv = mx.zeros((1, 3, 100, 64))
    assert cpuattn.supported(q16, kv, kv, "causal") and cpuattn.supported(q16, kv, kv, None)
    assert not cpuattn.supported(q1, kv, kv, None)  # a decode step: MLX's, as mlx-lm's
    assert not cpuattn.supported(mx.zeros((1, 9, 17, 64)), kv, kv, "causal")  # a prefill chunk
    assert not cpuattn.supported(q16, kv, kv, mx.zeros((16, 100)))  # an array mask
    assert not cpuattn.supported(q16.astype(mx.bfloat16), kv.astype(mx.bfloat16), kv, None)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_fast_exp_path_gives_mlx_lm_greedy_ids_and_only_in_the_cycle(tiny_dirs, monkeypatch, arch):
    calls = []
    real = cpuattn.attention

    def recording(q, k, v, scale, causal):
        calls.append((q.shape[2], k.shape[2], causal))
        return real(q, k, v, scale, causal)

    swiglu_rows = []
    real_swiglu = fastexp.swiglu

    def recording_swiglu(gate, up):
        swiglu_rows.append(gate.shape[-2])
        return real_swiglu(gate, up)

    monkeypatch.setattr(cpuattn, "attention", recording)
    monkeypatch.setattr(fastexp, "swiglu", recording_swiglu)
    monkeypatch.setenv(verifyattn.ENV, "auto")  # the CPU's default
    pair = load_pair(tiny_dirs[arch], tiny_dirs[arch] / "draft")
    assert pair.target.verify_attention == "fastexp"
    _routed_runs(pair, calls, ("full", 4, 2, "auto"), fewest=2, swiglu_rows=swiglu_rows)
