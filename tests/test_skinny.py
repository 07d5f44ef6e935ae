"""engine/skinny.py: which products go to the few-row kernel, and that nothing else changes.

The kernel itself runs on CUDA only (scripts/skinny_check.py checks it there against
`skinny.reference`); here, on the CPU, the routing is tested with `reference` standing in for
the kernel: a verify's and a draft pass's few-row products inside our forwards go to it,
mlx-lm's own forwards and one-row steps never do, and the logits match the plain products'.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from dflash.engine import fuse, skinny
from dflash.engine.loading import load_pair

PROMPT = mx.array([[3, 9, 27, 81, 5, 15, 45, 7, 21, 63, 11]])
BLOCK = mx.array([[4, 8, 15, 16, 23, 42, 7, 1, 2, 3, 5, 8, 13, 21, 34, 55]])


@pytest.fixture
def counted(monkeypatch):
    """skinny.matmul replaced by its reference maths, counting the rows of each call."""
    calls: list[int] = []

    def fake(x, w, bias=None):
        calls.append(x.reshape(-1, x.shape[-1]).shape[0])
        return skinny.reference(x, w, bias)

    monkeypatch.setattr(skinny, "matmul", fake)
    return calls


def _bf16_pair(tiny_dirs, monkeypatch, arch: str = "llama"):
    monkeypatch.setenv(fuse.ENV, "1")
    pair = load_pair(tiny_dirs[arch], tiny_dirs[arch] / "draft", dtype="bfloat16")
    return pair


def _verify_logits(target) -> mx.array:
    caches = target.make_cache()
    mx.eval(target.model(PROMPT, cache=caches))
    out = target.forward(BLOCK, caches)[0]
    mx.eval(out)
    return out.astype(mx.float32)


def test_off_on_a_cpu_and_the_switch_is_checked(monkeypatch):
    assert not skinny.enabled()  # this machine runs MLX on its CPU
    monkeypatch.setenv(skinny.ENV, "yes")
    with pytest.raises(ValueError, match="DFLASH_SKINNY"):
        skinny.enabled()
    monkeypatch.setenv(skinny.ENV, "0")
    assert not skinny.enabled()


def test_install_adopts_plain_products_and_each_fused_stack_once(tiny_dirs, monkeypatch):
    pair = _bf16_pair(tiny_dirs, monkeypatch)
    target = pair.target
    assert target.skinny == 0  # not on a CPU unless forced
    n_layers = len(target.layers)
    # per layer: the q/k/v stack, o_proj, the gate/up stack, down_proj; the LM head is too large
    # for MAX_WEIGHT only in real models, so count what is eligible here
    n = skinny.install(target.model, force=True)
    head = target.head_module
    head_counts = int(type(head) in skinny._CLASSES.values())
    assert n == 4 * n_layers + head_counts
    assert skinny.install(target.model, force=True) == n  # again: the same modules, once each


def test_eligibility():
    w = nn.Linear(64, 32, bias=False)
    assert not skinny.eligible(w)  # fp32
    w.set_dtype(mx.bfloat16)
    assert skinny.eligible(w)
    big = nn.Linear(4096, 1024, bias=False)
    big.set_dtype(mx.bfloat16)
    assert not skinny.eligible(big)  # over MAX_WEIGHT: cuBLAS keeps it
    q = nn.QuantizedLinear(64, 32, bias=False)
    assert not skinny.eligible(q)
    with pytest.raises(ValueError, match="rows"):
        skinny.matmul(mx.zeros((17, 64), dtype=mx.bfloat16), w.weight)


def test_routing_inside_our_forwards_only(tiny_dirs, monkeypatch, counted):
    pair = _bf16_pair(tiny_dirs, monkeypatch)
    target = pair.target
    plain = _verify_logits(target)
    assert skinny.install(target.model, force=True) > 0
    assert not counted
    # mlx-lm running the same object (the benchmark's baseline) never reaches the kernel
    mx.eval(target.model(PROMPT, cache=target.make_cache()))
    assert not counted
    routed = _verify_logits(target)
    assert counted and set(counted) == {16}  # the verify's 16-row products (the prefill: mlx-lm's)
    assert mx.allclose(routed, plain, atol=0.05, rtol=0.05).item()
    counted.clear()
    # a one-row step inside our forwards stays on MLX's gemv
    caches = target.make_cache()
    mx.eval(target.model(PROMPT, cache=caches))
    mx.eval(target.forward(BLOCK[:, :1], caches)[0])
    assert not counted
    # skinny=0 (scripts/arms_ab.py): our forwards on MLX's products again
    skinny.ON = False
    try:
        mx.eval(_verify_logits(target))
        assert not counted
    finally:
        skinny.ON = True


def test_draft_pass_products_and_the_context_stack(tiny_dirs, monkeypatch, counted):
    pair = _bf16_pair(tiny_dirs, monkeypatch)
    drafter = pair.drafter
    extra = (drafter.context_kv.stacked,) if drafter.context_kv else ()
    assert skinny.install(drafter.draft, extra=extra, force=True) > 0
    caches = pair.target.make_cache()
    _, feats = pair.target.forward(PROMPT, caches)
    drafter.add_context(feats[:, :5])
    assert counted and set(counted) == {5}  # fc and the stacked context K/V of 5 new rows
    counted.clear()
    ids = drafter.propose(mx.array(7), 5)
    mx.eval(ids)
    assert counted and set(counted) == {drafter.block_size}  # the block's rows
