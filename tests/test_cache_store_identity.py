"""L1's in-L2 marks follow the L2 store they were made in: real tiny MLX snapshots, a real cache
process on a real diskcache store, restarted, damaged, removed and cleared for real.

Proves:
- every L2 store has an id, kept in its sqlite file: the same across restarts (stop or kill -9) on
  the intact store, new when the store is created fresh (damaged and repaired, cache_dir removed
  while serving) or cleared; every reply of the cache process names it;
- when the worker sees another id, no L1 entry keeps claiming to be in L2 (`l2_store_changed`,
  one log line), so the entries that were in the old store are written to the new one when L1
  evicts them, and found there again. Before, they were dropped unspilled: lost from both tiers;
- a restart on the intact store keeps the marks: L1 evicts its entries without writing them again;
- a reply without the id (an older cache process) keeps working as before.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading

import msgpack
import pytest
import zmq

from dflash.cache.client import CacheClient
from dflash.cache.tiers import PrefixCache
from dflash.daemon.caching import cache_stats
from dflash.daemon.config import DaemonConfig
from dflash.engine.prefix import Snapshot
from test_cache_threads import WHOLE, _ident, _snapshot
from test_cache_tier_races import _l2_keys, _marked_but_absent, _wait
from test_l2 import cache_proc  # noqa: F401  (fixture)

# Tokens per snapshot: ~21 KB encoded, so diskcache keeps them in its sqlite rows, which a store
# overwritten with garbage cannot give back (value files name their key and are salvaged).
N = 8


def _ids(first: int) -> list[int]:
    return [first] + [7 + i for i in range(N - 1)]


def _store_id(proc) -> str | None:
    """The id the cache process's stats name (None: it names none, as before the ids)."""
    c = proc.client(timeout_s=30.0)
    st = c.stats()
    c.close()
    assert st is not None
    return st.get("store")


def _filled(pairs, proc) -> tuple[PrefixCache, Snapshot, list[list[int]]]:
    """A PrefixCache whose L1 (two entries) holds A and B, both acknowledged in L2 (marked)."""
    snap = _snapshot(pairs("qwen3"), N)
    pc = PrefixCache(_ident(), Snapshot.decode, proc.client(timeout_s=30.0), l1_max_entries=2, every=WHOLE)
    a, b, c, d = (_ids(i) for i in (1, 2, 3, 4))
    for ids in (a, b):
        pc.insert(ids, snap)
        assert pc.flush()
    assert all(e.in_l2 for e in pc.l1._entries.values()) and len(pc.l1) == 2
    assert {pc._keys(a, [N])[0], pc._keys(b, [N])[0]} <= _l2_keys(proc)
    return pc, snap, [a, b, c, d]


def _reconnected(pc: PrefixCache) -> None:
    """Until the client answers again (its first call after the restart may time out)."""
    _wait(pc.l2.ping, "the client to reach the restarted cache process")


def _evict_a_and_b(pc: PrefixCache, snap: Snapshot, c: list[int], d: list[int]) -> None:
    """Insert C and D: L1 (two entries) evicts A, then B."""
    for ids in (c, d):
        pc.insert(ids, snap)
        assert pc.flush()


@pytest.mark.parametrize("how", ["damaged", "removed"])
def test_a_fresh_store_clears_the_marks_and_evicted_entries_are_spilled(  # noqa: F811
        pairs, cache_proc, tmp_path, caplog, how):
    proc = cache_proc(stderr=open(tmp_path / "cache.log", "wb"))
    pc, snap, (a, b, c, d) = _filled(pairs, proc)
    ka, kb = pc._keys(a, [N])[0], pc._keys(b, [N])[0]
    old = _store_id(proc)

    if how == "damaged":  # found at the next start: moved aside, recreated, nothing salvageable
        proc.stop()
        (proc.directory / "snapshots" / "cache.db").write_bytes(b"this is not a database\n" * 200)
    else:  # `rm -rf cache_dir` while serving: the process exits 1 to be restarted on a fresh store
        shutil.rmtree(proc.directory)
        assert proc.proc.wait(10) == 1
    proc.start()
    new = _store_id(proc)
    if how == "damaged":
        probe = proc.client()
        assert [n["store"] for n in probe.stats()["recoveries"]] == ["snapshots"]
        probe.close()
    assert _l2_keys(proc) == set()  # A and B are in neither the new store nor anywhere L2 reads
    _reconnected(pc)

    with caplog.at_level(logging.WARNING, logger="dflash.cache"):
        assert pc.lookup(c) is None  # a miss, from the new store: its reply names it
    # no entry claims to be in a store that does not hold it (before: both did)
    assert not any(e.in_l2 for e in pc.l1._entries.values())
    assert _marked_but_absent(pc, proc) == []
    st = pc.stats()
    assert st["l2_store_changed"] == 1 and st["l2_evicted_in_l1"] == 2
    assert isinstance(old, str) and isinstance(new, str) and new != old
    [line] = [r.getMessage() for r in caplog.records if "L2 store changed" in r.getMessage()]
    assert old in line and new in line and "2 snapshot(s)" in line

    _evict_a_and_b(pc, snap, c, d)  # spilled (before: dropped as "already in L2", lost)
    assert ka not in pc.l1 and kb not in pc.l1
    assert {ka, kb} <= _l2_keys(proc)
    assert _marked_but_absent(pc, proc) == []
    pc.drop_l1()  # a restarted worker: both come back from L2
    assert pc.lookup(a)[0] == N and pc.lookup(b)[0] == N
    st = pc.stats()
    assert st["l2"]["hits"] == 2 and st["l2_lost_writes"] == st["l2_dropped_writes"] == 0
    assert st["l2_store_changed"] == 1  # once per change, whatever replies came after
    assert proc.proc.poll() is None


@pytest.mark.parametrize("restart", ["stop", "kill9"])
def test_a_restart_on_the_intact_store_keeps_the_marks(pairs, cache_proc, restart):  # noqa: F811
    proc = cache_proc()
    pc, snap, (a, b, c, d) = _filled(pairs, proc)
    old = _store_id(proc)

    proc.kill9() if restart == "kill9" else proc.stop()
    proc.start()
    _reconnected(pc)

    assert pc.lookup(c) is None
    assert all(e.in_l2 for e in pc.l1._entries.values())  # still true: the same store holds them
    _evict_a_and_b(pc, snap, c, d)
    # L1 evicted A and B without writing them again: the process stored only C and D since
    assert proc.client().stats()["puts"] == 2
    assert _marked_but_absent(pc, proc) == []
    st = pc.stats()
    assert st["l2_store_changed"] == 0 and st["l2_evicted_in_l1"] == 0 and st["l2_writes"] == 4
    pc.drop_l1()
    assert pc.lookup(a)[0] == N and pc.lookup(b)[0] == N
    assert isinstance(old, str) and _store_id(proc) == old  # kept in the store itself


def test_a_clear_of_l2_clears_the_marks(pairs, cache_proc):  # noqa: F811
    """L2's own `clear` (another client: a second worker, a script): the worker that kept its L1
    must not go on counting its entries as stored. (`dflash-client cache clear` empties the
    worker's L1 first, so it leaves no mark behind; the store's new id then clears none.)"""
    proc = cache_proc()
    pc, snap, (a, b, c, d) = _filled(pairs, proc)
    ka, kb = pc._keys(a, [N])[0], pc._keys(b, [N])[0]
    old = _store_id(proc)

    other = proc.client(timeout_s=30.0)
    assert other.clear()
    assert _l2_keys(proc) == set()
    other.close()

    assert pc.lookup(c) is None
    assert not any(e.in_l2 for e in pc.l1._entries.values())
    assert pc.stats()["l2_store_changed"] == 1
    _evict_a_and_b(pc, snap, c, d)
    assert {ka, kb} <= _l2_keys(proc)  # before: lost from both tiers
    pc.drop_l1()
    assert pc.lookup(a)[0] == N and pc.lookup(b)[0] == N
    assert isinstance(old, str) and _store_id(proc) != old

    # the new id is kept in the store too: a restart after the clear changes nothing more
    cleared = _store_id(proc)
    proc.stop()
    proc.start()
    assert _store_id(proc) == cleared


def test_the_write_that_sees_the_new_store_marks_its_own_entry(pairs, cache_proc):  # noqa: F811
    """The first reply from the new store may be a write's acknowledgement: the old marks go,
    the entry that write stored is marked (it is in the new store)."""
    proc = cache_proc()
    pc, snap, (a, b, c, d) = _filled(pairs, proc)
    proc.stop()
    shutil.rmtree(proc.directory)
    proc.start()
    _reconnected(pc)

    # Evicts A, most likely before C's acknowledgement arrives: then A is still marked and not
    # written (docs/cache.md: the marks go at the first reply from the new store).
    pc.insert(c, snap)
    assert pc.flush()
    kc = pc._keys(c, [N])[0]
    assert pc.l1.peek(kc).in_l2 and kc in _l2_keys(proc)
    assert not pc.l1.peek(pc._keys(b, [N])[0]).in_l2  # B's mark went with C's acknowledgement
    assert pc.stats()["l2_store_changed"] == 1
    pc.insert(d, snap)  # evicts B: spilled to the new store
    assert pc.flush()
    assert pc._keys(b, [N])[0] in _l2_keys(proc)
    assert _marked_but_absent(pc, proc) == []


def test_stats_see_the_new_store_too(pairs, cache_proc):  # noqa: F811
    proc = cache_proc()
    pc, _, _ = _filled(pairs, proc)
    proc.stop()
    shutil.rmtree(proc.directory)
    proc.start()
    _reconnected(pc)
    st = pc.stats(remote=True)  # a status, before any lookup or write
    assert not any(e.in_l2 for e in pc.l1._entries.values())
    assert st["l2_store_changed"] == 1 and st["l2_remote"]["store"] == _store_id(proc)
    # the daemon's stats reply (`dflash-client cache show --json`) carries it too
    daemon = cache_stats(DaemonConfig(model="m", cache_endpoint=proc.endpoint), pc, proc.client().stats())
    assert daemon["l2_store_changed"] == 1 and daemon["l2_process"]["store"] == st["l2_remote"]["store"]


# --- which reply to trust ---------------------------------------------------------------------

def test_a_late_reply_from_an_older_store_marks_nothing(pairs):
    """Ids are not ordered: a reply to a request sent before the last change of id may come from
    the store before it (a late reply) or after it. No mark is made from it, and when its id
    differs no mark stays; the next reply to a request sent after that decides."""
    snap = _snapshot(pairs("qwen3"), N)
    pc = PrefixCache(_ident(), Snapshot.decode, None, l1_max_entries=4, every=WHOLE)
    for i in (1, 2):
        pc.insert(_ids(i), snap)
    with pc._lock:
        sent_before = pc._marks.epoch
        assert pc._marks.store_seen("aaaa", sent_before)  # the first id seen: taken up silently
        for e in pc.l1.values():
            e.in_l2 = True
        assert pc._marks.store_seen("aaaa", sent_before)  # the same store, however late
        assert pc._marks.store_seen("bbbb", pc._marks.epoch)  # sent after: the store changed
        assert not any(e.in_l2 for e in pc.l1.values())
        for e in pc.l1.values():
            e.in_l2 = True  # made in bbbb
        assert not pc._marks.store_seen("aaaa", sent_before)  # late, or newer? not known: no mark
        assert not any(e.in_l2 for e in pc.l1.values())
        assert not pc._marks.store_seen("bbbb", sent_before)
        assert pc._marks.store_seen("bbbb", pc._marks.epoch)  # sent after the doubt: trusted
        assert pc._marks.store_seen(None, sent_before)  # no id: as before the ids
    assert pc.stats()["l2_store_changed"] == 2


# --- an older cache process -------------------------------------------------------------------

def test_replies_without_a_store_id_work_as_before(pairs):
    """A cache process from before the id answers without `store`: writes are marked on their
    acknowledgement, lookups miss, nothing counts as a change of store."""
    snap = _snapshot(pairs("qwen3"), N)
    sock_dir = tempfile.mkdtemp(prefix="dfc", dir="/tmp")  # ipc paths must be short
    endpoint = f"ipc://{sock_dir}/old.sock"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)
    stop = threading.Event()
    ops: list[str] = []

    def older_process() -> None:  # the replies cache/l2.py sent before `store` (protocol v1)
        while not stop.is_set():
            if not router.poll(50):
                continue
            peer, header, *_ = router.recv_multipart()
            req = msgpack.unpackb(header, raw=False)
            ops.append(req["op"])
            reply = {"ok": True, "id": req["id"], "v": 1}
            if req["op"] == "put":
                reply["evicted"] = []
            elif req["op"] == "get":
                reply["found"] = False
            elif req["op"] == "stats":
                reply["stats"] = {"bytes": 0, "entries": 1, "evictions": 0}
            router.send_multipart([peer, msgpack.packb(reply, use_bin_type=True)])

    server = threading.Thread(target=older_process)
    server.start()
    try:
        pc = PrefixCache(_ident(), Snapshot.decode, CacheClient(endpoint, timeout_s=30.0),
                         l1_max_entries=4, every=WHOLE)
        pc.insert(_ids(1), snap)
        assert pc.flush()
        assert pc.lookup(_ids(2)) is None
        assert pc.l1.peek(pc._keys(_ids(1), [N])[0]).in_l2
        st = pc.stats(remote=True)
        assert st["l2_store_changed"] == 0 and st["l2_writes"] == 1 and st["l2_remote"]["entries"] == 1
        assert {"put", "get", "stats"} <= set(ops)
        pc.l2.close()
    finally:
        stop.set()
        server.join()
        router.close(0)
        ctx.term()
        shutil.rmtree(sock_dir, ignore_errors=True)
