"""The per-user quota of persistent export pages (`--max-export-pages-per-user`): persistent exports
outlive their instances, so one user cannot pin the pages every other launch needs."""

from __future__ import annotations

import pytest

from l4m.scheduler import requests as rq
from l4m.scheduler.__main__ import parse_config
from l4m.v1 import l4m_pb2

TRAP = l4m_pb2


def test_the_flag_reaches_the_config_and_refuses_negatives() -> None:
    config, _ = parse_config(["--executor", "127.0.0.1:1", "--max-export-pages-per-user", "12"])
    assert config.max_export_pages_per_user == 12
    assert parse_config(["--executor", "127.0.0.1:1"])[0].max_export_pages_per_user is None
    with pytest.raises(SystemExit):
        parse_config(["--executor", "127.0.0.1:1", "--max-export-pages-per-user", "-1"])


async def test_persistent_exports_are_capped_per_user(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(config={"max_export_pages_per_user": 4})
    a, sink_a = h.open(user="alice")
    h.send(a, rq.allocate([0, 1, 2, 3, 4]), rq.export("p", [0, 1, 2], persistent=True),
           rq.export("again", [1, 2, 3], persistent=True),  # pages 1 and 2 count once: 4 in all
           rq.export("temporary", [4]))  # not persistent: it goes with its exporter, no quota
    await h.settle()
    assert a.is_alive and h.scheduler.exports.num_persistent_pages("alice") == 4
    h.send(a, rq.export("one-more", [4], persistent=True, request_id=9))
    await h.settle()
    trap = sink_a.trap
    assert trap is not None and trap.kind == TRAP.TRAP_KIND_RESOURCE_EXHAUSTED and trap.offending_request_id == 9
    assert "quota of 4" in trap.reason and "--max-export-pages-per-user" in trap.reason, trap.reason
    assert h.free_pages() == 64 - 4  # the exporter's own pages are back; its persistent exports stay
    b, sink_b = h.open(user="alice")
    h.send(b, rq.unexport("again"), rq.allocate([0]), rq.export("fits", [0], persistent=True))
    await h.settle()
    assert b.is_alive and h.scheduler.exports.num_persistent_pages("alice") == 4
    c, sink_c = h.open(user="bob")  # another user has a quota of its own
    h.send(c, rq.allocate(list(range(8))), rq.export("bobs", [0, 1, 2, 3], persistent=True))
    await h.settle()
    assert c.is_alive and h.scheduler.exports.num_persistent_pages("bob") == 4


async def test_the_default_export_quota_is_half_an_executor_and_zero_is_unlimited(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory()  # 64 pages
    a, sink_a = h.open()
    h.send(a, rq.allocate(list(range(33))), rq.export("half", list(range(32)), persistent=True))
    h.send(a, rq.export("more", [32], persistent=True))
    await h.settle()
    assert sink_a.trap is not None and "quota of 32" in sink_a.trap.reason
    h.scheduler.destroy_instance(a.instance_id, "done")
    b, _ = h.open(user="another")
    h.send(b, rq.allocate(list(range(32))))
    await h.settle()
    assert b.is_alive and h.free_pages() == 0
    unlimited = harness_factory(config={"max_export_pages_per_user": 0})
    d, _ = unlimited.open()
    d_pages = list(range(64))
    unlimited.send(d, rq.allocate(d_pages), rq.export("all", d_pages, persistent=True))
    await unlimited.settle()
    assert d.is_alive and unlimited.scheduler.exports.num_persistent_pages(d.user) == 64


async def test_exports_lost_with_their_executor_leave_the_quota(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(config={"max_export_pages_per_user": 2})
    a, _ = h.open()
    h.send(a, rq.allocate([0, 1]), rq.export("p", [0, 1], persistent=True))
    await h.settle()
    h.links[0].lose("gone")
    h.links[0].reconnect()
    assert h.scheduler.exports.num_persistent_pages(a.user) == 0
    b, _ = h.open()
    h.send(b, rq.allocate([0, 1]), rq.export("p", [0, 1], persistent=True))
    await h.settle()
    assert b.is_alive
