"""L2Writer: the prefix cache's write-behind to L2 (puts, discards' deletes, the pending bound).

A writer thread turns snapshot bodies into bytes and hands them to the cache process, so taking
a snapshot during a prefill never waits for encoding or the socket (it did: ~2 s of a 31 ms H200
prefill at 4K tokens). The writer awaits each write's acknowledgement: an L1 entry counts as in
L2 only then, so one whose write did not land is spilled when L1 evicts it instead of being lost
from both tiers; the acknowledgement's eviction report and store id go to L2Marks (cache/marks.py).

`discard` (a snapshot that does not fit the loaded model) must win over a write of the same entry
still queued or under way: its L2 delete goes through the same queue, behind any such write, and
the entry is marked discarded so that a write not yet sent is skipped. The engine thread never
waits for the cache process there.

No lock of its own: PrefixCache's one lock (cache/tiers.py) guards the queue's counters, the
entries' pending / evicted / discarded flags and the counters, so a write's outcome and its
entry's flags change in one step. It is never held across a round trip or an encode.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING, Any

from . import snapshot as fmt
from .client import CacheClient
from .l1 import L1Entry
from .marks import L2Marks

if TYPE_CHECKING:
    from .tiers import PrefixCacheStats

log = logging.getLogger("dflash.cache")


class L2Writer:
    """The writer thread and its queue. Methods marked "(Lock held.)" run under PrefixCache's
    lock; the others take it themselves."""

    def __init__(self, l2: CacheClient | None, lock: threading.Lock, stats: PrefixCacheStats,
                 marks: L2Marks, max_pending_writes: int, l2_max_bytes: int | None):
        self.l2 = l2
        self.lock = lock
        self.stats = stats
        self.marks = marks
        self.l2_max_bytes = l2_max_bytes  # the cache process's size limit: larger ones are refused
        # The work, in order: ("put", key, body, entry) and ("delete", key, None, None).
        # Unbounded: puts are bounded by max_pending_writes (counted in queued_puts), deletes are
        # never refused (one per discard) so that a discard always follows the writes before it.
        self.queue: queue.Queue[tuple[str, str, dict[str, Any] | None, L1Entry | None]] = queue.Queue()
        self.max_pending_writes = max_pending_writes
        self.queued_puts = 0
        self.thread: threading.Thread | None = None
        self.closed = False  # close(): nothing more is queued
        # keys whose discard's L2 delete is queued (-> how many): not asked of L2 until it ran
        self.deleting: dict[str, int] = {}

    def write(self, key: str, entry: L1Entry) -> None:
        """Queue a write-behind of `entry`, unless L2 is absent, could never hold it, or writes
        pile up (then dropped, counted: the entry stays not in L2 and is spilled on eviction).

        `entry.in_l2` turns True only when the cache process acknowledged the write, so a write
        that never landed (process down, queue full, refused) leaves the entry to be spilled
        when L1 evicts it, instead of being lost from both tiers."""
        with self.lock:
            if not self.claim(entry):
                return
        self.send(key, entry)

    def claim(self, entry: L1Entry) -> bool:
        """(Lock held.) True when the caller is to write `entry` now; it is then `pending`."""
        if self.l2 is None or self.closed or entry.in_l2 or entry.pending:
            return False
        if self.l2_max_bytes is not None and entry.nbytes > self.l2_max_bytes:
            self.stats.l2_too_large += 1  # the cache process would refuse it: not encoded, not sent
            return False
        entry.pending = True
        return True

    def send(self, key: str, entry: L1Entry) -> None:
        """Hand a claimed entry's body to the writer thread (outside the lock: body() is MLX work)."""
        try:
            body = entry.value.body()
        except Exception:  # an encoding bug must not break generation; L1 still serves
            log.exception("could not encode snapshot %s", key)
            with self.lock:
                self._write_failed(key, entry)
            return
        with self.lock:
            # closed since the claim: the writer thread may have stopped (or never started: none
            # is started now, close() would not end it), so nothing is queued
            full = self.closed or self.queued_puts >= self.max_pending_writes
            if full:
                self._write_failed(key, entry)
            else:
                self._start()
                self.queued_puts += 1
                self.queue.put_nowait(("put", key, body, entry))  # under the lock: never behind close()'s stop

    def claim_delete(self, key: str) -> bool:
        """(Lock held.) A discard of `key`: True when its L2 delete is to be sent (`send_delete`);
        until it ran, `key` is in `deleting` and lookups do not ask L2 for it."""
        if self.l2 is None or self.closed:
            return False
        self.deleting[key] = self.deleting.get(key, 0) + 1
        self._start()
        return True

    def send_delete(self, key: str) -> None:
        """Queue a claimed delete behind every write queued before it (never waits)."""
        with self.lock:
            if self.closed:  # closed since the claim: the writer thread may have stopped
                self._deleted(key)
            else:
                self.queue.put_nowait(("delete", key, None, None))

    def wait(self, timeout: float | None = None) -> bool:
        """Wait (up to `timeout` s) until every queued write and delete was handled by the cache
        process (or failed)."""
        q = self.queue
        with q.all_tasks_done:
            return q.all_tasks_done.wait_for(lambda: q.unfinished_tasks == 0, timeout)

    def ping(self) -> bool:
        """A round trip through the writer's client, behind the writes it sent (False while it
        rests after a write that failed or timed out)."""
        return self.l2 is not None and self.l2.ping()

    def close(self, timeout: float | None = 30.0) -> bool:
        """Stop the writer thread once what is queued has been handled, and close its client.
        True when it finished in `timeout` s (else the thread, a daemon one, is left to end
        with the process). For owners that make PrefixCaches and drop them (the benchmark):
        each left its thread and socket behind."""
        with self.lock:
            stop = not self.closed and self.thread is not None
            self.closed = True  # from here on nothing is claimed or queued (send, send_delete)
            if stop:
                self.queue.put_nowait(("stop", "", None, None))  # behind everything queued
        done = True
        if self.thread is not None:
            self.thread.join(timeout)
            done = not self.thread.is_alive()
        if done and self.l2 is not None:
            self.l2.close()
        return done

    def _start(self) -> None:
        """(Lock held.)"""
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name="dflash-l2-writer", daemon=True)
            self.thread.start()

    def _write_failed(self, key: str, entry: L1Entry) -> None:
        """(Lock held.) A write that did not land. An entry L1 still holds is spilled again when
        evicted; one L1 evicted while this write was in flight is in neither tier now: counted
        as lost and logged, never left looking stored (its in_l2 stays False)."""
        entry.pending = False
        self.stats.l2_dropped_writes += 1
        if entry.evicted:
            self.stats.l2_lost_writes += 1
            log.warning("snapshot %s was evicted from L1 while its L2 write was in flight, and the "
                        "write failed: it is in neither tier", key)

    def _loop(self) -> None:
        """The writer thread: the queued writes and deletes, handled by the cache process in
        order; an entry counts as in L2 once the process acknowledged its write."""
        while True:
            op, key, body, entry = self.queue.get()
            if op == "stop":  # close(): everything queued before it was handled
                self.queue.task_done()
                return
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
                self.queue.task_done()

    def _delete(self, key: str) -> None:
        """(Writer thread.) A discard's delete, behind every write queued before it."""
        assert self.l2 is not None
        try:
            if not self.l2.delete(key):
                log.warning("could not delete discarded snapshot %s from L2 (cache process not "
                            "available): a lookup that finds it drops it again", key)
        finally:
            with self.lock:
                self._deleted(key)

    def _deleted(self, key: str) -> None:
        """(Lock held.) One claimed delete of `key` is over: lookups may ask L2 for it again."""
        left = self.deleting.pop(key) - 1
        if left:
            self.deleting[key] = left

    def _store(self, key: str, body: dict[str, Any], entry: L1Entry) -> None:
        """(Writer thread.) Encode and write one snapshot, then record the outcome and what the
        cache process evicted for it."""
        with self.lock:
            self.queued_puts -= 1
            if entry.discarded:  # discarded while queued: never sent (its delete follows)
                entry.pending = False
                self.stats.l2_discarded_writes += 1
                return
            epoch = self.marks.epoch  # before the request: see L2Marks.store_seen
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
            with self.lock:  # the outcome and the flags together: a spill sees one or the other
                same_store = self.marks.store_seen(store, epoch)  # first: it may clear every mark
                self.marks.evicted_from_l2(evicted)
                if too_large:
                    self.stats.l2_too_large += 1
                    entry.pending = False
                elif ok:
                    entry.pending = False
                    self.stats.l2_writes += 1
                    if entry.discarded:  # landed after its discard: the queued delete removes it
                        self.stats.l2_discarded_writes += 1
                    else:  # unless it may have landed in a store that is gone by now
                        entry.in_l2 = same_store
                else:
                    self._write_failed(key, entry)
