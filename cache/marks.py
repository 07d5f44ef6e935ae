"""L2Marks: which L1 entries still count as in L2 (their `in_l2` mark), kept true to the store.

An L1 entry counts as in L2 once the cache process acknowledged its write (cache/writer.py) or
it came from L2, and only as long as L2 holds it: each acknowledgement lists the keys the cache
process evicted to make room (its LRU knows nothing of L1 hits), and those L1 entries lose the
mark, so L1 spills them again when it evicts them (a reply that never came may have evicted
anything: then no L1 entry keeps the mark). And only as long as the store is the one it was
stored in: each reply names its store's id (cache/l2.py: new when a store is created fresh,
repaired or cleared, kept across restarts on the same store); on another id every mark goes.

No lock of its own: every method runs under PrefixCache's one lock (cache/tiers.py), the lock
that also guards L1 and the counters, so a mark and the outcome that made or cleared it change
in one step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from .l1 import L1

if TYPE_CHECKING:
    from .tiers import PrefixCacheStats

log = logging.getLogger("dflash.cache")
MAX_GONE = 4096  # keys the cache process reported evicted, remembered for lookups under way


class L2Marks:
    """The eviction reports and the store id behind L1's in-L2 marks. (PrefixCache's lock held
    for every call and every attribute read.)"""

    def __init__(self, l1: L1, stats: PrefixCacheStats):
        self.l1 = l1
        self.stats = stats
        # Eviction reports from the cache process (one per answered write), for a lookup that
        # brings an entry from L2 while a write evicts it there: key -> the report that said so
        # (recent ones); a report at or below gone_floor may have evicted any key.
        self.reports = 0
        self.gone: OrderedDict[str, int] = OrderedDict()
        self.gone_floor = 0
        # The id of the L2 store the in-L2 marks were made under (None: none seen yet, or unknown),
        # and how many times it was taken up or dropped: a reply to a request sent before the
        # last such change may come from either store (see store_seen).
        self.store: str | None = None
        self.epoch = 0

    def evicted_from_l2(self, keys: list[str] | None) -> None:
        """The cache process evicted `keys` (None: maybe anything) to make room for a write:
        L1 entries under them are in L2 no more, and L1 spills them when it evicts them.
        Remembered for a lookup that is bringing one of them back from L2 right now."""
        self.reports += 1
        if keys is None:
            self.stats.l2_unanswered_writes += 1
            self.gone_floor = self.reports
            held = [e for e in self.l1.values() if e.in_l2]
        else:
            held = [e for k in keys if (e := self.l1.peek(k)) is not None and e.in_l2]
            for k in keys:
                self.gone[k] = self.reports
                self.gone.move_to_end(k)
            while len(self.gone) > MAX_GONE:
                _, report = self.gone.popitem(last=False)
                self.gone_floor = max(self.gone_floor, report)
        for e in held:
            e.in_l2 = False
            self.stats.l2_evicted_in_l1 += 1
        if held:
            log.info("L2 evicted %d snapshot(s) L1 holds: spilled again when L1 evicts them", len(held))

    def store_seen(self, store: Any, epoch: int) -> bool:
        """A reply names the L2 store that served it (`store`; None from a cache process that
        names none: marks as before); `epoch` was `self.epoch` when its request was sent. True
        when an in-L2 mark made from this reply holds.

        Another id than the marks' means the store is not the one they were made in (created
        fresh, repaired, cleared): every mark goes (L1 spills those entries when it evicts them
        instead of losing them). Ids are random, not ordered, so a reply is trusted to be the
        newest store only when no other id was taken up while its request was out (a request
        sent after a change is served by that store or a later one); otherwise it may be an
        older store's late reply or a newer one's: no mark is made from it and, should it differ,
        every mark goes and the next reply decides."""
        if not isinstance(store, str) or not store or store == self.store:
            return True
        if epoch != self.epoch:
            if self.store is not None:
                self._marks_gone(self.store, "not known yet")
                self.store = None
                self.epoch += 1
            return False
        if self.store is not None:
            self._marks_gone(self.store, store)
        self.store = store  # the first id seen (or the first after doubt): the marks are its
        self.epoch += 1
        return True

    def _marks_gone(self, old: str, new: str) -> None:
        """The L2 store changed: no L1 entry is known to be in it any more."""
        held = [e for e in self.l1.values() if e.in_l2]
        for e in held:
            e.in_l2 = False
        self.stats.l2_store_changed += 1
        self.stats.l2_evicted_in_l1 += len(held)
        # a warning when it cost something (after a `cache clear`, which empties L1 first, none)
        log.log(logging.WARNING if held else logging.INFO,
                "L2 store changed (id %s, now %s): %d snapshot(s) L1 holds no longer count as in L2 "
                "and are written there again when L1 evicts them", old, new, len(held))

    def gone_since(self, key: str, mark: int) -> bool:
        """Whether an eviction report after report `mark` may have named `key`."""
        return self.gone_floor > mark or self.gone.get(key, 0) > mark
