"""Blame the offender alone: conflicts inside one instance's forward batch items are trapped before
sending, a batch the executor rejects traps the item it names and is sent again without it, and the
fire-and-forget batches are tracked until they are known to have run."""

from __future__ import annotations

import asyncio

from l4m.scheduler import requests as rq
from l4m.scheduler.simulated import next_token
from l4m.v1 import executor_pb2, l4m_pb2

TRAP = l4m_pb2


def _tokens(sink) -> list[int]:  # type: ignore[no-untyped-def]
    return [o.token.token_id for e in sink.of("forward_text") for o in e.forward_text.outputs]


def _forget_item_index(h) -> None:  # type: ignore[no-untyped-def]
    """Make the simulated executor's errors name no item (as a batch-level refusal does)."""
    sim = h.sim()
    execute = sim.execute

    def execute_without_index(request: executor_pb2.ExecuteRequest) -> executor_pb2.ExecuteResponse | None:
        response = execute(request)
        if response is not None and response.WhichOneof("result") == "error":
            response.error.has_item_index = False
            response.error.item_index = 0
        return response

    sim.execute = execute_without_index


async def test_two_streams_of_one_instance_writing_one_slot_trap_that_instance_before_sending(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory()
    h.links[0].keep_sent = True
    a, sink_a = h.open()
    b, sink_b = h.open()
    h.send(a, rq.allocate([4]))
    h.send(b, rq.allocate([0]))
    await h.settle()
    # Each valid alone: both write slot 2 of a's page 4 (three tokens into a page of length 3).
    h.send(a, rq.forward_text([4], 3, [1, 2, 3], outputs=[2], request_id=10, stream_id=1),
           rq.forward_text([4], 3, [5], positions=[2], outputs=[0], request_id=11, stream_id=2))
    h.send(b, rq.forward_text([0], 1, [7], outputs=[0], request_id=20))
    await h.settle()
    trap = sink_a.trap
    assert trap is not None and trap.kind == TRAP.TRAP_KIND_INVALID_COMMAND and trap.offending_request_id == 11
    assert "writes kv page 4 slot 2" in trap.reason and "request 10 (stream 1)" in trap.reason, trap.reason
    assert b.is_alive and _tokens(sink_b) == [next_token(7, 0, 1000)]
    sent = [r for r in h.links[0].sent if r.WhichOneof("batch") == "forward_text"]
    assert [len(r.forward_text.items) for r in sent] == [1]  # b's item alone reached the executor
    assert h.sim().num_errors == 0 and h.scheduler.metrics.counts()["batch_errors"] == 0
    h.scheduler.close_session(b)
    assert h.free_pages() == 64 and h.sim().allocated_pages == set()


async def test_one_stream_rewriting_a_slot_goes_in_a_later_batch_not_a_trap(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(batching="k-only:4")
    h.links[0].keep_sent = True
    a, sink_a = h.open()
    b, sink_b = h.open()
    h.send(a, rq.allocate([4]))
    h.send(b, rq.allocate([0]))
    await h.settle()
    # One stream: the second rewrites slot 2 after the first wrote it (ordered, so legitimate).
    h.send(a, rq.forward_text([4], 3, [1, 2, 3], outputs=[2], request_id=10),
           rq.forward_text([4], 3, [5], positions=[2], outputs=[0], request_id=11),
           rq.forward_text([4], 4, [6], positions=[3], outputs=[0], request_id=12))
    h.send(b, rq.forward_text([0], 1, [7], outputs=[0], request_id=20))
    await h.settle()
    assert a.is_alive and b.is_alive and h.sim().num_errors == 0
    sent = [r for r in h.links[0].sent if r.WhichOneof("batch") == "forward_text"]
    # Wave 0: request 10 and b's; wave 1: request 11 and 12 (12 follows 11 on its stream).
    assert [[i.token_ids[0] for i in r.forward_text.items] for r in sent] == [[1, 7], [5, 6]]
    assert [e.request_id for e in sink_a.of("forward_text")] == [10, 11, 12]
    assert _tokens(sink_b) == [next_token(7, 0, 1000)]


async def test_items_of_one_instance_on_disjoint_slots_share_a_batch(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(kv_page_size=4)
    a, sink_a = h.open()
    h.send(a, rq.allocate([0, 1, 2]))
    await h.settle()
    # Stream 1 writes slots 2..5 (pages 0 and 1); stream 2 writes slot 2 of page 1, then slot 3 of page 2.
    h.send(a, rq.forward_text([0, 1], 2, [1, 2, 3, 4], positions=[2, 3, 4, 5], outputs=[3], stream_id=1),
           rq.forward_text([2, 1], 3, [6], positions=[6], outputs=[0], stream_id=2),
           rq.forward_text([2], 4, [8], positions=[3], outputs=[0], stream_id=3))
    await h.settle()
    assert a.is_alive and len(_tokens(sink_a)) == 3
    assert ("forward_text", 3) in h.sim().batch_sizes


async def test_a_collision_across_pages_with_continuation_is_caught(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(kv_page_size=4)
    a, sink_a = h.open()
    h.send(a, rq.allocate([0, 1]))
    await h.settle()
    first = rq.forward_text([0, 1], 3, [1, 2], positions=[3, 4], outputs=[1], stream_id=1)
    first.forward_text.num_continuation_steps = 3  # writes slots 3..7: page 0 slot 3, page 1 slots 0..3
    h.send(a, first, rq.forward_text([1], 3, [9], positions=[2], outputs=[0], stream_id=2, request_id=5))
    await h.settle()
    assert sink_a.trap is not None and "writes kv page 1 slot 2" in sink_a.trap.reason, sink_a.trap
    assert h.sim().num_errors == 0


async def test_a_batch_error_without_an_item_index_traps_the_whole_batch(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory()
    a, sink_a = h.open()
    b, sink_b = h.open()
    for inst in (a, b):
        h.send(inst, rq.allocate([0]))
    await h.settle()
    _forget_item_index(h)
    h.sim().allocated_pages.discard(b.table.kv_pages[0])
    h.send(a, rq.forward_text([0], 1, [1], outputs=[0]))
    h.send(b, rq.forward_text([0], 1, [1], outputs=[0]))
    await h.settle()
    for sink in (sink_a, sink_b):
        assert sink.trap.kind == TRAP.TRAP_KIND_EXECUTOR_LOST and "rejected" in sink.trap.reason  # type: ignore[union-attr]
    assert h.scheduler.metrics.counts()["batches_resent"] == 0


async def test_a_bystander_that_sent_later_commands_is_not_resent(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(batching="eager", latency_s={"forward_text": 0.05})
    a, sink_a = h.open()
    b, sink_b = h.open()
    c, sink_c = h.open()
    for inst in (a, b, c):
        h.send(inst, rq.allocate([0, 1]))
    await h.settle()
    h.sim().allocated_pages.discard(b.table.kv_pages[0])
    h.send(a, rq.forward_text([0], 1, [1], outputs=[0]))
    h.send(b, rq.forward_text([0], 1, [1], outputs=[0]))
    h.send(c, rq.forward_text([0], 1, [1], outputs=[0]))
    await h.settle()
    h.send(a, rq.forward_text([1], 1, [2], outputs=[0]))  # sent while the first batch is in flight
    for _ in range(20):
        if len(_tokens(sink_c)) == 1 and not a.is_alive:
            break
        await h.settle()
        await asyncio.sleep(0.03)
    assert sink_b.trap.kind == TRAP.TRAP_KIND_INVALID_COMMAND  # type: ignore[union-attr]
    assert sink_a.trap.kind == TRAP.TRAP_KIND_EXECUTOR_LOST and "later commands" in sink_a.trap.reason  # type: ignore[union-attr]
    assert c.is_alive and _tokens(sink_c) == [next_token(1, 0, 1000)]


async def test_a_rejected_fire_and_forget_batch_traps_its_offender_alone(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory()
    a, sink_a = h.open()
    b, sink_b = h.open()
    h.sim().allocated_pages.add(1)  # the executor thinks page 1 is taken: b's allocate is refused
    h.send(a, rq.allocate([0]))
    h.send(b, rq.allocate([0]))
    await h.settle()
    assert sink_b.trap.kind == TRAP.TRAP_KIND_INVALID_COMMAND and "wrong state" in sink_b.trap.reason  # type: ignore[union-attr]
    assert a.is_alive and h.scheduler.metrics.counts()["batches_resent"] == 1
    h.send(a, rq.forward_text([0], 1, [3], outputs=[0]))
    await h.settle()
    assert _tokens(sink_a) == [next_token(3, 0, 1000)]
    assert h.sim().allocated_pages == {0}  # b's page was deallocated with b (the executor had it)
    assert not h.scheduler.executors[0].unanswered


async def test_fire_and_forget_batches_are_settled_by_a_barrier(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory()
    a, _ = h.open()
    for _ in range(600):  # 1,200 fire-and-forget batches and not one forward pass
        h.send(a, rq.allocate([0]), rq.deallocate([0]))
        await h.settle()
    executor = h.scheduler.executors[0]
    assert 0 < len(executor.unanswered) <= 64  # a barrier ping every 64
    assert ("debug_query", 1) in h.sim().batch_sizes
    assert a.is_alive and h.free_pages() == 64

