"""The two tiers agree with each other: real tiny MLX snapshots, a real cache process on a real
diskcache store, real threads.

Proves:
- `discard` (a snapshot that does not fit the model) wins over a write of the same snapshot that
  is still queued or already on the wire: the entry does not come back into L2 after the discard
  deleted it, the engine thread never waits for the cache process to discard, and a snapshot
  inserted again under that key afterwards is stored;
- the cache process reports the keys its LRU evicted to make room for a write; L1 entries under
  them stop counting as in L2, so when L1 evicts them they are spilled to L2 instead of being
  lost from both tiers; a write whose reply never came clears every L1 entry's in-L2 mark;
- every L1 entry marked in L2 is in the store on disk.
"""

from __future__ import annotations

import signal
import sqlite3
import threading
import time

from dflash.cache import snapshot as fmt
from dflash.cache.tiers import PrefixCache
from dflash.daemon.caching import cache_stats
from dflash.daemon.config import DaemonConfig
from dflash.engine.prefix import Snapshot
from test_cache_threads import WHOLE, _ident, _snapshot
from test_l2 import blob, cache_proc, key  # noqa: F401  (fixture)

N = 96  # tokens of the snapshots here: ~0.2 MB each, stored as value files by diskcache


def _wait(cond, what: str, timeout: float = 30.0) -> None:
    """Until cond() holds (it is about another thread or process: no event to wait on)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def _ids(first: int) -> list[int]:
    return [first] + [7 + i % 100 for i in range(N - 1)]


def _l2_keys(proc) -> set[str]:
    """The keys the L2 store holds, read from its sqlite file (read-only: no access time moves)."""
    db = sqlite3.connect(f"file:{proc.directory / 'snapshots' / 'cache.db'}?mode=ro", uri=True)
    try:
        return {k for (k,) in db.execute("SELECT key FROM Cache")}
    finally:
        db.close()


def _marked_but_absent(pc: PrefixCache, proc) -> list[str]:
    """L1 entries that claim to be in L2 but are not in the store (must be none)."""
    stored = _l2_keys(proc)
    return [k for k, e in pc.l1._entries.items() if e.in_l2 and k not in stored]


# --- discard against a write of the same snapshot --------------------------------------------

def test_discard_wins_over_a_queued_write_of_the_same_snapshot(pairs, cache_proc):  # noqa: F811
    snap = _snapshot(pairs("qwen3"), N)
    proc = cache_proc()
    client = proc.client(timeout_s=30.0)
    pc = PrefixCache(_ident(), Snapshot.decode, client, l1_max_entries=8, every=WHOLE)
    assert pc.flush()  # connected
    a_ids, b_ids = _ids(1), _ids(2)
    kb = pc._keys(b_ids, [N])[0]
    writes = pc._writer.l2  # the writer's own client (CacheClient.twin)
    sent = writes.counts()["requests"]

    proc.proc.send_signal(signal.SIGSTOP)
    try:
        pc.insert(a_ids, snap)
        _wait(lambda: writes.counts()["requests"] == sent + 1, "A's write on the wire")
        pc.insert(b_ids, snap)  # its write waits behind A's, which awaits its reply
        engine = threading.Thread(target=pc.discard, args=(b_ids,))  # B did not fit: dropped
        engine.start()
        _wait(lambda: kb not in pc.l1, "the discard")
        # The writer records each outcome under this lock: with it held, A's reply lets nothing
        # more out of the writer, so anything the discard sends reaches the process before B.
        with pc._lock:
            proc.proc.send_signal(signal.SIGCONT)
            engine.join(60)
        assert not engine.is_alive()
    finally:
        proc.proc.send_signal(signal.SIGCONT)
    assert pc.flush()

    assert kb not in _l2_keys(proc)  # B did not come back after its discard
    assert pc.lookup(b_ids) is None
    st = pc.stats()
    assert st["mismatch_dropped"] == 1 and st["l2_discarded_writes"] == 1
    assert st["l2_writes"] == 1  # A's; B's was never sent
    assert proc.client().stats()["puts"] == 1

    pc.insert(b_ids, snap)  # a snapshot taken again under that key (the cold prefill's) is stored
    assert pc.flush()
    assert kb in _l2_keys(proc) and pc.l1.peek(kb).in_l2
    assert pc.stats()["l2_discarded_writes"] == 1


def test_discard_does_not_wait_for_a_write_in_flight_and_wins(pairs, cache_proc):  # noqa: F811
    snap = _snapshot(pairs("qwen3"), N)
    proc = cache_proc()
    client = proc.client(timeout_s=30.0)
    pc = PrefixCache(_ident(), Snapshot.decode, client, l1_max_entries=8, every=WHOLE)
    assert pc.flush()
    b_ids = _ids(2)
    kb = pc._keys(b_ids, [N])[0]
    writes = pc._writer.l2  # the writer's own client (CacheClient.twin)
    sent = writes.counts()["requests"]

    proc.proc.send_signal(signal.SIGSTOP)
    try:
        pc.insert(b_ids, snap)
        _wait(lambda: writes.counts()["requests"] == sent + 1, "B's write on the wire")
        engine = threading.Thread(target=pc.discard, args=(b_ids,))
        engine.start()
        engine.join(5)
        # the engine thread went on while the cache process, hung, had B's write unanswered
        assert not engine.is_alive()
        counts = client.counts()  # the lookups' client
        assert pc.lookup(b_ids) is None  # B is not asked of L2 while its delete is to come
        assert client.counts() == counts
    finally:
        proc.proc.send_signal(signal.SIGCONT)
    assert pc.flush()
    engine.join()

    assert kb not in _l2_keys(proc)  # landed, then deleted behind it
    assert pc.lookup(b_ids) is None
    st = pc.stats()
    assert st["l2_writes"] == 1 and st["l2_discarded_writes"] == 1 and st["mismatch_dropped"] == 1
    assert st["l1"]["entries"] == 0


# --- L2's own evictions ------------------------------------------------------------------------

def test_client_write_reports_what_l2_evicted(cache_proc):  # noqa: F811
    proc = cache_proc(size_limit=600_000)
    c = proc.client()
    w = c.write(key(1), blob(1, 200_000))
    assert w.stored and w.evicted == []
    assert c.write(key(2), blob(2, 200_000)) == type(w)(True, [])
    assert c.write(key(3), blob(3, 200_000)) == type(w)(True, [key(1)])  # the least recently used
    assert c.write(key(4), blob(4, 1 << 20)) == type(w)(False, [])  # too large: nothing evicted
    assert c.stats()["evictions"] == 1
    assert c.put(key(5), blob(5, 200_000), wait=True)  # put(wait=True) is still a bool
    c.close()


def test_an_entry_l2_evicted_is_spilled_when_l1_evicts_it(pairs, cache_proc):  # noqa: F811
    snap = _snapshot(pairs("qwen3"), N)
    probe = PrefixCache(_ident(), Snapshot.decode, None, every=WHOLE)
    size = len(fmt.encode(snap.body(), probe._keys(_ids(0), [N])[0]))
    assert size > 64 << 10
    empty = cache_proc()
    base = empty.client().stats()["bytes"]  # an empty store's sqlite pages
    empty.stop()
    proc = cache_proc(size_limit=base + 2 * size + size // 2)  # L2 holds two snapshots
    pc = PrefixCache(_ident(), Snapshot.decode, proc.client(timeout_s=30.0), l1_max_entries=3, every=WHOLE)
    a, b, c, d = (_ids(i) for i in (1, 2, 3, 4))
    ka = pc._keys(a, [N])[0]

    pc.insert(a, snap)
    assert pc.flush()
    pc.insert(b, snap)
    assert pc.flush()
    assert pc.lookup(a)[0] == N  # an L1 hit: L1's most recent, L2 never sees it
    pc.insert(c, snap)  # L2 evicts its least recently used, A, which L1 still holds
    assert pc.flush()
    assert ka not in _l2_keys(proc) and ka in pc.l1
    assert not pc.l1.peek(ka).in_l2  # no longer claims to be stored
    assert pc.stats()["l2_evicted_in_l1"] == 1
    assert _marked_but_absent(pc, proc) == []

    assert pc.lookup(b)[0] == N and pc.lookup(c)[0] == N  # A is now L1's least recently used
    pc.insert(d, snap)  # L1 evicts A: spilled to L2 (before, dropped: "already in L2")
    assert pc.flush()
    assert ka not in pc.l1 and ka in _l2_keys(proc)
    assert _marked_but_absent(pc, proc) == []

    found = pc.lookup(a)  # not lost: back from L2
    assert found is not None and found[0] == N
    assert pc.stats()["l2"]["hits"] == 1
    assert pc.flush()
    assert _marked_but_absent(pc, proc) == []
    st, remote = pc.stats(), proc.client().stats()
    assert st["l2_lost_writes"] == st["l2_dropped_writes"] == 0
    # every eviction in L2 so far hit an entry L1 held as stored: each one was reported
    assert remote["evictions"] == st["l2_evicted_in_l1"] == 4
    assert st["l2_writes"] == remote["puts"]
    # the daemon's stats reply (`dflash-client cache`) carries the new counters too
    daemon = cache_stats(DaemonConfig(model="m", cache_endpoint=proc.endpoint), pc, None)
    assert daemon["l2_evicted_in_l1"] == 4
    assert daemon["l2_discarded_writes"] == daemon["l2_unanswered_writes"] == 0


def test_a_write_left_unanswered_clears_every_in_l2_mark(pairs, cache_proc):  # noqa: F811
    snap = _snapshot(pairs("qwen3"), N)
    proc = cache_proc()
    pc = PrefixCache(_ident(), Snapshot.decode, proc.client(timeout_s=0.5, retry_after_s=0.05),
                     l1_max_entries=8, every=WHOLE)
    a, b = _ids(1), _ids(2)
    pc.insert(a, snap)
    assert pc.flush()
    assert pc.l1.peek(pc._keys(a, [N])[0]).in_l2

    proc.proc.send_signal(signal.SIGSTOP)  # hung: B's write is sent and never answered
    try:
        pc.insert(b, snap)
        assert pc.wait_writes(30)
    finally:
        proc.proc.send_signal(signal.SIGCONT)
    st = pc.stats()
    assert st["l2_unanswered_writes"] == 1 and st["l2_dropped_writes"] == 1
    # what that write evicted is unknown: no entry keeps claiming to be in L2
    assert st["l2_evicted_in_l1"] == 1
    assert not any(e.in_l2 for e in pc.l1._entries.values())
