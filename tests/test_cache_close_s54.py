"""PrefixCache.close(): the queued L2 writes land, then the writer thread ends and both clients'
sockets close; afterwards L1 still answers and nothing more is written to or asked of L2.

Real tiny MLX snapshots, a real cache process on a real diskcache store, real threads. Before,
a PrefixCache had no end: cache/bench.py made a fresh one per scenario and each left its writer
thread blocked on its queue and two sockets open for the rest of the process.
"""

from __future__ import annotations

import threading

from dflash.cache.l1 import L1Entry
from dflash.cache.tiers import PrefixCache
from dflash.engine.prefix import Snapshot
from test_cache_threads import WHOLE, _ident, _snapshot
from test_l2 import cache_proc  # noqa: F401  (fixture)


def _writers() -> int:
    return sum(t.name == "dflash-l2-writer" and t.is_alive() for t in threading.enumerate())


def test_close_lands_the_queued_writes_then_ends_the_writer_and_leaves_l1(pairs, cache_proc):  # noqa: F811
    pair = pairs("qwen3")
    snap = _snapshot(pair, 24)
    proc = cache_proc()
    before = _writers()
    pc = PrefixCache(_ident(), Snapshot.decode, proc.client(timeout_s=30.0), every=WHOLE, max_pending_writes=100)
    prompts = [[i + 1] + [7] * (snap.n_tokens - 1) for i in range(6)]
    for ids in prompts:
        pc.insert(ids, snap)  # write-behind: queued for the writer thread
    assert _writers() == before + 1
    assert pc.close(timeout=60) is True
    assert _writers() == before  # the thread ended
    st = pc.stats()
    assert st["l2_writes"] == 6 and st["l2_dropped_writes"] == 0, st  # every queued write landed
    assert pc.l2 is None and pc._writer.l2._sock is None  # both sockets closed
    # L1 still answers; a new insert is neither queued nor written, and lookups do not ask L2
    assert pc.lookup(prompts[0])[0] == snap.n_tokens
    pc.insert([99] + [7] * (snap.n_tokens - 1), snap)
    assert pc._writer.queue.qsize() == 0 and pc.stats()["l2_writes"] == 6
    assert pc.lookup([98] + [7] * (snap.n_tokens - 1)) is None
    # what it wrote is in L2 for whoever comes next (a restarted worker's fresh PrefixCache)
    fresh = PrefixCache(_ident(), Snapshot.decode, proc.client(timeout_s=30.0), every=WHOLE)
    try:
        for ids in prompts:
            n, _ = fresh.lookup(ids)
            assert n == snap.n_tokens
        assert fresh.stats()["l2"]["hits"] == 6
    finally:
        assert fresh.close() is True  # never started a writer: nothing to wait for


def test_close_before_any_write_and_twice_is_harmless(pairs, cache_proc):  # noqa: F811
    proc = cache_proc()
    pc = PrefixCache(_ident(), Snapshot.decode, proc.client(timeout_s=5.0), every=WHOLE)
    assert pc.close() is True and pc.close() is True
    assert pc.wait_writes(timeout=5) is True  # nothing left queued for a thread that never ran
    assert PrefixCache(_ident(), Snapshot.decode, None, every=WHOLE).close() is True  # no L2 at all


def test_a_write_and_a_delete_claimed_before_close_but_sent_after_are_not_left_queued(pairs, cache_proc):  # noqa: F811
    """The engine claims a write (or a discard's delete) under the lock and queues it after
    releasing it. A close() in between stops the writer thread: what comes after must not sit in
    the queue for ever (wait_writes would then never return, and the entry would stay pending)."""
    pair = pairs("qwen3")
    snap = _snapshot(pair, 24)
    proc = cache_proc()
    pc = PrefixCache(_ident(), Snapshot.decode, proc.client(timeout_s=30.0), every=WHOLE)
    pc.insert([1] + [7] * (snap.n_tokens - 1), snap)  # starts the writer thread
    assert pc.wait_writes(timeout=30)
    pc.insert([2] + [7] * (snap.n_tokens - 1), snap)
    assert pc.wait_writes(timeout=30)
    (entry,) = [e for e in pc.l1._entries.values() if not e.in_l2] or [None]
    assert entry is None  # both written
    late = next(iter(pc.l1._entries.values()))
    late.in_l2 = False  # as if it still had to be written
    with pc._lock:
        assert pc._writer.claim(late) and late.pending
        assert pc._writer.claim_delete("snap:late")
    assert pc.close(timeout=30) is True
    pc._writer.send("snap:x", late)
    pc._writer.send_delete("snap:late")
    assert pc._writer.queue.qsize() == 0 and pc.wait_writes(timeout=5) is True
    assert not late.pending and pc.stats()["l2_dropped_writes"] == 1  # counted, spilled again if evicted
    assert "snap:late" not in pc._writer.deleting


def test_a_write_claimed_before_the_first_thread_and_sent_after_close_starts_none(pairs, cache_proc):  # noqa: F811
    """No writer thread yet: a write claimed, then close() (nothing to stop), then sent. The send
    started a thread that nobody would end, and a second close() waited out its whole timeout."""
    pair = pairs("qwen3")
    snap = _snapshot(pair, 24)
    proc = cache_proc()
    pc = PrefixCache(_ident(), Snapshot.decode, proc.client(timeout_s=30.0), every=WHOLE)
    entry = L1Entry(snap.n_tokens, snap, snap.nbytes)
    before = _writers()
    with pc._lock:
        assert pc._writer.claim(entry)
    assert pc.close(timeout=5) is True
    pc._writer.send("snap:y", entry)
    assert _writers() == before and pc._writer.thread is None
    assert not entry.pending and pc.stats()["l2_dropped_writes"] == 1
    assert pc.close(timeout=0.5) is True
