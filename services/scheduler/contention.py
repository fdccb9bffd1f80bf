"""The contention policy: who makes room when an executor runs out of pages or slots.

KV pages (docs/operations.md "Under memory pressure"): an allocation the free pages cannot meet first
evicts persistent, unpinned exports, the least recently used first (`export_victims`), as few as it takes,
counting only the pages eviction really frees; only then does it preempt. Preemption: instances are
ordered by `rank`, their best stream priority first, then launch order (older first). A requester that
cannot get its pages preempts instances ranked after it, the last-ranked first (`preemption_victims`):
their unshared pages go to host swap (or, when the swap space is full, the victim is evicted). Nobody is
preempted for the sake of an instance ranked after it. A requester that cannot be served that way waits (the admission queue)
instead of failing; parked instances resume in rank order as pages free up.

Embedding slots (no swap): the newest instance launched *after* the requester on the same executor
(holding at least one slot) is evicted; repeat until there is room. With nobody newer to evict, the
requester itself fails.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING

from l4m.scheduler.batcher import PRIORITY_LEVEL
from l4m.scheduler.instances import Instance

if TYPE_CHECKING:
    from l4m.scheduler.exports import Export


def choose_victim(requester: Instance, candidates: Iterable[Instance], *, kind_is_kv_page: bool,
                  claiming: Collection[Instance] = ()) -> Instance | None:
    """The newest instance launched after `requester` that holds something to free, else None. `claiming`:
    instances whose allocates in the batch being built take some (they count as holding)."""
    victim: Instance | None = None
    requester_key = requester.launch_key
    for candidate in candidates:
        if candidate is requester or not candidate.is_alive or candidate.launch_key <= requester_key:
            continue
        held = candidate.table.kv_pages if kind_is_kv_page else candidate.table.embed_slots
        if (held or candidate in claiming) and (victim is None or candidate.launch_key > victim.launch_key):
            victim = candidate
    return victim


def rank(instance: Instance) -> tuple[int, int, int]:
    """Who goes first under memory pressure (smaller first): the instance's most urgent stream priority
    level (HIGH 0, NORMAL 1, LOW 2; NORMAL without streams), then its launch order."""
    level = min((stream.level for stream in instance.streams.values()), default=PRIORITY_LEVEL[2])
    return (level, *instance.launch_key)


def preemption_victims(requester: Instance, candidates: Iterable[Instance], *,
                       claiming: Collection[Instance] = ()) -> list[Instance]:
    """Who may be preempted for `requester`, the last-ranked first: live instances ranked after it, not
    suspended already, that hold kv pages or claim some in the batch being built (`claiming`)."""
    own = rank(requester)
    victims = [c for c in candidates if c is not requester and c.is_alive and not c.is_suspended
               and (c.table.kv_pages or c in claiming) and rank(c) > own]
    victims.sort(key=rank, reverse=True)
    return victims


def export_victims(candidates: Iterable[Export], refcount: Callable[[int], int],
                   num_pages: int) -> tuple[list[Export], int]:
    """Which evictable exports (`candidates`, least recently used first) to evict so that `num_pages` pages
    free up, and how many pages that frees. A page frees only when the chosen exports hold every
    reference to it (`refcount`): one an importer maps, another export names or a live exporter still
    holds frees nothing. Takes them in order until enough pages free, then leaves out each chosen one that
    frees nothing (it only shares pages that stay held). Fewer pages than `num_pages` when all the
    candidates together free fewer."""
    chosen: list[Export] = []
    dropped: dict[int, int] = {}  # page -> references the chosen exports hold on it
    num_freed = 0
    for export in candidates:
        if num_freed >= num_pages:
            break
        chosen.append(export)
        for page in export.physical_page_ids:
            dropped[page] = dropped.get(page, 0) + 1
            num_freed += dropped[page] == refcount(page)
    freed = {page for page, count in dropped.items() if count == refcount(page)}
    return [e for e in chosen if freed.intersection(e.physical_page_ids)], num_freed
