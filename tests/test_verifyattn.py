"""DFLASH_VERIFY_ATTN (engine/verifyattn.py) and the few-query kernel's maths (engine/fewq.py).

The CUDA kernel itself only runs on a CUDA GPU (scripts/fewq_check.py checks it there against
fewq.reference). Here, on the CPU: the setting, the shapes the kernel takes, its chunking, that
fewq.reference is MLX's attention, and the routing: with the kernel's place taken by
fewq.reference (the same maths in plain MLX ops), the verify's and the draft's few-query
attentions go through it, mlx-lm's own decode never does, and the ids stay mlx-lm's greedy ids.
"""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from conftest import ARCHS
from dflash.engine import fewq, verifyattn
from dflash.engine.loading import load_pair
from helpers import cut_at_eos, greedy_reference, run_dflash

PROMPT = "def fibonacci(n):\n    a, b = 0, 1\n"


def test_the_setting_is_resolved_and_a_bad_one_is_a_clear_error(monkeypatch):
    for value in ("", "auto", "mlx"):
        monkeypatch.setenv(verifyattn.ENV, value)
        assert verifyattn.mode() == "mlx"  # this machine has no CUDA GPU
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
    monkeypatch.setattr(verifyattn, "_kernel", False)
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
    ids = pair.tokenizer.encode(PROMPT)
    ref = cut_at_eos(greedy_reference(pair.target.model, ids, 40), set(pair.tokenizer.eos_token_ids))
    assert not kernel_by_reference, "mlx-lm's own decode went through the kernel"
    for window in ("full", 4, "auto"):
        final, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 40, verify_window=window)
        assert final.token_ids == ref, f"{arch}: window {window} diverged from mlx-lm greedy"
    causal = [c for c in kernel_by_reference if c[2]]
    block = [c for c in kernel_by_reference if not c[2]]
    assert causal and all(4 <= q <= 16 and k >= q for q, k, _ in causal)  # the verifies
    assert block and all(q == 16 for q, _, _ in block)  # the draft's block over its context
