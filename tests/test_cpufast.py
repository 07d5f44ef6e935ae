"""engine/cpufast.py: RoPE and RMSNorm in fewer CPU kernels, bit for bit what MLX computes."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from dflash.engine import cpufast


@pytest.mark.parametrize("rows", [1, 2, 16, 33])
@pytest.mark.parametrize("offset", [0, 5, 300, 4095, 70000])
def test_rope_equals_mlx_bit_for_bit(rows: int, offset: int):
    for heads, feat, dims, base, scale in ((9, 64, 64, 100000.0, 1.0), (3, 128, 128, 1e6, 1.0),
                                           (4, 64, 32, 12345.678, 0.5), (2, 80, 64, 10000.0, 2.0)):
        x = mx.random.normal((1, heads, rows, feat), key=mx.random.key(rows * 7 + offset + heads))
        want = mx.fast.rope(x, dims, traditional=False, base=base, scale=scale, offset=offset)
        with cpufast.active():
            got = cpufast.rope(x, offset, dims, base, scale)
        assert got.shape == want.shape
        assert mx.array_equal(got, want).item(), (rows, offset, heads, feat, dims, base, scale)


@pytest.mark.parametrize("shape", [(1, 1, 576), (1, 16, 576), (2, 3, 4, 64), (7,)])
def test_rms_norm_equals_mlx_bit_for_bit(shape):
    for i, (eps, mag) in enumerate(((1e-5, 1.0), (1e-6, 300.0), (1e-5, 1e-3))):
        x = mx.random.normal(shape, key=mx.random.key(i)) * mag
        w = mx.random.normal(shape[-1:], key=mx.random.key(10 + i))
        assert mx.array_equal(cpufast.rms_norm(x, w, eps), mx.fast.rms_norm(x, w, eps)).item()


def test_installed_modules_take_the_fast_path_only_inside_active():
    model = nn.Sequential(nn.RMSNorm(64), nn.RoPE(64, base=100000.0), nn.RoPE(64, traditional=True))
    assert cpufast.install(model) == 3
    norm, rope, trad = model.layers
    assert isinstance(norm, cpufast.FastRMSNorm) and isinstance(rope, cpufast.FastRoPE)
    x = mx.random.normal((1, 2, 5, 64), key=mx.random.key(1))
    outside = rope(x, offset=9)  # mlx-lm's own decoding: MLX's op, no tables
    assert cpufast._TABLES is None
    with cpufast.active():
        inside = rope(x, offset=9)
        assert (5, 9, 64, 100000.0, 1.0) in cpufast._TABLES  # shared by every layer of a forward
        rope(x[:, :1], offset=9)  # another head count, the same positions: the same tables
        assert len(cpufast._TABLES) == 1
        assert mx.array_equal(trad(x, offset=3), mx.fast.rope(x, 64, traditional=True, base=10000.0,
                                                              scale=1.0, offset=3)).item()
        half = rope(x.astype(mx.float16), offset=2)  # other dtypes go to MLX as before
        assert half.dtype == mx.float16
    assert cpufast._TABLES is None
    assert mx.array_equal(inside, outside).item()
    assert mx.array_equal(norm(x), mx.fast.rms_norm(x, norm.weight, norm.eps)).item()
    cpufast.ON = False  # scripts/arms_ab.py's fast=0 arm
    try:
        with cpufast.active():
            assert cpufast._TABLES is None
    finally:
        cpufast.ON = True


def test_switched_off_by_env_and_bad_values_say_so(monkeypatch):
    monkeypatch.setenv(cpufast.ENV, "0")
    assert cpufast.install(nn.RMSNorm(8)) == 0
    monkeypatch.setenv(cpufast.ENV, "yes")
    with pytest.raises(ValueError, match="DFLASH_CPU_FAST must be 0 or 1"):
        cpufast.enabled()


def test_a_targets_forward_is_unchanged_bit_for_bit(pairs):
    """The target's own forward with the fast ops: a plain step gives the logits mlx-lm's model
    gives, and a verify's block what it gives without them (its attention is the engine's own,
    cpuattn.py), bit for bit, for every family that uses plain RoPE / RMSNorm."""
    from dflash.engine.tiny import ARCH_CONFIGS

    def logits(target, block, fast=True, ours=True):
        """Fresh caches holding a prompt (mlx-lm's), then `block` through our forward or mlx-lm's model."""
        cpufast.ON = fast
        try:
            caches = target.make_cache()
            prompt = mx.array([[3, 9, 27, 81, 5, 15, 45, 7, 21, 63, 11]])
            mx.eval(target.model(prompt, cache=caches))  # the same cache state for every arm
            out = target.forward(block, caches)[0] if ours else target.model(block, cache=caches)
            mx.eval(out)
        finally:
            cpufast.ON = True
        return out

    checked = 0
    for arch in ARCH_CONFIGS:
        target = pairs(arch).target
        if not target.cpu_fast:
            continue
        checked += 1
        step = mx.array([[4]])
        assert mx.array_equal(logits(target, step), logits(target, step, ours=False)).item(), arch
        block = mx.array([[4, 8, 15, 16, 23, 42]])
        assert mx.array_equal(logits(target, block), logits(target, block, fast=False)).item(), arch
    assert checked >= 4


def test_it_stays_off_when_this_mlx_gives_other_bits(monkeypatch):
    """A future MLX with a CPU RoPE kernel of its own may round differently: then our path must
    not run (a plain step would stop equalling mlx-lm's), and the user is told why."""
    assert cpufast.agrees_with_mlx()  # the MLX this project runs on
    real = mx.fast.rope
    monkeypatch.setattr(cpufast, "_AGREES", None)
    monkeypatch.setattr(mx.fast, "rope", lambda x, *a, **k: real(x, *a, **k) * 1.0000001 + 1e-6)
    with pytest.warns(RuntimeWarning, match="fast path stays off"):
        assert cpufast.install(nn.RMSNorm(8)) == 0
    monkeypatch.setattr(mx.fast, "rope", real)
    monkeypatch.setattr(cpufast, "_AGREES", None)
    assert cpufast.install(nn.RMSNorm(8)) == 1
