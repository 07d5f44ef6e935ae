"""PrefixCache: the tiered prefix cache the engine sees (L1 in RAM, L2 in the cache process).

Snapshots are only ever restored at the exact boundary they were taken at (a recurrent state or
a wrapped sliding window cannot be cut shorter), so entries are keyed by (identity, the token
ids of the prefix) and a lookup probes the boundaries a snapshot can exist at, longest first:
the prompt's own length, lengths of prompts inserted earlier, and every multiple of `every`.

Snapshot objects are opaque here; they need `n_tokens`, `nbytes` and `body()` (the msgpack-able
map of dflash.cache.snapshot, built cheaply on the caller's thread), and `decode(bytes)` builds
one back (engine/prefix.py provides both). L2 writes are write-behind: a writer thread turns
bodies into bytes and hands them to the cache process, so taking a snapshot during a prefill
never waits for encoding or the socket (it did: ~2 s of a 31 ms H200 prefill at 4K tokens).
The writer awaits each write's acknowledgement: an L1 entry counts as in L2 only then, so one
whose write did not land is spilled when L1 evicts it instead of being lost from both tiers.
It counts as in L2 only as long as L2 holds it, too: each acknowledgement lists the keys the cache
process evicted to make room (its LRU knows nothing of L1 hits), and those L1 entries lose the
mark, so L1 spills them again when it evicts them (a reply that never came may have evicted
anything: then no L1 entry keeps the mark). And only as long as the store is the one it was
stored in: each reply names its store's id (cache/l2.py: new when a store is created fresh,
repaired or cleared, kept across restarts on the same store); on another id every mark goes.

`discard` (a snapshot that does not fit the loaded model) must win over a write of the same entry
still queued or under way: its L2 delete goes through the writer's queue, behind any such write,
and the entry is marked discarded so that a write not yet sent is skipped. The engine thread
never waits for the cache process there.

Three threads meet here in the daemon: the engine's (lookup, insert), the writer (write outcomes)
and the socket thread (`stats`). One lock guards every counter, L1 and the entries' write flags,
and is never held across a round trip, an encode or MLX work.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import sys
import threading
from array import array
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Protocol, Sequence

from .client import CacheClient
from .l1 import L1, L1Entry
from . import snapshot as fmt
from .snapshot import FORMAT_VERSION, CorruptSnapshot

log = logging.getLogger("dflash.cache")
MAX_KNOWN_ENDS = 1024  # off-grid prompt lengths remembered as lookup candidates
MAX_GONE = 4096  # keys the cache process reported evicted, remembered for lookups under way


class SnapshotLike(Protocol):
    n_tokens: int

    @property
    def nbytes(self) -> int: ...

    def encode(self) -> bytes: ...


@dataclass(frozen=True)
class Identity:
    """Everything besides the tokens that decides a snapshot's contents."""

    target: str  # model identity: path/name + dtype + a weights fingerprint, as the caller knows
    draft: str
    layer_ids: tuple[int, ...]
    template: str = ""  # hash of the chat template / prompt policy that produced the ids
    version: int = FORMAT_VERSION

    def digest(self) -> bytes:
        text = "\x1f".join(
            [self.target, self.draft, ",".join(map(str, self.layer_ids)), self.template,
             str(self.version)]
        )
        return hashlib.blake2b(text.encode(), digest_size=16).digest()


@dataclass
class TierStats:
    hits: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    bytes: int = 0
    entries: int = 0


@dataclass
class PrefixCacheStats:
    lookups: int = 0
    misses: int = 0
    inserts: int = 0
    corrupt_dropped: int = 0
    l2_writes: int = 0
    l2_dropped_writes: int = 0
    l2_too_large: int = 0  # snapshots over the whole L2 budget: kept in L1 only, never sent
    # evicted from L1 while their L2 write was in flight (or when it could not be queued), and
    # that write then failed: in neither tier (part of l2_dropped_writes)
    l2_lost_writes: int = 0
    mismatch_dropped: int = 0  # snapshots that did not fit the loaded model: dropped, prefilled cold
    # writes of discarded snapshots (did not fit) still queued or under way at the discard: not
    # sent, or deleted again behind the write (part of l2_writes when they had landed)
    l2_discarded_writes: int = 0
    # L1 entries the cache process evicted (LRU, for room) while L1 held them: no longer counted
    # as in L2, so spilled when L1 evicts them instead of being lost from both tiers
    l2_evicted_in_l1: int = 0
    # acknowledged writes whose reply never came (timeout), or came without its evictions (the
    # cache process failed mid-write): what they evicted is unknown, so no L1 entry kept its
    # in-L2 mark (those entries are counted in l2_evicted_in_l1)
    l2_unanswered_writes: int = 0
    # times a reply named another L2 store than the one L1's in-L2 marks were made under (the
    # store was recreated: damaged, removed, cleared): every mark was cleared (those entries are
    # counted in l2_evicted_in_l1), so L1 spills them when it evicts them instead of losing them
    l2_store_changed: int = 0
    l1: TierStats = field(default_factory=TierStats)
    l2: TierStats = field(default_factory=TierStats)


class PrefixCache:
    """Longest-prefix lookup across L1 then L2; inserts go to L1 (and L2); L1 evictions spill."""

    def __init__(
        self,
        identity: Identity,
        decode: Callable[[bytes], SnapshotLike],
        l2: CacheClient | None = None,
        l1_max_bytes: int = 2 << 30,
        l1_max_entries: int = 64,
        every: int = 256,
        write_through: bool = True,
        max_pending_writes: int = 8,
        l2_max_bytes: int | None = None,
    ):
        if every < 1:
            raise ValueError("every must be >= 1")
        self.identity = identity
        self._ident = identity.digest()
        self.decode = decode
        self.l2 = l2
        self.l1 = L1(l1_max_bytes, l1_max_entries)
        self.every = every
        self.write_through = write_through
        self.l2_max_bytes = l2_max_bytes  # the cache process's size limit: larger ones are refused
        # prompt lengths stored off the `every` grid, most recent last; bounded: each is probed
        # (hashed, and asked of the cache process) on every lookup of a longer prompt
        self._known_ends: dict[int, None] = {}
        self._stats = PrefixCacheStats()
        # Counters, L1 and the entries' in_l2 / pending / evicted flags change on the engine and
        # writer threads and are read on the socket thread: all of them only under this lock,
        # so one stats() is one consistent set (lookups == misses + hits, L1 bytes of its entries).
        self._lock = threading.Lock()
        # The writer's work, in order: ("put", key, body, entry) and ("delete", key, None, None).
        # Unbounded: puts are bounded by max_pending_writes (counted in _queued_puts), deletes are
        # never refused (one per discard) so that a discard always follows the writes before it.
        self._writes: queue.Queue[tuple[str, str, dict[str, Any] | None, L1Entry | None]] = queue.Queue()
        self._max_pending_writes = max_pending_writes
        self._queued_puts = 0
        self._writer: threading.Thread | None = None
        # Eviction reports from the cache process (one per answered write), for a lookup that
        # brings an entry from L2 while a write evicts it there: key -> the report that said so
        # (recent ones); a report at or below _gone_floor may have evicted any key.
        self._reports = 0
        self._l2_gone: OrderedDict[str, int] = OrderedDict()
        self._gone_floor = 0
        # keys whose discard's L2 delete is queued (-> how many): not asked of L2 until it ran
        self._deleting: dict[str, int] = {}
        # The id of the L2 store the in-L2 marks were made under (None: none seen yet, or unknown),
        # and how many times it was taken up or dropped: a reply to a request sent before the
        # last such change may come from either store (see _store_seen).
        self._l2_store: str | None = None
        self._store_epoch = 0

    # --- the engine's interface ------------------------------------------------------------
    def boundaries(self, n_prompt: int) -> list[int]:
        """Where the engine should take snapshots while prefilling a prompt of n_prompt tokens."""
        return sorted({*range(self.every, n_prompt, self.every), n_prompt})

    def lookup(self, ids: Sequence[int]) -> tuple[int, SnapshotLike] | None:
        """The longest stored prefix of `ids` (L1 first, then longer ones in L2), or None."""
        with self._lock:
            lengths = self._candidates(len(ids))
        keys = dict(zip(lengths, self._keys(ids, lengths)))
        with self._lock:
            best = next(((n, e) for n in lengths if (e := self.l1.get(keys[n])) is not None), None)
            # Only a longer prefix is worth a round trip to the cache process; never one that
            # was discarded and is still to be deleted there.
            wanted = {keys[n]: n for n in lengths
                      if (best is None or n > best[0]) and keys[n] not in self._deleting}
        found = self._lookup_l2(wanted)
        if found is not None:
            return found
        with self._lock:  # a lookup is counted with its outcome, never before it
            self._stats.lookups += 1
            if best is None:
                self._stats.misses += 1
                return None
            self._stats.l1.hits += 1
            self._stats.l1.hit_tokens += best[0]
        return best[0], best[1].value

    def insert(self, ids: Sequence[int], snap: SnapshotLike) -> None:
        """Store a snapshot taken after exactly the tokens `ids`."""
        n = len(ids)
        if snap.n_tokens != n:
            raise ValueError(f"snapshot holds {snap.n_tokens} tokens, ids has {n}")
        with self._lock:
            self._stats.inserts += 1
            if n % self.every:
                self._known_ends.pop(n, None)
                self._known_ends[n] = None
                if len(self._known_ends) > MAX_KNOWN_ENDS:
                    del self._known_ends[next(iter(self._known_ends))]
        key = self._keys(ids, [n])[0]
        entry = L1Entry(n, snap, snap.nbytes)
        if self.write_through:
            self._write_l2(key, entry)
        self._put_l1(key, entry)

    def discard(self, ids: Sequence[int]) -> None:
        """Drop the snapshot stored after exactly `ids` from both tiers: it did not fit the
        loaded model (engine/prefix.py check_fits), so it would never be restored anyway.

        Never waits for the cache process: the L2 delete is queued for the writer, behind every
        write queued before (so a write of this snapshot still queued or under way lands first
        and is deleted after: the discard wins), and a write of the L1 entry not yet sent is
        skipped. A snapshot inserted under the same key afterwards is written after the delete;
        until the delete ran, lookups do not ask L2 for the key."""
        key = self._keys(ids, [len(ids)])[0]
        with self._lock:
            self._stats.mismatch_dropped += 1
            entry = self.l1.pop(key)
            if entry is not None:
                entry.discarded = True
            if self.l2 is not None:
                self._deleting[key] = self._deleting.get(key, 0) + 1
                self._start_writer()
        if self.l2 is not None:
            self._writes.put_nowait(("delete", key, None, None))

    # --- housekeeping ----------------------------------------------------------------------
    def wait_writes(self, timeout: float | None = None) -> bool:
        """Wait (up to `timeout` s) until every queued L2 write (and discard's delete) was
        handled by the cache process (or failed)."""
        q = self._writes
        with q.all_tasks_done:
            return q.all_tasks_done.wait_for(lambda: q.unfinished_tasks == 0, timeout)

    def flush(self) -> bool:
        """Wait until the cache process has handled every write queued so far (a round trip)."""
        self.wait_writes()
        return self.l2 is not None and self.l2.ping()

    def drop_l1(self) -> None:
        """Forget L1 without spilling (what a worker restart does)."""
        with self._lock:
            self.l1.clear()

    def stats(self, remote: bool = False) -> dict[str, Any]:
        """Counters per tier; remote=True also asks the cache process for its own (and notes
        which store answered, like any other reply)."""
        r = None
        if remote and self.l2 is not None:
            with self._lock:
                epoch = self._store_epoch
            r = self.l2.stats()
        with self._lock:  # one consistent set, copied: the counters go on changing after
            if r is not None:
                self._store_seen(r.get("store"), epoch)
            out = asdict(self._stats)
            out["l1"].update(bytes=self.l1.bytes, entries=len(self.l1), evictions=self.l1.evictions)
        if r is not None:
            out["l2"].update(bytes=r["bytes"], entries=r["entries"], evictions=r["evictions"])
            out["l2_remote"] = r
        out["l2_available"] = self.l2 is not None and self.l2.available
        return out

    # --- internals -------------------------------------------------------------------------
    def _candidates(self, n: int) -> list[int]:
        grid = range(self.every, n + 1, self.every)
        ends = (e for e in self._known_ends if e <= n)
        return sorted({n, *grid, *ends}, reverse=True)

    def _keys(self, ids: Sequence[int], lengths: list[int]) -> list[str]:
        """One incremental blake2b pass over the ids; a key at each requested length."""
        h = hashlib.blake2b(self._ident, digest_size=20)
        out: dict[int, str] = {}
        done = 0
        for n in sorted(set(lengths)):
            h.update(_id_bytes(ids[done:n]))
            done = n
            out[n] = "snap:" + h.copy().hexdigest()
        return [out[n] for n in lengths]

    def _lookup_l2(self, wanted: dict[str, int]) -> tuple[int, SnapshotLike] | None:
        """The first of the keys (longest first) L2 holds intact; `wanted`: key -> prefix length."""
        keys = list(wanted)
        if self.l2 is None or not keys:
            return None
        with self._lock:  # eviction reports after this may concern the entry this brings back
            mark, epoch = self._reports, self._store_epoch
        while keys:
            got = self.l2.find(keys)
            if got is None:
                return None
            if got.key is None:  # a miss still says which store answered
                with self._lock:
                    self._store_seen(got.store, epoch)
                return None
            key, data = got.key, got.data
            try:
                # The process checks too; never load a bad entry, nor one stored for another key.
                if fmt.entry_key(data) != key:
                    raise CorruptSnapshot("entry belongs to another key")
                snap = self.decode(data)
                if snap.n_tokens != wanted.get(key):  # a snapshot of other tokens than its key's
                    raise CorruptSnapshot(f"holds {snap.n_tokens} tokens, its key {wanted.get(key)}")
            except CorruptSnapshot as e:
                log.warning("dropping corrupt L2 entry %s: %s", key, e)
                with self._lock:
                    self._stats.corrupt_dropped += 1
                    self._store_seen(got.store, epoch)
                    epoch = self._store_epoch  # the next get is sent after this
                self.l2.delete(key)
                keys = keys[keys.index(key) + 1 :]
                continue
            n = snap.n_tokens
            with self._lock:
                self._stats.lookups += 1
                self._stats.l2.hits += 1
                self._stats.l2.hit_tokens += n
            self._put_l1(key, L1Entry(n, snap, snap.nbytes, in_l2=True), l2_mark=mark,
                         l2_store=(got.store, epoch))
            return n, snap
        return None

    def _write_l2(self, key: str, entry: L1Entry) -> None:
        """Queue a write-behind of `entry`, unless L2 is absent, could never hold it, or writes
        pile up (then dropped, counted: the entry stays not in L2 and is spilled on eviction).

        `entry.in_l2` turns True only when the cache process acknowledged the write, so a write
        that never landed (process down, queue full, refused) leaves the entry to be spilled
        when L1 evicts it, instead of being lost from both tiers."""
        with self._lock:
            if not self._claim(entry):
                return
        self._send(key, entry)

    def _claim(self, entry: L1Entry) -> bool:
        """(Lock held.) True when the caller is to write `entry` now; it is then `pending`."""
        if self.l2 is None or entry.in_l2 or entry.pending:
            return False
        if self.l2_max_bytes is not None and entry.nbytes > self.l2_max_bytes:
            self._stats.l2_too_large += 1  # the cache process would refuse it: not encoded, not sent
            return False
        entry.pending = True
        return True

    def _send(self, key: str, entry: L1Entry) -> None:
        """Hand a claimed entry's body to the writer thread (outside the lock: body() is MLX work)."""
        try:
            body = entry.value.body()
        except Exception:  # an encoding bug must not break generation; L1 still serves
            log.exception("could not encode snapshot %s", key)
            with self._lock:
                self._write_failed(key, entry)
            return
        with self._lock:
            self._start_writer()
            full = self._queued_puts >= self._max_pending_writes
            if full:
                self._write_failed(key, entry)
            else:
                self._queued_puts += 1
        if not full:
            self._writes.put_nowait(("put", key, body, entry))

    def _start_writer(self) -> None:
        """(Lock held.)"""
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="dflash-l2-writer", daemon=True)
            self._writer.start()

    def _write_failed(self, key: str, entry: L1Entry) -> None:
        """(Lock held.) A write that did not land. An entry L1 still holds is spilled again when
        evicted; one L1 evicted while this write was in flight is in neither tier now: counted
        as lost and logged, never left looking stored (its in_l2 stays False)."""
        entry.pending = False
        self._stats.l2_dropped_writes += 1
        if entry.evicted:
            self._stats.l2_lost_writes += 1
            log.warning("snapshot %s was evicted from L1 while its L2 write was in flight, and the "
                        "write failed: it is in neither tier", key)

    def _write_loop(self) -> None:
        """The writer thread: the queued writes and deletes, handled by the cache process in
        order; an entry counts as in L2 once the process acknowledged its write."""
        while True:
            op, key, body, entry = self._writes.get()
            try:
                if op == "delete":
                    self._delete(key)
                else:
                    assert body is not None and entry is not None
                    self._store(key, body, entry)
            except Exception:  # never let the writer die: later writes still need it
                log.exception("L2 %s of %s failed", op, key)
            finally:
                body = entry = None
                self._writes.task_done()

    def _delete(self, key: str) -> None:
        """(Writer thread.) A discard's delete, behind every write queued before it."""
        assert self.l2 is not None
        try:
            if not self.l2.delete(key):
                log.warning("could not delete discarded snapshot %s from L2 (cache process not "
                            "available): a lookup that finds it drops it again", key)
        finally:
            with self._lock:
                left = self._deleting.pop(key) - 1
                if left:
                    self._deleting[key] = left

    def _store(self, key: str, body: dict[str, Any], entry: L1Entry) -> None:
        """(Writer thread.) Encode and write one snapshot, then record the outcome and what the
        cache process evicted for it."""
        with self._lock:
            self._queued_puts -= 1
            if entry.discarded:  # discarded while queued: never sent (its delete follows)
                entry.pending = False
                self._stats.l2_discarded_writes += 1
                return
            epoch = self._store_epoch  # before the request: see _store_seen
        ok = too_large = False
        evicted: list[str] | None = []
        store: str | None = None
        try:
            data = fmt.encode(body, key)
            del body
            if self.l2_max_bytes is not None and len(data) > self.l2_max_bytes:
                too_large = True
            elif self.l2 is not None:
                written = self.l2.write(key, data)
                ok, evicted, store = written.stored, written.evicted, written.store
        except Exception:
            log.exception("could not write snapshot %s", key)
        finally:
            body = data = None
            with self._lock:  # the outcome and the flags together: _spill sees one or the other
                same_store = self._store_seen(store, epoch)  # first: it may clear every mark
                self._evicted_from_l2(evicted)
                if too_large:
                    self._stats.l2_too_large += 1
                    entry.pending = False
                elif ok:
                    entry.pending = False
                    self._stats.l2_writes += 1
                    if entry.discarded:  # landed after its discard: the queued delete removes it
                        self._stats.l2_discarded_writes += 1
                    else:  # unless it may have landed in a store that is gone by now
                        entry.in_l2 = same_store
                else:
                    self._write_failed(key, entry)

    def _evicted_from_l2(self, keys: list[str] | None) -> None:
        """(Lock held.) The cache process evicted `keys` (None: maybe anything) to make room for
        a write: L1 entries under them are in L2 no more, and L1 spills them when it evicts them.
        Remembered for a lookup that is bringing one of them back from L2 right now."""
        self._reports += 1
        if keys is None:
            self._stats.l2_unanswered_writes += 1
            self._gone_floor = self._reports
            held = [e for e in self.l1.values() if e.in_l2]
        else:
            held = [e for k in keys if (e := self.l1.peek(k)) is not None and e.in_l2]
            for k in keys:
                self._l2_gone[k] = self._reports
                self._l2_gone.move_to_end(k)
            while len(self._l2_gone) > MAX_GONE:
                _, report = self._l2_gone.popitem(last=False)
                self._gone_floor = max(self._gone_floor, report)
        for e in held:
            e.in_l2 = False
            self._stats.l2_evicted_in_l1 += 1
        if held:
            log.info("L2 evicted %d snapshot(s) L1 holds: spilled again when L1 evicts them", len(held))

    def _store_seen(self, store: Any, epoch: int) -> bool:
        """(Lock held.) A reply names the L2 store that served it (`store`; None from a cache
        process that names none: marks as before); `epoch` was _store_epoch when its request was
        sent. True when an in-L2 mark made from this reply holds.

        Another id than the marks' means the store is not the one they were made in (created
        fresh, repaired, cleared): every mark goes (L1 spills those entries when it evicts them
        instead of losing them). Ids are random, not ordered, so a reply is trusted to be the
        newest store only when no other id was taken up while its request was out (a request
        sent after a change is served by that store or a later one); otherwise it may be an
        older store's late reply or a newer one's: no mark is made from it and, should it differ,
        every mark goes and the next reply decides."""
        if not isinstance(store, str) or not store or store == self._l2_store:
            return True
        if epoch != self._store_epoch:
            if self._l2_store is not None:
                self._marks_gone(self._l2_store, "not known yet")
                self._l2_store = None
                self._store_epoch += 1
            return False
        if self._l2_store is not None:
            self._marks_gone(self._l2_store, store)
        self._l2_store = store  # the first id seen (or the first after doubt): the marks are its
        self._store_epoch += 1
        return True

    def _marks_gone(self, old: str, new: str) -> None:
        """(Lock held.) The L2 store changed: no L1 entry is known to be in it any more."""
        held = [e for e in self.l1.values() if e.in_l2]
        for e in held:
            e.in_l2 = False
        self._stats.l2_store_changed += 1
        self._stats.l2_evicted_in_l1 += len(held)
        # a warning when it cost something (after a `cache clear`, which empties L1 first, none)
        log.log(logging.WARNING if held else logging.INFO,
                "L2 store changed (id %s, now %s): %d snapshot(s) L1 holds no longer count as in L2 "
                "and are written there again when L1 evicts them", old, new, len(held))

    def _gone_since(self, key: str, mark: int) -> bool:
        """(Lock held.) Whether an eviction report after report `mark` may have named `key`."""
        return self._gone_floor > mark or self._l2_gone.get(key, 0) > mark

    def _put_l1(self, key: str, entry: L1Entry, l2_mark: int | None = None,
                l2_store: tuple[str | None, int] | None = None) -> None:
        """Put `entry` in L1 and spill what that evicts. `l2_mark`: the entry comes from L2 as
        of eviction report `l2_mark`; a write since may have evicted it there. `l2_store`: (the
        store id its get reply named, the epoch that get was sent at), checked in this same
        locked step, so a change seen meanwhile cannot leave it marked."""
        with self._lock:
            if l2_store is not None and not self._store_seen(*l2_store):
                entry.in_l2 = False
            if l2_mark is not None and self._gone_since(key, l2_mark):
                entry.in_l2 = False
            evicted = self.l1.put(key, entry)
        self._spill(evicted)

    def _spill(self, evicted: list[tuple[str, L1Entry]]) -> None:
        """Write evicted entries that are not in L2 yet. One whose write is still in flight is
        marked evicted in the same locked step that finds it pending, so the writer, if that
        write fails, counts it lost exactly once (and a write that ended just before is sent
        again here instead)."""
        for key, entry in evicted:
            with self._lock:
                entry.evicted = True
                send = self._claim(entry)
            if send:
                self._send(key, entry)


def _id_bytes(ids: Sequence[int]) -> bytes:
    a = array("q", ids)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()
