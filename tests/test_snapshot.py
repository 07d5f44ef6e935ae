"""Snapshots: the checked byte format, and exact capture/restore of every cache kind.

Proves: the envelope rejects truncated, altered, foreign and future-version bytes; arrays of
every dtype (bfloat16 included) survive the byte form bit for bit; for every architecture
family a snapshot taken mid-prompt (past the sliding window, so Gemma's rotating cache has
wrapped) restores caches and draft context that compute bit-identical logits for the rest of
the prompt; quantized KV caches round-trip too.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from conftest import ARCHS
from dflash.cache import snapshot
from dflash.engine import prefix, rollback

PROMPT = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen jugs. " * 2


def test_envelope_detects_damage():
    data = snapshot.encode({"n_tokens": 3, "x": b"\x01" * 1000})
    assert snapshot.verify(data) == ""
    assert snapshot.decode(data)["x"] == b"\x01" * 1000
    bad = {
        "truncated": data[:-1],
        "short header": data[:10],
        "extended": data + b"\x00",
        "flipped": data[:-5] + bytes([data[-5] ^ 1]) + data[-4:],
        "magic": b"XXXX" + data[4:],
        "version": data[:4] + (snapshot.FORMAT_VERSION + 1).to_bytes(2, "little") + data[6:],
    }
    for name, b in bad.items():
        assert snapshot.verify(b), name
        with pytest.raises(snapshot.CorruptSnapshot):
            snapshot.decode(b)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16, mx.int32, mx.uint32,
                                   mx.bool_])
def test_array_records_are_bit_exact(dtype):
    a = (mx.random.normal((2, 3, 5)) * 100).astype(dtype)
    b = prefix._from_record(prefix._to_record(a))
    assert b.dtype == a.dtype and b.shape == a.shape
    if dtype == mx.bfloat16:
        a, b = a.view(mx.uint16), b.view(mx.uint16)
    assert mx.array_equal(a, b).item()
    with pytest.raises(snapshot.CorruptSnapshot):  # byte count must match dtype x shape
        prefix._from_record(dict(prefix._to_record(a), shape=[2, 3, 6]))


def _prefill(pair, caches, ids):
    logits, feats = pair.target.forward(mx.array(ids, dtype=mx.int32)[None], caches)
    pair.drafter.add_context(feats)
    mx.eval(logits, [c.state for c in caches])
    return logits


def _same_state(a: prefix.Snapshot, b: prefix.Snapshot) -> None:
    assert a.n_tokens == b.n_tokens
    for x, y in zip(a._arrays(), b._arrays()):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert mx.array_equal(x, y).item()


@pytest.mark.parametrize("arch", ARCHS)
def test_restore_is_exact_for_every_cache_kind(pairs, arch):
    pair = pairs(arch)
    ids = pair.tokenizer.encode(PROMPT)
    cut = 32  # past the tiny Gemma's 24-token window
    assert len(ids) > cut + 8

    caches = pair.target.make_cache()
    pair.drafter.reset()
    logits = _prefill(pair, caches, ids[:cut])
    snap = prefix.take(caches, pair.drafter, logits, cut)
    if arch == "gemma3_text":
        assert any(rollback.cache_kind(c) == "rotating" for c in caches)
    rest_cold = _prefill(pair, caches, ids[cut:])  # the uninterrupted run
    draft_cold = [c.keys_and_values() for c in pair.drafter.cache]

    decoded = prefix.Snapshot.decode(snap.encode())
    _same_state(snap, decoded)
    fresh = pair.target.make_cache()
    pair.drafter.reset()
    first = prefix.restore(decoded, fresh, pair.drafter)
    assert mx.array_equal(first, logits[:, -1:]).item()
    _same_state(prefix.take(fresh, pair.drafter, first, cut), snap)
    rest_hot = _prefill(pair, fresh, ids[cut:])
    assert mx.array_equal(rest_hot, rest_cold).item()
    for (k1, v1), (k2, v2) in zip(draft_cold, [c.keys_and_values() for c in pair.drafter.cache]):
        assert mx.array_equal(k1, k2).item() and mx.array_equal(v1, v2).item()
    # the snapshot itself was not changed by the restored run
    _same_state(snap, decoded)


def test_quantized_kv_round_trip(pairs):
    pair = pairs("qwen3")
    ids = pair.tokenizer.encode(PROMPT)[:40]
    caches = pair.target.make_cache()
    pair.drafter.reset()
    logits = _prefill(pair, caches, ids)
    rollback.quantize_kv(caches, 8)
    assert all(rollback.cache_kind(c) == "quantized" for c in caches)
    snap = prefix.take(caches, pair.drafter, logits, len(ids))
    fresh = pair.target.make_cache()
    rollback.quantize_kv(fresh, 8)
    with pytest.raises(prefix.SnapshotMismatch):  # a quantized snapshot never fills KVCaches
        prefix.check_fits(snap, pair.target.make_cache(), pair.drafter)
    pair.drafter.reset()
    prefix.restore(prefix.Snapshot.decode(snap.encode()), fresh, pair.drafter)
    nxt = mx.array(pair.tokenizer.encode(" more"), dtype=mx.int32)[None]
    a, _ = pair.target.forward(nxt, caches)
    b, _ = pair.target.forward(nxt, fresh)
    assert mx.array_equal(a, b).item()
