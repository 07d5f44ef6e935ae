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
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Protocol, Sequence

from .client import CacheClient
from .l1 import L1, L1Entry
from . import snapshot as fmt
from .snapshot import FORMAT_VERSION, CorruptSnapshot

log = logging.getLogger("dflash.cache")
MAX_KNOWN_ENDS = 1024  # off-grid prompt lengths remembered as lookup candidates


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
        self._writes: queue.Queue[tuple[str, dict[str, Any], L1Entry]] = queue.Queue(maxsize=max_pending_writes)
        self._writer: threading.Thread | None = None

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
        # Only a longer prefix is worth a round trip to the cache process.
        found = self._lookup_l2({keys[n]: n for n in lengths if best is None or n > best[0]})
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
        loaded model (engine/prefix.py check_fits), so it would never be restored anyway."""
        key = self._keys(ids, [len(ids)])[0]
        with self._lock:
            self._stats.mismatch_dropped += 1
            self.l1.pop(key)
        if self.l2 is not None:
            self.l2.delete(key)

    # --- housekeeping ----------------------------------------------------------------------
    def wait_writes(self, timeout: float | None = None) -> bool:
        """Wait (up to `timeout` s) until every queued L2 write was stored by the cache process
        (or failed)."""
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
        """Counters per tier; remote=True also asks the cache process for its own."""
        with self._lock:  # one consistent set, copied: the counters go on changing after
            out = asdict(self._stats)
            out["l1"].update(bytes=self.l1.bytes, entries=len(self.l1), evictions=self.l1.evictions)
        if remote and self.l2 is not None:
            r = self.l2.stats()
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
        while keys:
            got = self.l2.get_first(keys)
            if got is None:
                return None
            key, data = got
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
                self.l2.delete(key)
                keys = keys[keys.index(key) + 1 :]
                continue
            n = snap.n_tokens
            with self._lock:
                self._stats.lookups += 1
                self._stats.l2.hits += 1
                self._stats.l2.hit_tokens += n
            self._put_l1(key, L1Entry(n, snap, snap.nbytes, in_l2=True))
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
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="dflash-l2-writer", daemon=True)
                self._writer.start()
        try:
            self._writes.put_nowait((key, body, entry))
        except queue.Full:
            with self._lock:
                self._write_failed(key, entry)

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
        """The writer thread: bytes for each queued body, stored by the cache process in order;
        an entry counts as in L2 once the process acknowledged its write."""
        while True:
            key, body, entry = self._writes.get()
            ok = too_large = False
            try:
                data = fmt.encode(body, key)
                del body
                if self.l2_max_bytes is not None and len(data) > self.l2_max_bytes:
                    too_large = True
                else:
                    ok = self.l2 is not None and self.l2.put(key, data, wait=True)
            except Exception:
                log.exception("could not write snapshot %s", key)
            finally:
                body = data = None
                with self._lock:  # the outcome and the flags together: _spill sees one or the other
                    if too_large:
                        self._stats.l2_too_large += 1
                        entry.pending = False
                    elif ok:
                        entry.in_l2 = True
                        entry.pending = False
                        self._stats.l2_writes += 1
                    else:
                        self._write_failed(key, entry)
                self._writes.task_done()

    def _put_l1(self, key: str, entry: L1Entry) -> None:
        with self._lock:
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
