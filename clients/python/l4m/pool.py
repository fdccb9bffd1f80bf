"""Virtual id pool with reference counts.

A controller chooses the ids of its KV pages and embedding slots. The pool hands out the smallest
free ids (so ids stay small and dense, as Pie's `RcResourcePool`), counts how many holders share each
id (a forked Context shares its full pages), and tells the caller which ids reached zero holders: only
those are deallocated on the wire.

Quarantine: the scheduler translates ids when a command leaves its stream, and streams run
independently, so an id deallocated on stream A and allocated again on stream B could be allocated
before A's deallocate ran. Ids released with a quarantine key (the stream they were deallocated on)
are reusable at once by that same key (same stream: FIFO), and by everyone after `unquarantine(key)`
(called when a reply shows that stream got past the deallocate).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable


class IdPool:
    """Smallest-free-first ids in `[0, capacity)` with per-id reference counts."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._next_fresh = 0  # ids >= this were never handed out
        self._free_heap: list[int] = []
        self._refcounts: dict[int, int] = {}
        self._quarantine: dict[Hashable, list[int]] = {}

    @property
    def num_in_use(self) -> int:
        return len(self._refcounts)

    @property
    def num_quarantined(self) -> int:
        return sum(len(ids) for ids in self._quarantine.values())

    def can_acquire(self, count: int, key: Hashable | None = None) -> bool:
        num_own = len(self._quarantine.get(key, ())) if key is not None else 0
        return len(self._free_heap) + (self.capacity - self._next_fresh) + num_own >= count

    def acquire(self, count: int, key: Hashable | None = None) -> list[int]:
        """Take `count` ids (refcount 1 each): the key's quarantined ids first, then the smallest free."""
        if not self.can_acquire(count, key):
            raise OverflowError(
                f"asked for {count} ids with {self.num_in_use} of {self.capacity} in use; "
                "free contexts you no longer need"
            )
        own = sorted(self._quarantine.pop(key, [])) if key is not None else []
        ids = own[:count]
        for id_ in own[count:]:
            self._quarantine.setdefault(key, []).append(id_)
        for _ in range(count - len(ids)):
            if self._free_heap:
                ids.append(heapq.heappop(self._free_heap))
            else:
                ids.append(self._next_fresh)
                self._next_fresh += 1
        for id_ in ids:
            self._refcounts[id_] = 1
        return ids

    def retain(self, ids: Iterable[int]) -> None:
        """Add one holder to each id (a fork sharing pages)."""
        for id_ in ids:
            if id_ not in self._refcounts:
                raise KeyError(f"id {id_} is not in use")
            self._refcounts[id_] += 1

    def release(self, ids: Iterable[int], quarantine: Hashable | None = None) -> list[int]:
        """Drop one holder from each id; returns the ids nobody holds any more (to deallocate)."""
        freed = []
        for id_ in ids:
            count = self._refcounts.get(id_)
            if count is None:
                raise KeyError(f"id {id_} is not in use")
            if count == 1:
                del self._refcounts[id_]
                if quarantine is None:
                    heapq.heappush(self._free_heap, id_)
                else:
                    self._quarantine.setdefault(quarantine, []).append(id_)
                freed.append(id_)
            else:
                self._refcounts[id_] = count - 1
        return freed

    def unquarantine(self, key: Hashable) -> None:
        """The deallocations made under `key` are done: their ids are free for everyone."""
        for id_ in self._quarantine.pop(key, []):
            heapq.heappush(self._free_heap, id_)

    def refcount(self, id_: int) -> int:
        return self._refcounts.get(id_, 0)
