"""The prefix cache under failures of its own: every case ends with cached output == uncached.

Proves, with real tiny MLX models, a real cache process and diskcache on disk:
- a write that never reached L2 (cache process down at that moment) is spilled when L1 evicts
  the entry later: only an acknowledged write counts as "in L2";
- snapshots larger than the whole L2 budget are not encoded and sent to be refused: the worker
  knows the budget (the daemon's `l2_cache_gb`);
- a snapshot whose arrays do not fit the loaded model (other KV head count, other dtype) under
  the same cache key is dropped (counted, from L1 and L2) and the prompt is prefilled cold;
- a checksum-valid but malformed snapshot (a state without its offset) is refused before any
  cache is touched: never half restored, then prefilled on top of the half.
"""

from __future__ import annotations

import time

import pytest

from dflash.cache import snapshot as fmt
from dflash.cache.tiers import Identity, PrefixCache
from dflash.engine.loading import load_pair
from dflash.engine.prefix import Snapshot
from dflash.engine.tiny import build_draft, build_target
from helpers import run_dflash
from test_l2 import cache_proc  # noqa: F401  (fixture)

PROMPT = "Question: what is the capital of France? Answer: Paris is the capital. " * 2
OTHER = [" Once upon a time there was a small town by the sea." * 2,
         " The quick brown fox jumps over the lazy dog, again and again." * 2]
N_NEW = 12
EVERY = 16


def _ident(tag: str = "") -> Identity:
    return Identity("target" + tag, "draft", (1,))


def _gen(pair, ids, cache=None):
    final, _ = run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, N_NEW, prefix_cache=cache)
    return final


def test_write_dropped_while_l2_down_is_spilled_on_eviction(pairs, cache_proc):  # noqa: F811
    pair = pairs("qwen3")
    proc = cache_proc()
    ids = pair.tokenizer.encode(PROMPT)
    plain = _gen(pair, ids)
    pc = PrefixCache(_ident(), Snapshot.decode, proc.client(), every=EVERY, l1_max_entries=3)

    proc.kill9()
    first = _gen(pair, ids, pc)  # its snapshots stay in L1; every write to L2 fails
    assert first.token_ids == plain.token_ids
    pc.wait_writes()
    assert pc.stats()["l2_writes"] == 0 and pc.stats()["l2_dropped_writes"] >= 1

    proc.start()  # back: the entries that missed L2 must reach it when L1 evicts them
    # pc's client rests after the failures, then ZeroMQ reconnects (backing off up to 1 s): a
    # spill sent before it is connected again fails and is lost, by design. Wait until it is.
    deadline = time.monotonic() + 15
    while not pc.l2.ping() and time.monotonic() < deadline:
        time.sleep(0.05)
    for text in OTHER:  # new prompts push the first prompt's snapshots out of L1
        _gen(pair, pair.tokenizer.encode(text), pc)
    assert pc.flush()
    assert pc._keys(ids, [len(ids)])[0] not in pc.l1  # evicted

    fresh = PrefixCache(_ident(), Snapshot.decode, proc.client(), every=EVERY)
    hit = _gen(pair, ids, fresh)
    assert hit.stats.cached_prompt_tokens == len(ids)  # found in L2: nothing was lost
    assert fresh.stats()["l2"]["hits"] == 1
    assert hit.token_ids == plain.token_ids


def test_snapshot_over_the_l2_budget_is_not_sent(pairs, cache_proc, tmp_path):  # noqa: F811
    from dflash.daemon.caching import build_prefix_cache
    from dflash.daemon.config import DaemonConfig

    pair = pairs("qwen3")
    ids = pair.tokenizer.encode(PROMPT)
    probe = PrefixCache(_ident(), Snapshot.decode, None, every=EVERY)
    _gen(pair, ids, probe)
    sizes = sorted(e.nbytes for e in probe.l1._entries.values())
    budget = (sizes[0] + sizes[-1]) // 2  # the small snapshots fit, the whole prompt's does not
    gb = budget / (1 << 30)
    proc = cache_proc(size_limit=int(gb * (1 << 30)))
    cfg = DaemonConfig(model=str(pair.model_path), draft=str(pair.draft_path), l2_cache_gb=gb,
                       cache_endpoint=proc.endpoint, cache_every=EVERY,
                       runtime_dir=str(tmp_path / "run"), state_dir=str(tmp_path / "state"))
    pc = build_prefix_cache(cfg, pair)
    plain = _gen(pair, ids)
    cold = _gen(pair, ids, pc)
    assert pc.flush()
    remote = proc.client().stats()
    assert remote["too_large"] == 0  # nothing was encoded and sent only to be refused
    assert remote["puts"] >= 1  # the snapshots within the budget were written
    assert pc.stats()["l2_too_large"] >= 1
    warm = _gen(pair, ids, pc)  # L1 still serves the one L2 could not take
    assert warm.stats.cached_prompt_tokens == len(ids)
    assert cold.token_ids == warm.token_ids == plain.token_ids


@pytest.fixture(scope="module")
def other_layouts(tmp_path_factory):
    """The tests' qwen3 target built with 2 KV heads instead of 1 (same layer count and kinds)."""
    d = tmp_path_factory.mktemp("heads")
    build_target(d, "qwen3", num_key_value_heads=2)
    build_draft(d / "draft", d)
    return load_pair(d, d / "draft")


def _mismatch_case(pair_a, pair_b, cache_proc):  # noqa: F811
    """Snapshots of pair_a under a key pair_b also uses: pair_b must prefill cold, losslessly."""
    proc = cache_proc()
    ids = pair_b.tokenizer.encode(PROMPT)
    assert ids == pair_a.tokenizer.encode(PROMPT)
    plain = _gen(pair_b, ids)
    pc = PrefixCache(_ident(), Snapshot.decode, proc.client(), every=EVERY)
    _gen(pair_a, ids, pc)
    assert pc.flush()

    l1 = _gen(pair_b, ids, pc)  # L1 holds pair_a's snapshot under this key
    assert l1.stats.cached_prompt_tokens == 0
    assert l1.token_ids == plain.token_ids
    assert pc.stats()["mismatch_dropped"] == 1
    # pc's discard (a delete) and pair_b's own snapshots go to L2 behind it on pc's writer: let
    # them land before pc2 writes pair_a's under the same keys, or they could land after
    assert pc.flush()

    pc2 = PrefixCache(_ident(), Snapshot.decode, proc.client(), every=EVERY)
    _gen(pair_a, ids, pc2)  # pair_a's snapshots again, in L2
    assert pc2.flush()
    fresh = PrefixCache(_ident(), Snapshot.decode, proc.client(), every=EVERY)
    l2 = _gen(pair_b, ids, fresh)
    assert l2.stats.cached_prompt_tokens == 0
    assert l2.token_ids == plain.token_ids
    assert fresh.stats()["mismatch_dropped"] == 1
    again = _gen(pair_b, ids, fresh)  # pair_b's own snapshots replaced the dropped ones
    assert again.stats.cached_prompt_tokens == len(ids)
    assert again.token_ids == plain.token_ids


def test_snapshot_of_other_kv_heads_is_dropped(pairs, other_layouts, cache_proc):  # noqa: F811
    _mismatch_case(pairs("qwen3"), other_layouts, cache_proc)


def test_snapshot_of_other_dtype_is_dropped(pairs, tiny_dirs, cache_proc):  # noqa: F811
    d = tiny_dirs["qwen3"]
    _mismatch_case(pairs("qwen3"), load_pair(d, d / "draft", dtype="bfloat16"), cache_proc)


def _run_over_planted(pair, ids, proc, key: str, body: dict):
    """Store `body` under `key` in the cache process, then generate `ids` with a fresh prefix
    cache over it: (the run's Finished, that cache)."""
    assert proc.client().put(key, fmt.encode(body, key), wait=True)
    fresh = PrefixCache(_ident(), Snapshot.decode, proc.client(), every=EVERY)
    return _gen(pair, ids, fresh), fresh


def test_malformed_snapshot_is_never_half_restored(pairs, cache_proc):  # noqa: F811
    pair = pairs("qwen3")
    proc = cache_proc()
    ids = pair.tokenizer.encode(PROMPT)
    plain = _gen(pair, ids)
    pc = PrefixCache(_ident(), Snapshot.decode, None, every=EVERY)
    _gen(pair, ids, pc)
    key = pc._keys(ids, [len(ids)])[0]
    body = pc.l1.get(key).value.body()
    del body["target"][-1]["offset"]  # intact bytes, but the last layer cannot be restored
    out, fresh = _run_over_planted(pair, ids, proc, key, body)
    assert out.stats.cached_prompt_tokens == 0
    assert out.token_ids == plain.token_ids
    assert fresh.stats()["mismatch_dropped"] == 1


def test_off_grid_lengths_remembered_are_bounded():
    """Each remembered off-grid prompt length is probed (hashed, sent to the cache process) on
    every lookup of a longer prompt: unbounded, a long-running worker's lookups kept growing."""
    import mlx.core as mx

    from dflash.cache import tiers

    def snap(n):
        kv = mx.zeros((1, 1, n, 1))
        return Snapshot(n, [{"kind": "kv", "keys": kv, "values": kv, "offset": n}], None,
                        mx.zeros((1, 1, 4)))

    pc = PrefixCache(_ident(), Snapshot.decode, None, every=1 << 20, l1_max_entries=4)
    for n in range(1, tiers.MAX_KNOWN_ENDS + 200):
        pc.insert([7] * n, snap(n))
    assert len(pc._candidates(1 << 19)) <= tiers.MAX_KNOWN_ENDS + 1
    n = tiers.MAX_KNOWN_ENDS + 199  # the most recent ones are still found
    assert pc.lookup([7] * n)[0] == n


def test_l2_entry_of_other_length_than_its_key_is_refused(pairs, cache_proc):  # noqa: F811
    """A checksum-valid entry under the whole prompt's key that holds another prompt's 16-token
    prefix (a writer bug): it claimed 16 tokens, so it was restored as this prompt's first 16."""
    pair = pairs("qwen3")
    proc = cache_proc()
    ids = pair.tokenizer.encode(PROMPT)
    other = pair.tokenizer.encode(OTHER[0])
    plain = _gen(pair, ids)
    pc = PrefixCache(_ident(), Snapshot.decode, None, every=EVERY)
    _gen(pair, other, pc)
    foreign = pc.l1.get(pc._keys(other, [EVERY])[0]).value.body()  # other[:16]
    key = pc._keys(ids, [len(ids)])[0]
    out, fresh = _run_over_planted(pair, ids, proc, key, foreign)
    assert out.stats.cached_prompt_tokens == 0
    assert out.token_ids == plain.token_ids
    assert fresh.stats()["corrupt_dropped"] == 1
