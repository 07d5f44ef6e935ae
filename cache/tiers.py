"""PrefixCache: the tiered prefix cache the engine sees (L1 in RAM, L2 in the cache process).

Snapshots are only ever restored at the exact boundary they were taken at (a recurrent state or
a wrapped sliding window cannot be cut shorter), so entries are keyed by (identity, the token
ids of the prefix) and a lookup probes the boundaries a snapshot can exist at, longest first:
the prompt's own length, lengths of prompts inserted earlier off the marks, and the marks
(`snapshot_marks`: every multiple of `every` up to 8 of them, then sparser).

Snapshot objects are opaque here; they need `n_tokens`, `nbytes` and `body()` (the msgpack-able
map of dflash.cache.snapshot, built cheaply on the caller's thread), and `decode(bytes)` builds
one back (engine/prefix.py provides both). This module holds the key, the lookup over L1 then
L2 and what goes into L1; L2 writes are write-behind (L2Writer, cache/writer.py: puts, discards'
deletes, the pending bound), and whether an L1 entry still counts as in L2 is L2Marks'
(cache/marks.py: the cache process's eviction reports and store ids).

Three threads meet here in the daemon: the engine's (lookup, insert), the writer (write outcomes)
and the socket thread (`stats`). One lock guards every counter, L1 and the entries' write flags,
and is never held across a round trip, an encode or MLX work. It lives here (`PrefixCache._lock`)
and is handed to the L2Writer and L2Marks, which have none of their own: a write's outcome, the
marks it clears and the counters change in one step, and one stats() is one consistent set.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import threading
from array import array
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Protocol, Sequence

from .client import CacheClient
from .l1 import L1, L1Entry
from . import snapshot as fmt
from .marks import MAX_GONE, L2Marks  # noqa: F401  (MAX_GONE: still importable from here)
from .snapshot import FORMAT_VERSION, CorruptSnapshot
from .writer import L2Writer

log = logging.getLogger("dflash.cache")
MAX_KNOWN_ENDS = 1024  # off-grid prompt lengths remembered as lookup candidates


class SnapshotLike(Protocol):
    n_tokens: int

    @property
    def nbytes(self) -> int: ...

    def encode(self) -> bytes | memoryview: ...


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


DENSE_MARKS = 8  # snapshots `every` tokens apart up to this many; then 4 per doubling of the prefix


def snapshot_marks(n_prompt: int, every: int) -> list[int]:
    """The prefill lengths below n_prompt to snapshot at: every `every` tokens up to
    DENSE_MARKS * every, then a spacing that doubles each time the length does (4 marks per
    doubling, all on the `every` grid, so lookups probe them as before).

    A snapshot holds the whole prefix, so marks `every` apart cost O(n^2 / every) bytes for one
    prompt: 32 snapshots and ~6.2 GB of KV for an 8,100-token SmolLM2 fp32 prompt, all copied
    on the worker and written to L2 (session 51 saw 8.7 GB of L2 after three long prompts).
    Doubling the spacing bounds the total at ~6.5 times the last snapshot (~2.3 GB there, 16
    snapshots), and a prompt that diverges from a stored one recomputes at most a quarter of
    the shared prefix past DENSE_MARKS * every, under every tokens before it."""
    marks: list[int] = []
    step, m = every, every
    while m < n_prompt:
        marks.append(m)
        if m >= step * DENSE_MARKS:
            step *= 2
        m += step
    return marks


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
        # The one lock: the marks and the writer below use it and have none of their own.
        self._lock = threading.Lock()
        self._marks = L2Marks(self.l1, self._stats)  # the in-L2 marks: eviction reports, store ids
        # the writer talks through a twin client: its writes wait seconds for their acknowledgement
        # on a loaded CPU, and would otherwise hold lookups and stats behind the client's lock
        writes = l2.twin() if l2 is not None else None
        self._writer = L2Writer(writes, self._lock, self._stats, self._marks, max_pending_writes, l2_max_bytes)

    # --- the engine's interface ------------------------------------------------------------
    def boundaries(self, n_prompt: int) -> list[int]:
        """Where the engine should take snapshots while prefilling a prompt of n_prompt tokens:
        snapshot_marks on the `every` grid, then the prompt's end."""
        return [*snapshot_marks(n_prompt, self.every), n_prompt]

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
                      if (best is None or n > best[0]) and keys[n] not in self._writer.deleting}
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
            if n not in snapshot_marks(n + 1, self.every):  # an end no lookup probes otherwise
                self._known_ends.pop(n, None)
                self._known_ends[n] = None
                if len(self._known_ends) > MAX_KNOWN_ENDS:
                    del self._known_ends[next(iter(self._known_ends))]
        key = self._keys(ids, [n])[0]
        entry = L1Entry(n, snap, snap.nbytes)
        if self.write_through:
            self._writer.write(key, entry)
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
            delete = self._writer.claim_delete(key)
        if delete:
            self._writer.send_delete(key)

    # --- housekeeping ----------------------------------------------------------------------
    def wait_writes(self, timeout: float | None = None) -> bool:
        """Wait (up to `timeout` s) until every queued L2 write (and discard's delete) was
        handled by the cache process (or failed)."""
        return self._writer.wait(timeout)

    def flush(self) -> bool:
        """Wait until the cache process has handled every write queued so far (a round trip).

        The round trip goes through the writer's own client (CacheClient.twin) as well as the
        lookups': a write that timed out (not acknowledged, so it may still be stored later)
        leaves only the writer's client resting, and a ping through the lookups' alone would
        answer True. The writer's ping is also a barrier on the writes' own socket."""
        self.wait_writes()
        l2 = self.l2  # one read: close() clears it
        return l2 is not None and self._writer.ping() and l2.ping()

    def close(self, timeout: float | None = 30.0) -> bool:
        """Finish the queued L2 writes, then stop the writer thread and close both clients (the
        lookups' and the writer's twin). L1 stays readable; L2 is neither asked nor written. True when
        the writes finished within `timeout` s."""
        done = self._writer.close(timeout)
        client, self.l2 = self.l2, None  # lookups ask L1 only from here on
        if client is not None:
            client.close()
        return done

    def drop_l1(self) -> None:
        """Forget L1 without spilling (what a worker restart does)."""
        with self._lock:
            self.l1.clear()

    def stats(self, remote: bool = False) -> dict[str, Any]:
        """Counters per tier; remote=True also asks the cache process for its own (and notes
        which store answered, like any other reply)."""
        r, l2 = None, self.l2  # one read: close() clears it
        if remote and l2 is not None:
            with self._lock:
                epoch = self._marks.epoch
            r = l2.stats()
        with self._lock:  # one consistent set, copied: the counters go on changing after
            if r is not None:
                self._marks.store_seen(r.get("store"), epoch)
            out = asdict(self._stats)
            out["l1"].update(bytes=self.l1.bytes, entries=len(self.l1), evictions=self.l1.evictions)
        if r is not None:
            out["l2"].update(bytes=r["bytes"], entries=r["entries"], evictions=r["evictions"])
            out["l2_remote"] = r
        out["l2_available"] = l2 is not None and l2.available
        return out

    # --- internals -------------------------------------------------------------------------
    def _candidates(self, n: int) -> list[int]:
        """Lengths a prefix of n tokens can be stored at: n, the marks up to n, the known ends.
        Only this version's marks: a dense-grid snapshot of an older version (2304 at every 256)
        would resume with a chunk break a cold run does not have."""
        ends = (e for e in self._known_ends if e <= n)
        return sorted({n, *snapshot_marks(n + 1, self.every), *ends}, reverse=True)

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
        keys, l2 = list(wanted), self.l2  # one client for the whole lookup (close() clears it)
        if l2 is None or not keys:
            return None
        with self._lock:  # eviction reports after this may concern the entry this brings back
            mark, epoch = self._marks.reports, self._marks.epoch
        while keys:
            got = l2.find(keys)
            if got is None:
                return None
            if got.key is None:  # a miss still says which store answered
                with self._lock:
                    self._marks.store_seen(got.store, epoch)
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
                    self._marks.store_seen(got.store, epoch)
                    epoch = self._marks.epoch  # the next get is sent after this
                l2.delete(key)
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

    def _put_l1(self, key: str, entry: L1Entry, l2_mark: int | None = None,
                l2_store: tuple[str | None, int] | None = None) -> None:
        """Put `entry` in L1 and spill what that evicts. `l2_mark`: the entry comes from L2 as
        of eviction report `l2_mark`; a write since may have evicted it there. `l2_store`: (the
        store id its get reply named, the epoch that get was sent at), checked in this same
        locked step, so a change seen meanwhile cannot leave it marked."""
        with self._lock:
            if l2_store is not None and not self._marks.store_seen(*l2_store):
                entry.in_l2 = False
            if l2_mark is not None and self._marks.gone_since(key, l2_mark):
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
                send = self._writer.claim(entry)
            if send:
                self._writer.send(key, entry)


def _id_bytes(ids: Sequence[int]) -> bytes:
    a = array("q", ids)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()
