"""Session 53: a large L2 write waiting for its acknowledgement holds up no lookup and no stats.

The prefix cache's writer and its lookups (engine thread) and remote stats (`stats(remote=True)`:
cache/bench.py; the daemon's socket thread, which sends the heartbeats, asks through a client of
its own) shared one CacheClient, whose lock a request holds for its whole round trip; an
acknowledged write waits up to 1 s + 1 s per 32 MB (128 MB before), and on a loaded 2-core CPU the cache
process took seconds to store a few hundred MB (session 53's 8,100-token runs). So a lookup or a
remote stats call waited behind the write for up to 1.25 s (the lock's timeout), a lookup then
missed, and a write's timeout rested the lookups' client too. The writer now has a
twin client (`CacheClient.twin`).

Proves it with a cache process (a real ROUTER socket speaking the protocol) that holds every
put's acknowledgement for HOLD_S: while a write waits, lookups and remote stats are answered at
once, and a write that times out leaves the lookups' client available.
"""

from __future__ import annotations

import tempfile
import threading
import time

import msgpack
import zmq

from dflash.cache.client import CacheClient
from dflash.cache.tiers import PrefixCache
from dflash.engine.prefix import Snapshot
from test_cache_store_identity import N, _ids
from test_cache_threads import WHOLE, _ident, _snapshot

HOLD_S = 2.5


class SlowStore:
    """A cache process that answers gets and stats at once and each put HOLD_S later."""

    def __init__(self):
        self.endpoint = f"ipc://{tempfile.mkdtemp(prefix='dfw', dir='/tmp')}/slow.sock"
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(self.endpoint)
        self.puts_received = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        held: list[tuple[float, list[bytes]]] = []
        while not self.stop.is_set():
            now = time.monotonic()
            for due, frames in [h for h in held if h[0] <= now]:
                self.router.send_multipart(frames)
                held.remove((due, frames))
            if not self.router.poll(20):
                continue
            peer, header, *_ = self.router.recv_multipart()
            req = msgpack.unpackb(header, raw=False)
            reply = {"ok": True, "id": req["id"], "v": 1, "store": "slow"}
            if req["op"] == "put":
                self.puts_received.set()
                reply["evicted"] = []
                held.append((time.monotonic() + HOLD_S, [peer, msgpack.packb(reply, use_bin_type=True)]))
                continue
            if req["op"] == "get":
                reply["found"] = False
            elif req["op"] == "stats":
                reply["stats"] = {"bytes": 0, "entries": 0, "evictions": 0}
            self.router.send_multipart([peer, msgpack.packb(reply, use_bin_type=True)])

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.router.close(0)
        self.ctx.term()


def _timed(fn):
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0


def test_lookups_and_stats_do_not_wait_behind_a_slow_write(pairs):
    store = SlowStore()
    try:
        pc = PrefixCache(_ident(), Snapshot.decode, CacheClient(store.endpoint, timeout_s=10.0),
                         l1_max_entries=4, every=WHOLE)
        pc.insert(_ids(1), _snapshot(pairs("qwen3"), N))  # its write goes to the writer thread
        assert store.puts_received.wait(5.0), "the write never reached the cache process"
        found, took_lookup = _timed(lambda: pc.lookup(_ids(2)))
        st, took_stats = _timed(lambda: pc.stats(remote=True))
        assert found is None and st["l2_remote"]["entries"] == 0
        # shared client: each waited for the write's acknowledgement (HOLD_S) behind its lock
        assert took_lookup < 0.5 and took_stats < 0.5, (took_lookup, took_stats)
        assert pc.flush()  # the write itself still lands, acknowledged
        assert pc.l1.peek(pc._keys(_ids(1), [N])[0]).in_l2
    finally:
        store.close()


def test_a_write_that_times_out_rests_only_the_writes(pairs):
    store = SlowStore()
    try:
        client = CacheClient(store.endpoint, timeout_s=0.3, retry_after_s=30.0)
        pc = PrefixCache(_ident(), Snapshot.decode, client, l1_max_entries=4, every=WHOLE)
        pc.insert(_ids(1), _snapshot(pairs("qwen3"), N))
        assert store.puts_received.wait(5.0)
        pc.flush()  # the write times out: not stored, its client rests 30 s
        assert not pc.l1.peek(pc._keys(_ids(1), [N])[0]).in_l2
        assert client.available and pc.stats()["l2_available"]
        _, took = _timed(lambda: pc.lookup(_ids(2)))
        assert took < 0.5 and client.counts()["requests"] >= 1 and client.counts()["timeouts"] == 0
    finally:
        store.close()


def test_flush_is_false_while_a_write_went_unanswered(pairs):
    """flush() says the cache process handled every write queued so far. A write that timed out
    was not acknowledged (the cache process may still store it) and rests only the writer's
    twin: the ping flush made on the lookups' client alone answered True all the same."""
    store = SlowStore()
    try:
        client = CacheClient(store.endpoint, timeout_s=0.3, retry_after_s=30.0)
        pc = PrefixCache(_ident(), Snapshot.decode, client, l1_max_entries=4, every=WHOLE)
        assert pc.flush()  # nothing queued, both clients answered
        pc.insert(_ids(1), _snapshot(pairs("qwen3"), N))
        assert store.puts_received.wait(5.0)
        assert not pc.flush()  # the write timed out: not known to be handled
        assert pc.stats()["l2_unanswered_writes"] == 1
        assert client.available  # the lookups' client still is
    finally:
        store.close()
