"""Pools, refcounts, tables, exports and the contention victim rule, as plain objects."""

from __future__ import annotations

import pytest

from l4m.scheduler.contention import choose_victim
from l4m.scheduler.errors import AlreadyRegistered
from l4m.scheduler.exports import Export, ExportTable
from l4m.scheduler.instances import Instance, InstanceRegistry, InstanceState
from l4m.scheduler.resources import RefCountedPool, ResourceTable


def test_pool_allocates_lowest_ids_first_and_counts() -> None:
    pool = RefCountedPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.num_free == 2 and pool.num_used == 2
    assert pool.can_allocate(2) and not pool.can_allocate(3)
    with pytest.raises(ValueError):
        pool.allocate(3)


def test_release_frees_only_at_last_reference() -> None:
    pool = RefCountedPool(4)
    ids = pool.allocate(2)
    pool.retain(ids)
    assert pool.refcount(0) == 2
    assert pool.release(ids) == []
    assert pool.num_free == 2
    assert pool.release(ids) == [0, 1]
    assert pool.num_free == 4
    assert pool.allocate(1) == [0]


def test_release_or_retain_of_free_id_is_an_error() -> None:
    pool = RefCountedPool(2)
    with pytest.raises(ValueError):
        pool.release([1])
    with pytest.raises(ValueError):
        pool.retain([1])


def test_table_clear_returns_held_physical_ids() -> None:
    table = ResourceTable()
    table.kv_pages.update({10: 3, 11: 4})
    table.embed_slots[5] = 9
    assert table.clear() == ([3, 4], [9])
    assert table.is_empty()


def test_export_table_lifecycle() -> None:
    exports = ExportTable()
    a = Export("a", 0, (1, 2), False, b"m", "i1", "alice")
    exports.add(a)
    exports.add(Export("b", 1, (3,), True, b"", "i1", "alice"))
    assert not exports.can_add("a", "alice", is_public=False)
    with pytest.raises(ValueError):
        exports.add(Export("a", 0, (5,), False, b"", "i2", "alice"))
    assert [e.name for e in exports.owned_by("i1", is_persistent=False)] == ["a"]
    assert [e.name for e in exports.on_executor(1)] == ["b"]
    assert exports.remove(a).physical_page_ids == (1, 2)
    assert len(exports) == 1


def test_export_names_are_per_user_and_private_ones_are_invisible_to_others() -> None:
    exports = ExportTable()
    private = Export("p", 0, (1,), False, b"", "i1", "alice")
    public = Export("q", 0, (2,), False, b"", "i1", "alice", is_public=True)
    exports.add(private)
    exports.add(public)
    assert exports.find("p", "alice") is private and exports.find("p", "bob") is None
    assert exports.find("q", "bob") is public
    assert exports.find("p", "bob", is_admin=True) is private
    assert exports.can_add("p", "bob", is_public=False)  # bob's own namespace: alice's "p" is not revealed
    assert not exports.can_add("q", "bob", is_public=True)  # one namespace of public names
    assert [e.name for e in exports.visible_to("bob", False)] == ["q"]
    assert {e.name for e in exports.visible_to("alice", False)} == {"p", "q"}
    exports.remove(public)
    assert exports.find("q", "bob") is None and exports.can_add("q", "bob", is_public=True)


def test_frozen_pages_thaw_only_when_freed() -> None:
    pool = RefCountedPool(4)
    ids = pool.allocate(2)
    pool.retain(ids)
    pool.freeze(ids)
    assert pool.release(ids) == [] and all(pool.is_frozen(i) for i in ids)
    assert sorted(pool.release(ids)) == sorted(ids)
    assert not any(pool.is_frozen(i) for i in ids)


def _alive(instance_id: str, launched_at: int, seq: int, pages: int) -> Instance:
    instance = Instance(instance_id, instance_id + "-token", 0, launched_at, seq)
    instance.state = InstanceState.ACTIVE
    instance.table.kv_pages.update({v: v for v in range(pages)})
    return instance


def test_victim_is_the_newest_instance_launched_after_the_requester() -> None:
    old, requester, newer, newest = (_alive("old", 1, 1, 2), _alive("req", 2, 2, 2), _alive("new", 3, 3, 2),
                                     _alive("newest", 4, 4, 2))
    candidates = [old, requester, newer, newest]
    assert choose_victim(requester, candidates, kind_is_kv_page=True) is newest
    newest.state = InstanceState.ENDED
    assert choose_victim(requester, candidates, kind_is_kv_page=True) is newer
    assert choose_victim(newest, candidates, kind_is_kv_page=True) is None  # nobody newer: requester fails


def test_victim_must_hold_something_of_the_kind_and_ties_break_on_registration_order() -> None:
    requester = _alive("req", 5, 1, 1)
    empty = _alive("empty", 9, 2, 0)
    same_ms_later = _alive("later", 5, 3, 1)
    assert choose_victim(requester, [requester, empty, same_ms_later], kind_is_kv_page=True) is same_ms_later
    assert choose_victim(requester, [requester, empty, same_ms_later], kind_is_kv_page=False) is None


def test_registry_rejects_duplicate_ids_and_tokens() -> None:
    registry = InstanceRegistry()
    registry.register("a", "tok-a", 0, 1)
    assert not registry.can_register("a", "other")
    assert not registry.can_register("b", "tok-a")
    with pytest.raises(AlreadyRegistered):
        registry.register("a", "x", 0, 1)
    assert registry.by_token("tok-a").instance_id == "a"  # type: ignore[union-attr]
    registry.remove("a")
    assert registry.by_token("tok-a") is None
