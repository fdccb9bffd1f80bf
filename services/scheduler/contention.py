"""The contention policy: who makes room when an executor runs out of pages or slots.

Older instances win. When a requester cannot get what it asks for, the newest instance launched
*after* it on the same executor (holding at least one resource of the kind that ran out) is evicted;
repeat until there is room. With nobody newer to evict, the requester itself fails.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from l4m.scheduler.instances import Instance


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
