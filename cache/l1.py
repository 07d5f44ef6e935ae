"""L1: the worker's in-RAM tier. An LRU map with a byte budget and an entry budget.

Values are opaque (live engine snapshots); the caller states each entry's size. `put` returns
what it evicted so the caller can spill those entries to L2 instead of losing them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class L1Entry:
    n_tokens: int
    value: Any
    nbytes: int
    in_l2: bool = False  # in L2: the cache process acknowledged its write, or it came from L2
    pending: bool = False  # a write to L2 is queued or under way (its outcome not known yet)
    evicted: bool = False  # L1 let it go: a failed write of it now loses it from both tiers
    discarded: bool = False  # dropped as unfit (PrefixCache.discard): a write of it must not stay


class L1:
    """Least-recently-used entries within max_bytes and max_entries."""

    def __init__(self, max_bytes: int, max_entries: int):
        if max_bytes < 0 or max_entries < 0:
            raise ValueError("L1 budgets must be >= 0")
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._entries: OrderedDict[str, L1Entry] = OrderedDict()
        self.bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> L1Entry | None:
        """The entry under `key`, now most recently used; None when absent."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def peek(self, key: str) -> L1Entry | None:
        """The entry under `key`, its place in the LRU order untouched; None when absent."""
        return self._entries.get(key)

    def values(self) -> list[L1Entry]:
        return list(self._entries.values())

    def put(self, key: str, entry: L1Entry) -> list[tuple[str, L1Entry]]:
        """Store `entry` (replacing any old one) and evict LRU entries until within budget.

        An entry larger than the whole byte budget is not stored: it comes back as evicted.
        """
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes
        if entry.nbytes > self.max_bytes or self.max_entries == 0:
            return [(key, entry)]
        self._entries[key] = entry
        self.bytes += entry.nbytes
        evicted = []
        while self.bytes > self.max_bytes or len(self._entries) > self.max_entries:
            k, e = self._entries.popitem(last=False)
            self.bytes -= e.nbytes
            self.evictions += 1
            evicted.append((k, e))
        return evicted

    def pop(self, key: str) -> L1Entry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry.nbytes
        return entry

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0
