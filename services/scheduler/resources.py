"""Physical resource pools of one executor and the virtual→physical tables of one instance.

Physical ids are `0 .. capacity - 1` on their executor. A physical id is *held* by reference: each
instance table entry and each export naming it counts one. It returns to the free list when its last
holder lets go (`release` reports which ids did, so the caller can tell the executor).

A KV page may be *frozen* (read-only): an exported page is, from its export until it is freed, so that
what an importer reads never changes under it (see `Scheduler._check_writable`).

Host swap slots (`swap_slots`) hold the pages of preempted instances (see `Scheduler._preempt`): one
reference each, never shared. A preempted instance's table maps those virtual page ids to swap slots
(`swapped_kv_pages`) instead of physical pages until it resumes.
"""

from __future__ import annotations

from collections.abc import Iterable


class RefCountedPool:
    """Free list plus reference counts for one kind of physical resource on one executor."""

    __slots__ = ("capacity", "_free", "_refcounts", "_frozen")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._frozen: set[int] = set()
        # Popped from the end: the lowest ids are handed out first.
        self._free = list(range(capacity - 1, -1, -1))
        self._refcounts = [0] * capacity

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def refcount(self, physical_id: int) -> int:
        return self._refcounts[physical_id]

    def freeze(self, physical_ids: Iterable[int]) -> None:
        """Make held ids read-only until they are freed."""
        self._frozen.update(physical_ids)

    def is_frozen(self, physical_id: int) -> bool:
        return physical_id in self._frozen

    @property
    def has_frozen(self) -> bool:
        return bool(self._frozen)

    def can_allocate(self, num_ids: int) -> bool:
        return num_ids <= len(self._free)

    def allocate(self, num_ids: int) -> list[int]:
        """Take `num_ids` free ids, each with one reference. Check `can_allocate` first."""
        if num_ids > len(self._free):
            raise ValueError(f"asked for {num_ids} ids, {len(self._free)} free")
        ids = self._free[len(self._free) - num_ids :]
        del self._free[len(self._free) - num_ids :]
        ids.reverse()
        refcounts = self._refcounts
        for physical_id in ids:
            refcounts[physical_id] = 1
        return ids

    def retain(self, physical_ids: Iterable[int]) -> None:
        """Add one reference to each id (an import or an export takes a share)."""
        refcounts = self._refcounts
        for physical_id in physical_ids:
            if refcounts[physical_id] <= 0:
                raise ValueError(f"retain of free id {physical_id}")
            refcounts[physical_id] += 1

    def release(self, physical_ids: Iterable[int]) -> list[int]:
        """Drop one reference from each id; returns the ids that became free."""
        refcounts = self._refcounts
        freed = []
        for physical_id in physical_ids:
            count = refcounts[physical_id] - 1
            if count < 0:
                raise ValueError(f"release of free id {physical_id}")
            refcounts[physical_id] = count
            if count == 0:
                freed.append(physical_id)
                self._frozen.discard(physical_id)
        self._free.extend(reversed(freed))
        return freed


class ExecutorResources:
    """The KV pages, embedding slots and host swap slots of one executor."""

    __slots__ = ("kv_pages", "embed_slots", "swap_slots")

    def __init__(self, num_kv_pages: int, num_embed_slots: int, num_swap_slots: int = 0) -> None:
        self.kv_pages = RefCountedPool(num_kv_pages)
        self.embed_slots = RefCountedPool(num_embed_slots)
        self.swap_slots = RefCountedPool(num_swap_slots)


class ResourceTable:
    """One instance's virtual→physical maps. Virtual ids are the controller's; no other instance can
    name them, so an instance can only reach physical ids listed here."""

    __slots__ = ("kv_pages", "embed_slots", "swapped_kv_pages")

    def __init__(self) -> None:
        self.kv_pages: dict[int, int] = {}
        self.embed_slots: dict[int, int] = {}
        # Virtual kv page id -> host swap slot, while the instance is preempted (its unshared pages).
        self.swapped_kv_pages: dict[int, int] = {}

    def is_empty(self) -> bool:
        return not self.kv_pages and not self.embed_slots and not self.swapped_kv_pages

    def clear(self) -> tuple[list[int], list[int]]:
        """Forget every page and slot mapping; returns the physical (pages, slots) that were held. Swapped
        pages stay (`clear_swapped`)."""
        pages, slots = list(self.kv_pages.values()), list(self.embed_slots.values())
        self.kv_pages.clear()
        self.embed_slots.clear()
        return pages, slots

    def clear_swapped(self) -> list[int]:
        """Forget the swapped pages; returns the swap slots that held them."""
        slots = list(self.swapped_kv_pages.values())
        self.swapped_kv_pages.clear()
        return slots
