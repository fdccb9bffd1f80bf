"""Exports under memory pressure, over a simulated executor: an allocation the free pages cannot meet first
evicts persistent, unpinned exports, least recently used first (exported or imported; listing is not a
use), as few as it takes and counting only the pages that really free; pinned ones stay; importers keep
their pages; an evicted name is gone like a missing one; the metrics."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from l4m.scheduler import contention
from l4m.scheduler import requests as rq
from l4m.scheduler.exports import Export
from l4m.scheduler.simulated import next_token
from l4m.v1 import l4m_pb2

TRAP = l4m_pb2
UNLIMITED = {"max_export_pages_per_user": 0}


def _list(**kw: int) -> l4m_pb2.SessionRequest:
    return rq.request(list_exports=l4m_pb2.ListExportsCommand(), **kw)


def _names(h) -> set[str]:  # type: ignore[no-untyped-def]
    return {e.name for e in h.scheduler.exports.all()}


async def _publish(h, exports: dict[str, list[int]], pinned: tuple[str, ...] = ()) -> None:  # type: ignore[no-untyped-def]
    """An instance fills the pages, exports them persistent (in this order: the first is the least recently
    used) and ends: the exports alone hold the pages."""
    owner, _ = h.open()
    pages = sorted({p for ids in exports.values() for p in ids})
    h.send(owner, rq.allocate(pages), rq.forward_text(pages, 16, [3] * 16 * len(pages)))
    for name, ids in exports.items():
        h.send(owner, rq.export(name, ids, persistent=True, pinned=name in pinned))
    await h.settle()
    assert owner.is_alive
    h.scheduler.close_session(owner)
    await h.settle()


async def test_the_least_recently_used_export_goes_first_and_only_as_many_as_needed(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(num_kv_pages=8, num_swap_slots=8, config=UNLIMITED)
    await _publish(h, {"a": [0, 1], "b": [2, 3], "c": [4, 5]})
    await h.settle()
    reader, _ = h.open()
    h.send(reader, rq.import_pages("a", [0, 1]))  # an import is a use: "a" is the most recently used now
    await h.settle()
    h.scheduler.close_session(reader)
    await h.settle()
    assert h.free_pages() == 2
    requester, sink = h.open()
    h.send(requester, rq.allocate([0, 1, 2, 3]))  # 2 short: "b" is the least recently used now
    await h.settle()
    assert _names(h) == {"a", "c"} and requester.table.kv_pages.keys() == {0, 1, 2, 3} and h.free_pages() == 0
    h.send(requester, rq.allocate([4, 5]))
    await h.settle()
    assert _names(h) == {"a"} and sink.trap is None and not requester.is_parked
    counts = h.scheduler.metrics.counts()
    assert (counts["exports_evicted"], counts["export_kv_pages_evicted"], counts["preemptions"]) == (2, 4, 0)
    metrics = generate_latest(h.scheduler.metrics.registry).decode()
    assert "l4m_scheduler_exports_evicted_total 2.0" in metrics
    assert "l4m_scheduler_export_kv_pages_evicted_total 4.0" in metrics
    assert h.sim().num_errors == 0


async def test_exports_go_before_anyone_is_preempted_and_together_with_preemption(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(num_kv_pages=8, num_swap_slots=8, config=UNLIMITED)
    requester, sink = h.open("old")
    await _publish(h, {"e": [0, 1]})
    newer, _ = h.open("newer")
    h.send(newer, rq.allocate([0, 1, 2, 3]))
    await h.settle()
    h.send(requester, rq.allocate([0, 1, 2, 3]))  # 2 free + 2 from the export: nobody preempted
    await h.settle()
    assert not newer.is_parked and _names(h) == set() and h.scheduler.metrics.num_preemptions == 0
    h.send(requester, rq.deallocate([3]))
    await h.settle()
    await _publish(h, {"f": [0]})  # takes the page the requester returned
    await h.settle()
    assert h.free_pages() == 0
    h.send(requester, rq.allocate([3, 4, 5]))  # 1 from the export, 2 more from preempting "newer"
    await h.settle()
    assert _names(h) == set() and newer.is_suspended and requester.table.kv_pages.keys() == {0, 1, 2, 3, 4, 5}
    assert sink.trap is None and h.sim().num_errors == 0


async def test_nothing_is_evicted_when_everything_together_would_not_be_enough(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(num_kv_pages=8, num_swap_slots=8, config=UNLIMITED)
    await _publish(h, {"e": [0, 1]})
    older, _ = h.open("older")  # launched before the requester: it cannot be preempted for it
    h.send(older, rq.allocate([0, 1, 2, 3]))
    await h.settle()
    requester, sink = h.open("requester")
    h.send(requester, rq.allocate([0, 1, 2, 3, 4]))  # 2 free + 2 from the export < 5: it waits
    await h.settle()
    assert requester.is_waiting and _names(h) == {"e"} and sink.trap is None
    h.scheduler.close_session(older)  # now 6 free: enough without the export
    await h.settle()
    assert not requester.is_parked and _names(h) == {"e"} and h.scheduler.metrics.num_exports_evicted == 0


async def test_a_pinned_export_is_never_evicted_and_the_requester_preempts_or_waits(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(num_kv_pages=8, num_swap_slots=8, config=UNLIMITED)
    requester, sink = h.open("requester")
    await _publish(h, {"kept": [0, 1], "loose": [2, 3]}, pinned=("kept",))
    await h.settle()
    reader, reader_sink = h.open()
    h.send(reader, rq.import_pages("loose", [0, 1]), rq.deallocate([0, 1]),  # "kept" is the least recent now
           _list(request_id=3))
    await h.settle()
    listed = {e.name: e.pinned for e in reader_sink.of("list_exports")[0].list_exports.exports}
    assert listed == {"kept": True, "loose": False}
    h.send(requester, rq.allocate([0, 1, 2, 3, 4, 5]))
    await h.settle()
    assert _names(h) == {"kept"} and requester.table.kv_pages.keys() == set(range(6))
    newer, _ = h.open("newer")
    h.send(requester, rq.deallocate([5]))
    await h.settle()
    h.send(newer, rq.allocate([0]))
    await h.settle()
    h.send(requester, rq.allocate([5]))  # 0 free; "kept" is pinned: "newer" is preempted instead
    await h.settle()
    assert newer.is_suspended and requester.table.kv_pages.keys() == set(range(6)) and _names(h) == {"kept"}
    h.send(requester, rq.allocate([6, 7]))  # nobody left to preempt: it waits, "kept" stays
    await h.settle()
    assert requester.is_waiting and _names(h) == {"kept"} and sink.trap is None
    assert h.scheduler.metrics.num_exports_evicted == 1


async def test_shared_pages_are_not_counted_as_freed(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(num_kv_pages=8, num_swap_slots=8, config=UNLIMITED)
    # "short" and "long" share pages 0 and 1 (as the gateway's prefix entries do); "read" is imported below.
    await _publish(h, {"read": [4, 5], "short": [0, 1], "long": [0, 1, 2, 3]})
    await h.settle()
    importer, _ = h.open("importer")
    h.send(importer, rq.import_pages("read", [0, 1]))
    await h.settle()
    exports = h.scheduler.exports
    exports.touch(next(e for e in exports.all() if e.name == "short"))  # least recent: read, long, short
    requester, _ = h.open("requester")
    h.send(requester, rq.allocate([0, 1, 2, 3]))  # 2 free; "read" frees nothing, "long" pages 2 and 3 only
    await h.settle()
    assert _names(h) == {"read", "short"} and h.scheduler.metrics.num_export_pages_evicted == 2
    assert requester.table.kv_pages.keys() == {0, 1, 2, 3} and not requester.is_parked
    h.send(requester, rq.allocate([4, 5]))  # now "short" alone holds its two pages
    await h.settle()
    assert _names(h) == {"read"} and h.scheduler.metrics.num_export_pages_evicted == 4
    assert not importer.is_parked and importer.table.kv_pages.keys() == {0, 1}


async def test_a_page_a_live_exporter_holds_frees_nothing_and_non_persistent_exports_stay(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(num_kv_pages=8, num_swap_slots=8, config=UNLIMITED)
    requester, sink = h.open("requester")
    holder, _ = h.open("holder")
    h.send(holder, rq.allocate([0, 1, 2, 3]), rq.export("held", [0, 1], persistent=True),
           rq.export("temporary", [2, 3]), rq.deallocate([2, 3]))  # "temporary" alone holds pages 2 and 3
    await h.settle()
    h.send(requester, rq.allocate([0, 1, 2, 3, 4, 5]))
    await h.settle()
    # 4 free; "held" frees nothing (the holder maps its pages, frozen: not movable either), "temporary" is
    # not evictable: the requester waits, every export stays.
    assert requester.is_waiting and _names(h) == {"held", "temporary"} and sink.trap is None
    assert h.scheduler.metrics.num_exports_evicted == 0 and holder.is_alive


async def test_an_importer_keeps_its_pages_and_tokens_when_the_export_is_evicted(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(num_kv_pages=8, num_swap_slots=8, config=UNLIMITED)
    owner, owner_sink = h.open("owner")
    h.send(owner, rq.allocate([0, 1, 2, 3]), rq.forward_text([0, 1, 2, 3], 16, list(range(64))),
           rq.export("doc", [0, 1, 2, 3], persistent=True), rq.deallocate([0, 1, 2, 3]))
    await h.settle()
    importer, importer_sink = h.open("importer")
    h.send(importer, rq.import_pages("doc", [0, 1, 2, 3]), rq.deallocate([2, 3]))  # keeps the first two
    await h.settle()
    kept = dict(importer.table.kv_pages)
    contents = h.sim().contents(list(kept.values()))
    requester, _ = h.open("requester")
    h.send(requester, rq.allocate(list(range(5))))  # 4 free: the export goes, freeing the two nobody maps
    await h.settle()
    assert _names(h) == set() and h.scheduler.metrics.num_export_pages_evicted == 2
    assert importer.table.kv_pages == kept and h.sim().contents(list(kept.values())) == contents
    h.send(importer, rq.allocate([2]), rq.forward_text([0, 1, 2], 1, [9], positions=[32], outputs=[0]))
    await h.settle()
    await h.settle()
    assert importer_sink.trap is None and importer.is_alive
    outputs = importer_sink.of("forward_text")[0].forward_text.outputs
    assert [o.token.token_id for o in outputs] == [next_token(9, 32, 1000)]
    # The owner is not trapped; for it the name is gone like a missing one: not listed, import and unexport trap.
    assert owner.is_alive and owner_sink.trap is None
    h.send(owner, _list(request_id=5))
    await h.settle()
    assert [e.name for e in owner_sink.of("list_exports")[0].list_exports.exports] == []
    for command in (rq.import_pages("doc", [8, 9, 10, 11], request_id=6), rq.unexport("doc", request_id=6)):
        other, other_sink = h.open()
        h.send(other, command)
        await h.settle()
        assert other_sink.trap.kind == TRAP.TRAP_KIND_INVALID_COMMAND  # type: ignore[union-attr]
        assert "no export is named 'doc'" in other_sink.trap.reason  # type: ignore[union-attr]
    h.scheduler.close_session(importer)
    h.send(owner, rq.allocate([0]), rq.export("doc", [0], persistent=True))  # the name is free again
    await h.settle()
    assert owner.is_alive and _names(h) == {"doc"} and h.sim().num_errors == 0


async def test_pinned_pages_count_in_the_users_quota_and_evicted_ones_leave_it(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(num_kv_pages=8, num_swap_slots=8, config={"max_export_pages_per_user": 3})
    owner, sink = h.open(user="alice")
    h.send(owner, rq.allocate([0, 1, 2, 3]), rq.export("pinned", [0, 1], persistent=True, pinned=True),
           rq.export("loose", [2], persistent=True), rq.deallocate([0, 1, 2]))
    await h.settle()
    assert h.scheduler.exports.num_persistent_pages("alice") == 3 and owner.is_alive
    requester, _ = h.open(user="bob")
    h.send(requester, rq.allocate(list(range(5))))  # 4 free: "loose" goes, "pinned" stays
    await h.settle()
    h.send(requester, rq.deallocate([4]))
    assert _names(h) == {"pinned"} and h.scheduler.exports.num_persistent_pages("alice") == 2
    h.send(owner, rq.export("again", [3], persistent=True))  # fits again: 3 of 3
    await h.settle()
    assert owner.is_alive and h.scheduler.exports.num_persistent_pages("alice") == 3
    h.send(owner, rq.allocate([4]), rq.export("over", [4], persistent=True, pinned=True, request_id=7))
    await h.settle()
    assert sink.trap.kind == TRAP.TRAP_KIND_RESOURCE_EXHAUSTED and sink.trap.offending_request_id == 7  # type: ignore[union-attr]
    assert "--max-export-pages-per-user" in sink.trap.reason  # type: ignore[union-attr]


async def test_pinned_without_persistent_traps_only_its_exporter(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(num_kv_pages=8)
    bystander, bystander_sink = h.open()
    h.send(bystander, rq.allocate([0, 1]), rq.export("theirs", [0], persistent=True))
    exporter, sink = h.open()
    h.send(exporter, rq.allocate([0, 1, 2]), rq.export("mine", [0, 1], pinned=True, request_id=4))
    await h.settle()
    trap = sink.trap
    assert trap is not None and trap.kind == TRAP.TRAP_KIND_INVALID_COMMAND and trap.offending_request_id == 4
    assert "export 'mine': pinned applies to persistent exports only" in trap.reason, trap.reason
    assert _names(h) == {"theirs"} and h.free_pages() == 6  # the exporter's pages are back
    assert bystander.is_alive and bystander_sink.trap is None


@pytest.mark.parametrize(("refcounts", "needed", "evicted", "freed"), [
    ({0: 1, 1: 1, 2: 1, 3: 1}, 1, ["x"], 2),  # as few as it takes, the least recent first
    ({0: 1, 1: 1, 2: 1, 3: 1}, 3, ["x", "y"], 4),
    ({0: 2, 1: 2, 2: 1, 3: 1}, 2, ["y"], 2),  # x's pages are held twice (an importer): x frees nothing
    ({0: 1, 1: 1, 2: 1, 3: 1}, 9, ["x", "y"], 4),  # not enough: the caller evicts nothing
])
def test_export_victims_count_only_freed_pages(refcounts: dict[int, int], needed: int, evicted: list[str],
                                               freed: int) -> None:
    x = Export("x", 0, (0, 1), True, b"", "i", "u")
    y = Export("y", 0, (2, 3), True, b"", "i", "u")
    victims, num_freed = contention.export_victims([x, y], refcounts.__getitem__, needed)
    assert [v.name for v in victims] == evicted and num_freed == freed


def test_two_exports_of_one_page_free_it_only_together() -> None:
    short = Export("short", 0, (0,), True, b"", "i", "u")
    long = Export("long", 0, (0, 1), True, b"", "i", "u")
    refcounts = {0: 2, 1: 1}.__getitem__
    # The least recent first: "short" frees nothing alone, but page 0 together with "long".
    assert contention.export_victims([short, long], refcounts, 1) == ([short, long], 2)
    imported = {0: 3, 1: 1}.__getitem__  # an importer maps page 0 too: "short" frees nothing, it stays
    assert contention.export_victims([short, long], imported, 1) == ([long], 1)


async def test_an_import_with_missing_ok_answers_is_missing_and_maps_nothing(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(num_kv_pages=8)
    alice, _ = h.open(user="alice")
    h.send(alice, rq.allocate([0, 1]), rq.export("mine", [0, 1], persistent=True))
    await h.settle()
    bob, bob_sink = h.open(user="bob")
    for request_id, name in ((1, "never-made"), (2, "mine")):  # another user's private export: the same answer
        command = l4m_pb2.ImportKvPagesCommand(name=name, kv_page_ids=[0, 1], missing_ok=True)
        h.send(bob, rq.request(import_kv_pages=command, request_id=request_id))
    h.send(bob, rq.allocate([0, 1]))  # the ids were never mapped: still free
    await h.settle()
    replies = [e.import_kv_pages for e in bob_sink.of("import_kv_pages")]
    assert [r.is_missing for r in replies] == [True, True] and [r.num_kv_pages for r in replies] == [0, 0]
    assert bob.is_alive and bob_sink.trap is None and bob.table.kv_pages.keys() == {0, 1}
    reader, reader_sink = h.open(user="alice")
    command = l4m_pb2.ImportKvPagesCommand(name="mine", kv_page_ids=[4, 5], missing_ok=True)
    h.send(reader, rq.request(import_kv_pages=command, request_id=3))
    await h.settle()
    found = reader_sink.of("import_kv_pages")[0].import_kv_pages
    assert not found.is_missing and found.num_kv_pages == 2 and reader.table.kv_pages.keys() == {4, 5}


async def test_an_unexport_with_missing_ok_of_a_name_that_finds_nothing_does_nothing(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(num_kv_pages=8)
    alice, _ = h.open(user="alice")
    h.send(alice, rq.allocate([0, 1]), rq.export("mine", [0], persistent=True),
           rq.export("shared", [1], persistent=True, is_public=True))
    await h.settle()
    bob, bob_sink = h.open(user="bob")
    for name in ("never-made", "mine"):  # another user's private export: nothing happens to it either
        h.send(bob, rq.request(unexport_kv_pages=l4m_pb2.UnexportKvPagesCommand(name=name, missing_ok=True)))
    await h.settle()
    assert bob.is_alive and bob_sink.trap is None and _names(h) == {"mine", "shared"}
    # missing_ok changes nothing for an export the caller finds: another user's public one still refuses.
    h.send(bob, rq.request(unexport_kv_pages=l4m_pb2.UnexportKvPagesCommand(name="shared", missing_ok=True),
                           request_id=8))
    await h.settle()
    assert bob_sink.trap.kind == TRAP.TRAP_KIND_PERMISSION_DENIED and _names(h) == {"mine", "shared"}  # type: ignore[union-attr]
