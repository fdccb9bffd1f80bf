"""The scheduler core over in-process simulated executors: tables, replies, synchronize, exports,
contention, executor loss, budgets, spans."""

from __future__ import annotations

import hashlib
import json

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from l4m.scheduler import requests as rq
from l4m.scheduler.simulated import next_token
from l4m.scheduler.tracing import SchedulerTracer
from l4m.v1 import l4m_pb2

TRAP = l4m_pb2


def _tokens(sink) -> list[int]:  # type: ignore[no-untyped-def]
    return [o.token.token_id for e in sink.of("forward_text") for o in e.forward_text.outputs]


async def test_virtual_ids_are_per_instance_and_translated(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory()
    h.links[0].keep_sent = True
    a, sink_a = h.open()
    b, sink_b = h.open()
    h.send(a, rq.allocate([7, 8]))
    h.send(b, rq.allocate([7]))  # same virtual id, another instance: fine
    await h.settle()
    assert a.table.kv_pages == {7: 0, 8: 1} and b.table.kv_pages == {7: 2}
    h.send(b, rq.forward_text([7], 1, [5], outputs=[0], request_id=3))
    await h.settle()
    sent = [r for r in h.links[0].sent if r.WhichOneof("batch") == "forward_text"]
    assert list(sent[0].forward_text.items[0].kv_page_ids) == [2]
    assert _tokens(sink_b) == [next_token(5, 0, 1000)]
    assert sink_b.of("forward_text")[0].request_id == 3
    assert not sink_a.events and h.free_pages() == 61


async def test_two_instances_share_one_forward_batch(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory()
    a, sink_a = h.open()
    b, sink_b = h.open()
    for inst in (a, b):
        h.send(inst, rq.allocate([0]))
    await h.settle()
    h.send(a, rq.forward_text([0], 2, [3, 4], outputs=[1]))
    h.send(b, rq.forward_text([0], 1, [9], outputs=[0]))
    await h.settle()
    assert _tokens(sink_a) == [next_token(4, 1, 1000)] and _tokens(sink_b) == [next_token(9, 0, 1000)]
    assert h.scheduler.metrics.counts()["max_instances_per_batch"]["forward_text"] == 2
    assert ("forward_text", 2) in h.sim().batch_sizes


async def test_synchronize_waits_for_earlier_replies_of_its_stream_only(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(latency_s={"forward_text": 0.05})
    a, sink = h.open()
    h.send(a, rq.allocate([0]), rq.forward_text([0], 1, [1], outputs=[0], request_id=1),
           rq.synchronize(request_id=2), rq.synchronize(request_id=3, stream_id=1))
    await h.settle()
    kinds = [(e.WhichOneof("event"), e.request_id) for e in sink.events]
    assert kinds == [("synchronize", 3)]  # stream 1 had nothing in flight; stream 0 waits for the forward
    import asyncio

    await asyncio.sleep(0.08)
    kinds = [(e.WhichOneof("event"), e.request_id) for e in sink.events]
    assert kinds == [("synchronize", 3), ("forward_text", 1), ("synchronize", 2)]


async def test_fire_and_forget_then_synchronize_resolves_after_send(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory()
    a, sink = h.open()
    h.send(a, rq.allocate([0, 1]), rq.forward_text([0], 3, [1, 2, 3]), rq.synchronize(request_id=9))
    await h.settle()
    assert [e.request_id for e in sink.of("synchronize")] == [9]
    assert h.sim().allocated_pages == {0, 1}


async def test_deallocate_frees_and_executor_is_told(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory()
    a, _ = h.open()
    h.send(a, rq.allocate([1, 2, 3]), rq.allocate([4], kind=rq.EMBED_SLOT), rq.deallocate([2]))
    await h.settle()
    assert h.free_pages() == 62 and h.free_slots() == 63
    assert h.sim().allocated_pages == {0, 2}


async def test_close_session_frees_everything(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory()
    a, sink = h.open()
    h.send(a, rq.allocate([1, 2]), rq.allocate([1], kind=rq.EMBED_SLOT), rq.export("tmp", [1]))
    await h.settle()
    h.scheduler.close_session(a)
    assert sink.ended and sink.trap is None
    assert h.free_pages() == 64 and h.free_slots() == 64
    assert h.sim().allocated_pages == set() and h.sim().allocated_slots == set()
    assert len(h.scheduler.exports) == 0


async def test_export_import_unexport_respect_refcounts(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory()
    a, _ = h.open()
    b, sink_b = h.open()
    h.send(a, rq.allocate([1, 2]), rq.export("prefix", [1, 2], persistent=True, metadata=b"meta"))
    await h.settle()
    h.send(b, rq.import_pages("prefix", [10, 11], request_id=4), rq.request(list_exports=l4m_pb2.ListExportsCommand()))
    await h.settle()
    result = sink_b.of("import_kv_pages")[0]
    assert result.import_kv_pages.num_kv_pages == 2 and result.import_kv_pages.metadata == b"meta"
    assert b.table.kv_pages == {10: 0, 11: 1}
    assert sink_b.of("list_exports")[0].list_exports.exports[0].persistent
    h.scheduler.close_session(a)  # exporter ends: persistent export and importer keep the pages
    assert h.free_pages() == 62
    h.send(b, rq.unexport("prefix"))
    await h.settle()
    assert h.free_pages() == 62  # the importer still holds them
    assert h.scheduler.exports.find("prefix", b.user) is None
    h.send(b, rq.deallocate([10, 11]))
    await h.settle()
    assert h.free_pages() == 64 and h.sim().allocated_pages == set()


async def test_owned_export_disappears_with_its_exporter_but_importers_keep_pages(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory()
    a, _ = h.open()
    b, _ = h.open()
    h.send(a, rq.allocate([1]), rq.export("x", [1]))
    h.send(b, rq.synchronize())
    await h.settle()
    h.send(b, rq.import_pages("x", [5]))
    await h.settle()
    h.scheduler.close_session(a)
    assert h.scheduler.exports.find("x", b.user) is None
    assert h.free_pages() == 63 and b.table.kv_pages == {5: 0}
    h.scheduler.close_session(b)
    assert h.free_pages() == 64


async def test_export_errors_trap_with_reasons(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory()
    a, _ = h.open()
    h.send(a, rq.allocate([1]), rq.export("x", [1]))
    await h.settle()
    cases = [
        (rq.export("x", [1]), "already exported"),
        (rq.import_pages("nope", [3]), "no export is named 'nope'"),
        (rq.import_pages("x", [3, 4]), "has 1 pages; kv_page_ids lists 2"),
        (rq.unexport("nope"), "no export is named 'nope'"),
        (rq.export("y", [42]), "kv page 42 is not allocated"),
    ]
    for request, reason in cases:
        inst, sink = h.open()
        h.send(inst, rq.allocate([1]), request)
        await h.settle()
        assert sink.trap is not None and reason in sink.trap.reason, (reason, sink.trap)
    b, sink_b = h.open()
    h.send(b, rq.allocate([3]), rq.import_pages("x", [3]))
    await h.settle()
    assert "kv page id 3 is already allocated" in sink_b.trap.reason  # type: ignore[union-attr]
    assert a.is_alive and h.free_pages() == 63


async def test_contention_evicts_the_newest_later_instance(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(num_kv_pages=8)
    watched = []
    h.scheduler.watchers.append(lambda iid, trap: watched.append((iid, trap.kind)))
    old, sink_old = h.open("old")
    mid, sink_mid = h.open("mid")
    new, sink_new = h.open("new")
    h.send(old, rq.allocate([0, 1]))
    h.send(mid, rq.allocate([0, 1, 2]))
    h.send(new, rq.allocate([0, 1, 2]))
    await h.settle()
    h.send(old, rq.allocate([5, 6]))  # 0 free: evict "new" (3 pages) first
    await h.settle()
    assert sink_new.trap.kind == TRAP.TRAP_KIND_EVICTED and "'old'" in sink_new.trap.reason  # type: ignore[union-attr]
    assert mid.is_alive and old.table.kv_pages.keys() == {0, 1, 5, 6}
    assert watched == [("new", TRAP.TRAP_KIND_EVICTED)]
    assert h.sim().num_errors == 0


async def test_contention_without_newer_instance_and_no_admission_queue_traps_the_requester(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(num_kv_pages=4, config={"max_waiting_instances": 0})
    old, _ = h.open("old")
    new, sink_new = h.open("new")
    h.send(old, rq.allocate([0, 1, 2]))
    await h.settle()
    h.send(new, rq.allocate([0, 1]))
    await h.settle()
    assert sink_new.trap.kind == TRAP.TRAP_KIND_RESOURCE_EXHAUSTED  # type: ignore[union-attr]
    assert "1 of 4 are free" in sink_new.trap.reason  # type: ignore[union-attr]
    assert "the admission queue is full (0 of 0 instances wait" in sink_new.trap.reason  # type: ignore[union-attr]
    assert old.is_alive and h.free_pages() == 1


async def test_preemption_inside_one_allocate_batch_keeps_executor_consistent(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(num_kv_pages=4)
    old, sink_old = h.open("old")
    new, sink_new = h.open("new")
    h.send(new, rq.allocate([0, 1, 2]))
    h.send(old, rq.allocate([0, 1, 2]))  # same allocate batch: "new" (holding nothing yet) waits for "old"
    await h.settle()
    assert new.is_alive and new.is_waiting and not new.table.kv_pages and sink_new.trap is None
    assert h.sim().num_errors == 0 and h.sim().allocated_pages == set(old.table.kv_pages.values())
    h.scheduler.close_session(old)  # its pages free: "new" resumes and its allocate goes through
    await h.settle()
    assert not new.is_parked and new.table.kv_pages.keys() == {0, 1, 2} and sink_old.trap is None
    assert h.sim().num_errors == 0 and h.sim().allocated_pages == set(new.table.kv_pages.values())


async def test_page_budget_per_instance(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(num_kv_pages=4)
    a, sink = h.open()
    h.send(a, rq.allocate([0, 1, 2]), rq.allocate([3, 4]))
    await h.settle()
    assert sink.trap.kind == TRAP.TRAP_KIND_RESOURCE_EXHAUSTED  # type: ignore[union-attr]
    assert "would hold 5, more than the 4 one instance may hold" in sink.trap.reason  # type: ignore[union-attr]
    assert h.free_pages() == 4


async def test_token_budget_traps(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory()
    a, sink = h.open(max_tokens=3)
    h.send(a, rq.allocate([0]), rq.forward_text([0], 2, [1, 2]), rq.forward_text([0], 4, [3, 4]))
    await h.settle()
    assert sink.trap.kind == TRAP.TRAP_KIND_TOKEN_BUDGET and "budget of 3" in sink.trap.reason  # type: ignore[union-attr]
    assert h.free_pages() == 64


async def test_executor_lost_traps_its_instances_and_reconnect_serves_again(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(num_executors=2)
    a, sink_a = h.open()
    b, sink_b = h.open()
    h.send(a, rq.allocate([0]))
    await h.settle()
    h.send(b, rq.allocate([0]))
    await h.settle()
    assert a.executor is not b.executor  # least loaded
    lost = a.executor.index
    h.links[lost].lose("connection reset")
    assert sink_a.trap.kind == TRAP.TRAP_KIND_EXECUTOR_LOST and "connection reset" in sink_a.trap.reason  # type: ignore[union-attr]
    assert b.is_alive
    c, sink_c = h.open()
    h.send(c, rq.allocate([0]), rq.forward_text([0], 1, [2], outputs=[0]))
    await h.settle()
    assert c.executor is b.executor and _tokens(sink_c)
    h.links[lost].reconnect()
    assert h.scheduler.executors[lost].is_connected and h.free_pages(lost) == 64


async def test_batch_error_traps_the_offender_alone_and_resends_the_rest(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory()
    a, sink_a = h.open()
    b, sink_b = h.open()
    for inst in (a, b):
        h.send(inst, rq.allocate([0]))
    await h.settle()
    h.links[0].executor.allocated_pages.discard(b.table.kv_pages[0])  # the executor "forgets" b's page
    h.send(a, rq.forward_text([0], 1, [1], outputs=[0]))
    h.send(b, rq.forward_text([0], 1, [1], outputs=[0]))
    await h.settle()
    assert sink_b.trap.kind == TRAP.TRAP_KIND_INVALID_COMMAND and "not allocated" in sink_b.trap.reason  # type: ignore[union-attr]
    assert a.is_alive and sink_a.trap is None and _tokens(sink_a) == [next_token(1, 0, 1000)]
    assert h.scheduler.metrics.counts()["batch_errors"] >= 1 and h.scheduler.metrics.counts()["batches_resent"] == 1
    assert ("forward_text", 2) in h.sim().batch_sizes and ("forward_text", 1) in h.sim().batch_sizes


async def test_destroy_instance_traps_and_reports_freed(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory()
    a, sink = h.open("victim")
    watched = []
    h.scheduler.watchers.append(lambda iid, trap: watched.append(iid))
    h.send(a, rq.allocate([0, 1]), rq.allocate([0], kind=rq.EMBED_SLOT))
    await h.settle()
    assert h.scheduler.destroy_instance("victim", "killed by user") == (2, 1)
    assert sink.trap.kind == TRAP.TRAP_KIND_DESTROYED and "killed by user" in sink.trap.reason  # type: ignore[union-attr]
    assert watched == []  # the spawner asked for it; not echoed
    assert h.scheduler.destroy_instance("victim", "again") == (0, 0)


async def test_debug_query_switches_strategy_live(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory()
    a, sink = h.open(is_admin=True)
    h.send(a, rq.debug_query("ping"), rq.debug_query("batching:k-or-t:4:2"), rq.debug_query("batching"),
           rq.debug_query("stats"))
    await h.settle()
    answers = [e.debug_query.response for e in sink.of("debug_query")]
    assert answers[:3] == ["pong", "k-or-t:4:2", "k-or-t:4:2"]
    assert json.loads(answers[3])["batching"] == "k-or-t:4:2"


async def test_priority_moves_a_stream_ahead(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(batching="k-only:1")
    a, sink_a = h.open()
    b, sink_b = h.open()
    h.send(a, rq.allocate([0]))
    h.send(b, rq.allocate([0]), rq.request(set_stream_priority=l4m_pb2.SetStreamPriorityCommand(priority=3)))
    await h.settle()
    h.links[0].keep_sent = True
    h.send(a, rq.forward_text([0], 1, [1], request_id=1))
    h.send(b, rq.forward_text([0], 1, [2], request_id=2))
    await h.settle()
    firsts = [r.forward_text.items[0].token_ids[0] for r in h.links[0].sent if r.WhichOneof("batch") == "forward_text"]
    assert firsts == [2, 1]


async def test_command_and_batch_spans_link_both_ways(harness_factory) -> None:  # type: ignore[no-untyped-def]
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    h = harness_factory(tracer=SchedulerTracer(provider))
    h.links[0].keep_sent = True
    a, _ = h.open()
    b, _ = h.open()
    a.trace_context = SchedulerTracer.extract("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    for inst in (a, b):
        h.send(inst, rq.allocate([0]))
    await h.settle()
    h.send(a, rq.forward_text([0], 1, [1], outputs=[0]))
    h.send(b, rq.forward_text([0], 1, [2], outputs=[0]))
    await h.settle()
    spans = exporter.get_finished_spans()
    commands = [s for s in spans if s.name == "l4m.forward_text"]
    batch = next(s for s in spans if s.name == "scheduler.batch" and s.attributes["l4m.batch.kind"] == "forward_text")
    assert len(commands) == 2
    assert {link.context.span_id for link in batch.links} == {s.context.span_id for s in commands}
    assert all(c.links[0].context.span_id == batch.context.span_id for c in commands)
    a_span = next(s for s in commands if s.attributes["l4m.instance_id"] == a.instance_id)
    assert a_span.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    sent = next(r for r in h.links[0].sent if r.WhichOneof("batch") == "forward_text")
    assert f"{batch.context.span_id:016x}" in sent.trace_context.traceparent
    # The batch sits in the trace of its first command (a span has one parent), reaching the other by link.
    first = next(s for s in commands if s.context.span_id == batch.parent.span_id)
    assert batch.context.trace_id == first.context.trace_id
    assert a_span.attributes["l4m.kv_pages"] == 1 and a_span.attributes["l4m.instance.kv_pages_held"] == 1


async def test_output_less_forward_batches_count_as_in_flight_under_adaptive(harness_factory) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    h = harness_factory(latency_s={"forward_text": 0.05})
    a, _ = h.open()
    b, _ = h.open()
    for inst in (a, b):
        h.send(inst, rq.allocate([0]))
    await h.settle()
    h.send(a, rq.forward_text([0], 2, [1, 2]))  # a prefill without outputs: fires at once
    await h.settle()
    h.send(b, rq.forward_text([0], 2, [3, 4]))
    await h.settle()
    executor = h.scheduler.executors[0]
    assert executor.num_forward_in_flight == 1  # b waits for a's forward to be answered
    assert h.scheduler.metrics.counts()["batches"]["forward_text"] == 1
    await asyncio.sleep(0.08)
    assert h.scheduler.metrics.counts()["batches"]["forward_text"] == 2
    await asyncio.sleep(0.08)
    assert executor.num_forward_in_flight == 0 and not executor.inflight


async def test_a_burst_of_launches_shares_its_first_batch_under_the_default_strategy(harness_factory) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    h = harness_factory(batching="adaptive")  # the scheduler's default, its launch hold included
    burst = [h.open() for _ in range(3)]  # registered together, as a burst of launches is
    for inst, _ in burst:
        h.send(inst, rq.allocate([0]))
    await h.settle()

    def forward_batches() -> int:
        return h.scheduler.metrics.counts()["batches"].get("forward_text", 0)

    first, _ = burst[0]
    h.send(first, rq.forward_text([0], 1, [5], outputs=[0], request_id=1))
    await h.settle()
    assert forward_batches() == 0, "the idle executor waits for the burst's other first forwards"
    for inst, _ in burst[1:]:
        h.send(inst, rq.forward_text([0], 1, [5], outputs=[0], request_id=1))
    await h.settle()
    assert forward_batches() == 1 and all(sink.of("forward_text") for _, sink in burst), "one batch of three"

    talker, talker_sink = h.open()
    h.open()  # launched, and silent
    h.send(talker, rq.allocate([0]), rq.forward_text([0], 1, [5], outputs=[0], request_id=1))
    await h.settle()
    assert forward_batches() == 1
    await asyncio.sleep(0.25)  # past the bound (150 ms): the silent launch is no longer waited for
    assert forward_batches() == 2 and talker_sink.of("forward_text") and talker_sink.trap is None


async def test_reply_and_executor_round_trip_latencies_are_exported(harness_factory) -> None:  # type: ignore[no-untyped-def]
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    h = harness_factory(latency_s={"forward_text": 0.03})
    a, sink = h.open()
    h.send(a, rq.allocate([0]), rq.forward_text([0], 1, [5], outputs=[0], request_id=1),
           rq.forward_text([0], 2, [6], outputs=[0], request_id=2), rq.synchronize(request_id=3))
    import asyncio

    await asyncio.sleep(0.15)
    assert [e.request_id for e in sink.events] == [1, 2, 3]
    text = generate_latest(h.scheduler.metrics.registry).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    count = "l4m_scheduler_command_seconds_count"
    assert samples[(count, (("kind", "forward_text"),))] == 2
    assert samples[(count, (("kind", "synchronize"),))] == 1
    # Each reply came at least one simulated executor latency after its command arrived.
    assert samples[("l4m_scheduler_command_seconds_sum", (("kind", "forward_text"),))] >= 2 * 0.03
    num_batches = samples[("l4m_scheduler_executor_batch_seconds_count", (("kind", "forward_text"),))]
    assert num_batches == h.scheduler.metrics.counts()["batches"]["forward_text"] >= 1
    assert samples[("l4m_scheduler_executor_batch_seconds_sum", (("kind", "forward_text"),))] >= 0.03 * num_batches


async def test_get_info_can_leave_the_tokenizer_out(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(tokenizer_json='{"version": "1.0"}')
    full, lean = h.scheduler.get_info(), h.scheduler.get_info(omit_tokenizer_json=True)
    assert full.model.tokenizer_json and not lean.model.tokenizer_json
    # Both name the tokenizer, so that a process with many sessions builds it once.
    assert lean.model.tokenizer_sha256 == hashlib.sha256(b'{"version": "1.0"}').hexdigest()
    full.model.ClearField("tokenizer_json")
    assert lean == full  # nothing else differs
    a, sink = h.open()
    h.send(a, rq.request(request_id=1, get_info=l4m_pb2.GetInfoCommand(omit_tokenizer_json=True)),
           rq.request(request_id=2, get_info=l4m_pb2.GetInfoCommand()))
    await h.settle()
    lean_reply, full_reply = (e.info for e in sink.of("info"))
    assert not lean_reply.model.tokenizer_json and full_reply.model.tokenizer_json


def _continued(pages: list[int], last: int, tokens: list[int], positions: list[int], steps: int,
               stop_ids: tuple[int, ...] = (), request_id: int = 0) -> l4m_pb2.SessionRequest:
    request = rq.forward_text(pages, last, tokens, positions, outputs=[len(tokens) - 1], request_id=request_id)
    request.forward_text.num_continuation_steps = steps
    request.forward_text.continuation_stop_token_ids.extend(stop_ids)
    return request


async def test_continuation_answers_every_sampled_token_and_spends_the_budget_up_front(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory()
    assert h.scheduler.get_info().max_continuation_steps == 64
    a, sink = h.open(max_tokens=40)
    # 3 tokens + 5 continuation steps in pages 0, 1 (page size 16: 8 slots).
    h.send(a, rq.allocate([0]), _continued([0], 8, [3, 4, 5], [0, 1, 2], 5, request_id=1))
    await h.settle()
    (reply,) = sink.of("forward_text")
    tokens = [o.token.token_id for o in reply.forward_text.outputs]
    expected = [next_token(5, 2, 1000)]
    for step in range(1, 6):
        expected.append(next_token(expected[-1], 2 + step, 1000))
    assert tokens == expected
    assert a.num_tokens_used == 3 + 5
    # A stop token ends it early; the budget still counts every step asked for.
    h.send(a, _continued([0], 16, [tokens[-1]], [8], 7, stop_ids=(next_token(tokens[-1], 8, 1000),), request_id=2))
    await h.settle()
    assert [len(e.forward_text.outputs) for e in sink.of("forward_text")] == [6, 1]
    assert a.num_tokens_used == 3 + 5 + 1 + 7
    # Over the budget: trapped before anything is sent.
    h.send(a, rq.allocate([1, 2]), _continued([0, 1, 2], 15, [1], [16], 30, request_id=3))
    await h.settle()
    assert sink.trap is not None and sink.trap.kind == l4m_pb2.TRAP_KIND_TOKEN_BUDGET


async def test_a_scheduler_with_continuation_off_says_so_and_traps_it(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(config={"max_continuation_steps": 0})
    assert h.scheduler.get_info().max_continuation_steps == 0
    a, sink = h.open()
    h.send(a, rq.allocate([0]), _continued([0], 3, [3], [0], 2, request_id=1))
    await h.settle()
    assert sink.trap is not None and "max_continuation_steps=0" in sink.trap.reason


async def test_a_deallocate_reaches_the_executor_even_when_its_instance_traps_in_the_same_batch(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory()
    offender, sink = h.open("offender")
    h.send(offender, rq.allocate([1, 2]), rq.synchronize())
    await h.settle()
    h.send(offender, rq.deallocate([1]), rq.deallocate([999]))  # one batch: the second traps the instance
    await h.settle()
    assert sink.trap is not None and "999" in sink.trap.reason
    assert h.free_pages() == 64 and h.sim().allocated_pages == set()  # page 1 was told too, not only page 2
    other, other_sink = h.open("other")
    h.send(other, rq.allocate([5, 6]), rq.forward_text([5, 6], 1, [1] * 17, outputs=[16], request_id=3))
    await h.settle()
    assert other_sink.trap is None and h.sim().num_errors == 0
