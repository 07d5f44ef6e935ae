"""Per-cache-kind rollback: GDN tape replay, sliding windows past the wrap, quantized KV."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import RotatingKVCache

from dflash.engine import rollback, tape
from dflash.engine.drafters import OracleDrafter
from helpers import cut_at_eos, greedy_reference, run_dflash

PROMPT = "Once upon a time there was a small town by the sea where fishermen mended nets."


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("n_keep", [1, 4, 9, 16])
def test_tape_replay_equals_feeding_only_accepted(pairs, arch, n_keep):
    """State after replaying n_keep taped steps == state after feeding just those tokens.

    Tolerance: the block is projected as a [16, D] matmul in one case and [n_keep, D] in the
    other, so fp32 rounding may differ in the last bits; we require max |diff| < 1e-5.
    """
    pair = pairs(arch)
    target = pair.target
    ids = pair.tokenizer.encode(PROMPT)
    block = mx.array(greedy_reference(target.model, ids, 16), dtype=mx.int32)[None]

    a = target.make_cache()
    target.forward(mx.array(ids)[None], a)
    tp = tape.Tape()
    with tape.recording(tp):
        target.forward(block, a)
    rollback.rewind(a, target.layers, n_keep, 16, tp)

    b = target.make_cache()
    target.forward(mx.array(ids)[None], b)
    target.forward(block[:, :n_keep], b)

    n_gdn = 0
    for ca, cb in zip(a, b):
        if rollback.cache_kind(ca) == "gdn":
            n_gdn += 1
            assert mx.abs(ca[0] - cb[0]).max().item() < 1e-5  # conv state
            assert mx.abs(ca[1] - cb[1]).max().item() < 1e-5  # recurrent state
        else:
            assert ca.offset == cb.offset == len(ids) + n_keep
    assert n_gdn >= 2


def test_rotating_window_wraps_and_stays_lossless(pairs):
    """Window 24 is far smaller than prompt + output: rollback must survive the wrap."""
    pair = pairs("gemma3_text")
    ids = pair.tokenizer.encode(PROMPT)
    n_new = 96
    window = pair.target.args.sliding_window
    assert len(ids) + n_new > 3 * window
    caches = pair.target.make_cache()
    assert any(isinstance(c, RotatingKVCache) for c in caches)
    ref = cut_at_eos(greedy_reference(pair.target.model, ids, n_new), set(pair.tokenizer.eos_token_ids))
    final, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, n_new)
    assert final.token_ids == ref
    # partial acceptance across the wrap, too
    oracle = OracleDrafter(ref + [0] * 16, len(ids), 16, corrupt_at=[6], vocab_size=pair.target.vocab_size)
    final, _ = run_dflash(pair.target, oracle, pair.tokenizer, ids, len(ref))
    assert final.token_ids == ref


def test_rotating_rewind_is_a_slice():
    c = RotatingKVCache(max_size=8)
    k = mx.arange(20, dtype=mx.float32).reshape(1, 1, 20, 1)
    c.update_and_fetch(k[:, :, :12], k[:, :, :12])
    c.update_and_fetch(k[:, :, 12:16], k[:, :, 12:16])  # a 4-token "verify" past the wrap
    rollback.rewind([c], [None], n_keep=1, block_len=4, tape=None)
    assert c.offset == 13
    keys, _ = c.keys_and_values() if c.offset < c.keys.shape[2] else (c.keys, c.values)
    assert keys[0, 0, -1, 0].item() == 12.0  # last kept token is the anchor
    c.update_and_fetch(k[:, :, 13:15], k[:, :, 13:15])
    assert c.offset == 15 and c.keys[0, 0, -1, 0].item() == 14.0


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_quantized_kv_matches_mlx_lm(pairs, arch):
    pair = pairs(arch)
    ids = pair.tokenizer.encode(PROMPT)
    ref = greedy_reference(
        pair.target.model, ids, 64, kv_bits=8, kv_group_size=64, quantized_kv_start=0
    )
    ref = cut_at_eos(ref, set(pair.tokenizer.eos_token_ids))
    final, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 64, kv_bits=8)
    assert final.token_ids == ref


def test_unsupported_cache_is_refused():
    class Odd:
        pass

    with pytest.raises(rollback.UnsupportedCacheError, match="Odd"):
        rollback.check_supported([Odd()], [None])
