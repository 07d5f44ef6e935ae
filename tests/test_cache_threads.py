"""The prefix cache's counters and write outcomes across its threads: real tiny MLX snapshots, a
real cache process on a real diskcache store, real threads.

Proves:
- the counters change on the engine and writer threads and are read on the socket thread
  (daemon/caching.py cache_stats): under one lock, every stats() is one consistent set (each
  lookup counted with its outcome; L1 bytes those of its entries) and the final counts are exact,
  equal to what the cache process counted on its side;
- a snapshot evicted from L1 while its L2 write is in flight, whose store then fails (a full
  disk: the cache process may not write files past 1 MiB), is counted as lost (`l2_lost_writes`,
  in the daemon's cache map too) and never looks stored.
"""

from __future__ import annotations

import resource
import signal
import threading

import pytest

from dflash.cache.tiers import Identity, PrefixCache
from dflash.daemon.caching import cache_stats
from dflash.daemon.config import DaemonConfig
from dflash.engine.prefix import Snapshot
from helpers import run_dflash
from test_l2 import cache_proc  # noqa: F401  (fixture)

WHOLE = 10**6  # `every`: only whole-prompt snapshots


def _ident() -> Identity:
    return Identity("target", "draft", (1,))


def _snapshot(pair, n: int, first: int = 5) -> Snapshot:
    """A real snapshot of the tiny qwen3 pair after an n-token prompt."""
    probe = PrefixCache(_ident(), Snapshot.decode, None, every=WHOLE)
    ids = [first + i % 200 for i in range(n)]
    run_dflash(pair.target, pair.drafter, pair.tokenizer, ids, 1, prefix_cache=probe)
    (entry,) = probe.l1._entries.values()
    assert entry.n_tokens == n
    return entry.value


def _consistent(st: dict, nbytes: int) -> str:
    """'' when one stats() map agrees with itself, else what disagrees."""
    hits = st["l1"]["hits"] + st["l2"]["hits"]
    if st["lookups"] != st["misses"] + hits:
        return f"lookups {st['lookups']} != misses {st['misses']} + hits {hits}"
    if st["l1"]["bytes"] != st["l1"]["entries"] * nbytes:
        return f"L1 bytes {st['l1']['bytes']} are not those of its {st['l1']['entries']} entries"
    return ""


def test_counters_stay_exact_and_consistent_under_threads(pairs, cache_proc, tmp_path):  # noqa: F811
    pair = pairs("qwen3")
    snap = _snapshot(pair, 24)
    proc = cache_proc()
    client = proc.client(timeout_s=30.0)
    pc = PrefixCache(_ident(), Snapshot.decode, client, l1_max_entries=4, every=WHOLE, max_pending_writes=1000)
    cfg = DaemonConfig(model=str(pair.model_path), draft=str(pair.draft_path), cache_endpoint=proc.endpoint,
                       runtime_dir=str(tmp_path / "run"), state_dir=str(tmp_path / "state"))
    engines, rounds = 3, 30
    done = threading.Event()
    problems: list[str] = []

    def engine(t: int) -> None:  # inserts and lookups: hits in L1, in L2 after eviction, misses
        try:
            for i in range(rounds):
                ids = [t + 1, i + 1] + [7] * (snap.n_tokens - 2)
                pc.insert(ids, snap)
                pc.lookup(ids)
                pc.lookup([t + 1, i + 1] + [8] * (snap.n_tokens - 2))  # never stored: a miss
                pc.lookup([t + 1, max(i - 2, 0) + 1] + [7] * (snap.n_tokens - 2))  # older: L1 or L2
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            problems.append(f"engine {t}: {e!r}")

    def reader() -> None:  # the socket thread's view, over and over while the others count
        while not done.is_set() and len(problems) < 20:
            st = pc.stats()
            if why := _consistent(st, snap.nbytes):
                problems.append(why)
            daemon = cache_stats(cfg, pc, None)
            if daemon["lookups"] != daemon["misses"] + daemon["hits"]:
                problems.append(f"daemon cache map: {daemon}")

    readers = [threading.Thread(target=reader) for _ in range(2)]
    workers = [threading.Thread(target=engine, args=(t,)) for t in range(engines)]
    for th in readers + workers:
        th.start()
    for th in workers:
        th.join()
    assert pc.flush()
    done.set()
    for th in readers:
        th.join()
    assert problems == []

    st, remote = pc.stats(), client.stats()
    # the lookups' client and the writer's own (CacheClient.twin), together
    lookups, writes = client.counts(), pc._writer.l2.counts()
    counts = {k: lookups[k] + writes[k] for k in lookups}
    assert writes["requests"] == remote["puts"] + 1  # and the flush's ping behind them
    assert st["inserts"] == engines * rounds
    assert st["lookups"] == 3 * engines * rounds
    assert st["misses"] >= engines * rounds  # every never-stored prompt
    assert st["l2"]["hits"] > 0 and st["l1"]["hits"] > 0
    assert st["lookups"] == st["misses"] + st["l1"]["hits"] + st["l2"]["hits"]
    assert _consistent(st, snap.nbytes) == ""
    # every L1 put (an insert, or an L2 hit brought back) either stays or was evicted once
    assert st["l1"]["evictions"] == st["inserts"] + st["l2"]["hits"] - st["l1"]["entries"]
    # what the worker counted is what the cache process counted
    assert st["l2_writes"] == remote["puts"] and st["l2_dropped_writes"] == 0
    assert st["l2"]["hits"] == remote["hits"] and st["misses"] == remote["misses"]
    # the clients' own counters: one request per get and put, the flush's ping on each client,
    # the stats above
    assert counts["requests"] == remote["hits"] + remote["misses"] + remote["puts"] + 3
    assert counts["timeouts"] == counts["unavailable"] == counts["errors"] == counts["dropped_puts"] == 0


def test_write_in_flight_when_evicted_then_failing_is_counted_lost(pairs, cache_proc, tmp_path):  # noqa: F811
    def small_files():  # the cache process sees "file too large" (EFBIG) past 1 MiB, like a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    pair = pairs("qwen3")
    big, small = _snapshot(pair, 640), _snapshot(pair, 16, first=9)
    assert big.nbytes > 1 << 20 > small.nbytes
    proc = cache_proc(preexec_fn=small_files)
    pc = PrefixCache(_ident(), Snapshot.decode, proc.client(timeout_s=30.0), l1_max_entries=1, every=WHOLE)
    assert pc.flush()  # connected: a write now waits for its reply, not for a connection
    big_ids, small_ids = [5 + i % 200 for i in range(640)], [9 + i for i in range(16)]

    proc.proc.send_signal(signal.SIGSTOP)  # the big write stays in flight until SIGCONT
    try:
        pc.insert(big_ids, big)
        pc.insert(small_ids, small)  # L1 holds one entry: the big one is evicted, its write pending
        assert pc._keys(big_ids, [640])[0] not in pc.l1
    finally:
        proc.proc.send_signal(signal.SIGCONT)
    assert pc.flush()  # the big write failed (write_failed), the small one landed

    st = pc.stats()
    assert proc.client().stats()["write_errors"] == 1
    assert st["l2_writes"] == 1 and st["l2_dropped_writes"] == 1
    assert st["l2_lost_writes"] == 1  # in neither tier, and said so
    assert pc.lookup(big_ids) is None  # truly gone: not in L1, not in L2
    daemon = cache_stats(DaemonConfig(model=str(pair.model_path), draft=str(pair.draft_path),
                                      cache_endpoint=proc.endpoint, runtime_dir=str(tmp_path / "run"),
                                      state_dir=str(tmp_path / "state")), pc, None)
    assert daemon["l2_lost_writes"] == 1 and daemon["l2_dropped_writes"] == 1
    # nothing claims to be stored that is not: the small entry is in L2 as L1 says
    (entry,) = pc.l1._entries.values()
    assert entry.in_l2 and not entry.pending
    assert pc.l2.get_first([pc._keys(small_ids, [16])[0]]) is not None


@pytest.mark.parametrize("in_flight", [True, False])
def test_a_failed_write_counts_lost_once_whenever_the_eviction_comes(pairs, cache_proc, in_flight):  # noqa: F811
    """Evicted while its write is in flight, or after that write already failed (then it is sent
    again on eviction and fails again): one lost snapshot either way, never two, never none."""
    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    pair = pairs("qwen3")
    big, small = _snapshot(pair, 640), _snapshot(pair, 16, first=9)
    proc = cache_proc(preexec_fn=small_files)
    pc = PrefixCache(_ident(), Snapshot.decode, proc.client(timeout_s=30.0), l1_max_entries=1, every=WHOLE)
    assert pc.flush()
    if in_flight:
        proc.proc.send_signal(signal.SIGSTOP)
    try:
        pc.insert([5 + i % 200 for i in range(640)], big)
        if not in_flight:
            assert pc.flush()  # the big write has failed while L1 still holds the entry: not lost
            assert pc.stats()["l2_dropped_writes"] == 1 and pc.stats()["l2_lost_writes"] == 0
        pc.insert([9 + i for i in range(16)], small)
    finally:
        proc.proc.send_signal(signal.SIGCONT)
    assert pc.flush()
    st = pc.stats()
    assert st["l2_lost_writes"] == 1
    assert st["l2_dropped_writes"] == (1 if in_flight else 2)
