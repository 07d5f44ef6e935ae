"""engine/fuse.py: q/k/v and gate/up as one product each, with the same bits and the same ids."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from dflash.engine import fuse
from dflash.engine.loading import load_pair
from helpers import greedy_reference, run_dflash

PROMPT = mx.array([[3, 9, 27, 81, 5, 15, 45, 7, 21, 63, 11]])
BLOCK = mx.array([[4, 8, 15, 16, 23, 42, 7, 1, 2, 3, 5, 8, 13, 21, 34, 55]])


def _load(tiny_dirs, arch: str, monkeypatch, fused: bool):
    monkeypatch.setenv(fuse.ENV, "1" if fused else "0")
    return load_pair(tiny_dirs[arch], tiny_dirs[arch] / "draft")


def _verify_logits(target) -> mx.array:
    """A 16-token block through the target's own forward, after a prompt in mlx-lm's caches."""
    caches = target.make_cache()
    mx.eval(target.model(PROMPT, cache=caches))
    out = target.forward(BLOCK, caches)[0]
    mx.eval(out)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text", "qwen3_5"])
def test_fused_forward_is_bit_for_bit_and_mlx_lm_is_untouched(tiny_dirs, monkeypatch, arch):
    plain = _load(tiny_dirs, arch, monkeypatch, fused=False).target
    fused = _load(tiny_dirs, arch, monkeypatch, fused=True).target
    assert plain.fused == 0 and fused.fused > 0
    # the stacked weights replace the members' own: the model holds the same parameters
    sizes = lambda t: sorted((k, v.shape) for k, v in tree_flatten(t.model.parameters()))
    assert sizes(fused) == sizes(plain)
    assert mx.array_equal(_verify_logits(fused), _verify_logits(plain)).item()
    # mlx-lm decoding the same object (outside our forwards) runs the members alone
    caches_a, caches_b = plain.make_cache(), fused.make_cache()
    a, b = plain.model(PROMPT, cache=caches_a), fused.model(PROMPT, cache=caches_b)
    assert mx.array_equal(a, b).item()
    fuse.ON = False  # scripts/arms_ab.py's fuse=0 arm: inside our forwards, members alone too
    try:
        assert mx.array_equal(_verify_logits(fused), _verify_logits(plain)).item()
    finally:
        fuse.ON = True


def test_groups_fused_per_family(tiny_dirs, monkeypatch):
    """Every layer's q/k/v and, where the MLP is dense, its gate/up; MoE experts are left alone."""
    layers = {"llama": 4, "qwen3": 4}
    for arch, n in layers.items():
        assert _load(tiny_dirs, arch, monkeypatch, fused=True).target.fused == 2 * n
    moe = _load(tiny_dirs, "qwen3_moe", monkeypatch, fused=True).target
    assert moe.fused == 4  # attention only: the experts' SwitchGLU is not nn.Linear


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text", "qwen3_moe", "qwen3_5"])
def test_dflash_ids_equal_mlx_lm_greedy_with_fused_products(tiny_dirs, monkeypatch, arch):
    pair = _load(tiny_dirs, arch, monkeypatch, fused=True)
    ids = pair.tokenizer.encode("def fibonacci(n): a, b = 0, 1 while")
    want = greedy_reference(pair.target.model, ids, 40)
    for window in ("full", "auto"):
        final, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 40,
                              verify_window=window)
        assert final.token_ids[:40] == want[: len(final.token_ids)], (arch, window)


def test_shared_product_parts_and_release():
    lins = [nn.Linear(8, n, bias=True) for n in (8, 4, 4)]
    parent = nn.Module()
    parent.q_proj, parent.k_proj, parent.v_proj = lins
    x = mx.random.normal((2, 3, 8), key=mx.random.key(0))
    want = [m(x) for m in lins]
    assert fuse.install(parent, force=True) == 1
    parent.k_proj.weight = parent.k_proj.weight * 2  # trained since (training runs no fused call)
    want[1] = parent.k_proj(x)
    assert fuse.install(parent, force=True) == 1  # stacked again from the weights as they are
    shared = lins[0].__dict__["_dflash_shared"]
    with fuse.active():
        got = [parent.v_proj(x), parent.q_proj(x), parent.k_proj(x)]  # any order
        assert shared.input is None  # every part taken: nothing held after the forward
        again = parent.k_proj(x)  # a member called twice on one input computes it again
    assert all(mx.array_equal(g, w).item() for g, w in zip(got, [want[2], want[0], want[1]]))
    assert mx.array_equal(again, want[1]).item()
    assert all(mx.array_equal(m(x), w).item() for m, w in zip(lins, want))  # outside: alone


def test_quantized_groups_fuse_and_mixed_groups_do_not():
    parent = nn.Module()
    parent.gate_proj, parent.up_proj = nn.Linear(64, 32, bias=False), nn.Linear(64, 32, bias=False)
    nn.quantize(parent, group_size=32, bits=4)
    x = mx.random.normal((1, 5, 64), key=mx.random.key(1))
    want = [parent.gate_proj(x), parent.up_proj(x)]
    assert fuse.install(parent, force=True) == 1
    with fuse.active():
        got = [parent.gate_proj(x), parent.up_proj(x)]
    assert all(mx.array_equal(g, w).item() for g, w in zip(got, want))
    mixed = nn.Module()
    mixed.gate_proj, mixed.up_proj = nn.Linear(64, 32), nn.Linear(64, 32, bias=False)
    assert fuse.install(mixed, force=True) == 0
    other = nn.Module()
    other.gate_proj, other.up_proj = nn.Linear(64, 32), nn.Linear(32, 32)
    assert fuse.install(other, force=True) == 0


def test_env_switch(monkeypatch):
    monkeypatch.setenv(fuse.ENV, "0")
    assert fuse.install(nn.Linear(2, 2)) == 0 and not fuse.enabled()
    monkeypatch.setenv(fuse.ENV, "1")
    assert fuse.enabled()
    monkeypatch.setenv(fuse.ENV, "auto")
    assert fuse.enabled() == (mx.default_device() == mx.gpu)
    monkeypatch.setenv(fuse.ENV, "yes")
    with pytest.raises(ValueError, match="DFLASH_FUSE='yes'"):
        fuse.enabled()


def test_drafts_context_rows_through_one_product_fill_the_same_caches(tiny_dirs, monkeypatch):
    plain = _load(tiny_dirs, "qwen3", monkeypatch, fused=False)
    fused = _load(tiny_dirs, "qwen3", monkeypatch, fused=True)
    assert plain.drafter.context_kv is None and fused.drafter.context_kv is not None
    feats = mx.random.normal((1, 7, plain.drafter.draft.fc.weight.shape[1]), key=mx.random.key(3))
    for pair in (plain, fused):
        pair.drafter.reset()
        pair.drafter.add_context(feats)
    for a, b in zip(plain.drafter.cache, fused.drafter.cache):
        assert a.offset == b.offset == 7
        assert all(mx.array_equal(x, y).item() for x, y in zip(a.state, b.state))
    anchor = mx.array(5)
    assert mx.array_equal(plain.drafter.propose(anchor, 7), fused.drafter.propose(anchor, 7)).item()


def test_the_workers_status_line_says_products_are_fused(tiny_dirs, monkeypatch):
    from dflash.daemon.worker import _pair_notes

    for name in ("DFLASH_CPU_FAST", "DFLASH_PAD_ROWS"):
        monkeypatch.setenv(name, "0")
    assert _pair_notes(_load(tiny_dirs, "qwen3", monkeypatch, fused=True)) == \
        "; q/k/v and gate/up as one product each"
    assert _pair_notes(_load(tiny_dirs, "qwen3", monkeypatch, fused=False)) == ""
