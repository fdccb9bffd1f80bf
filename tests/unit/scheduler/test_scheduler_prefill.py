"""Chunked prefill (prefill.py): a forward_text longer than the chunk budget runs as consecutive chunks,
each batched beside other streams' work, answered once as the unchunked pass would be."""

from __future__ import annotations

import asyncio

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from l4m.scheduler import requests as rq
from l4m.scheduler.prefill import chunk_budget, chunk_cost, chunk_sizes
from l4m.scheduler.simulated import BatchRejected
from l4m.scheduler.tracing import SchedulerTracer
from l4m.v1 import common_pb2, executor_pb2, l4m_pb2

PAGE = 16  # the simulated executor's page size


def _chunks(h) -> list[common_pb2.ForwardTextItem]:  # type: ignore[no-untyped-def]
    """Every forward_text item sent, in send order."""
    return [item for r in h.links[0].sent if r.WhichOneof("batch") == "forward_text" for item in r.forward_text.items]


def _long(num_context: int, num_tokens: int, outputs=(), samplers=None, masks=(), steps: int = 0,  # type: ignore[no-untyped-def]
          request_id: int = 1, pages: list[int] | None = None, **kw) -> l4m_pb2.SessionRequest:
    """A forward_text of `num_tokens` tokens after `num_context` slots, on pages 0.. grown to hold them."""
    total = num_context + num_tokens + steps
    pages = pages if pages is not None else list(range(-(-total // PAGE)))
    request = rq.forward_text(pages, total - PAGE * (len(pages) - 1), [(3 * i + 1) % 1000 for i in range(num_tokens)],
                              list(range(num_context, num_context + num_tokens)), outputs, samplers, masks,
                              request_id=request_id, **kw)
    request.forward_text.num_continuation_steps = steps
    return request


async def test_a_long_prompt_runs_as_chunks_in_order_with_their_pages_positions_and_mask_rows(
        harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(config={"prefill_chunk_tokens": 16})
    h.links[0].keep_sent = True
    a, sink = h.open()
    # Context of 5 slots, then 40 tokens with a mask row each (slot 1 hidden): chunks of 16, 16 and 8.
    masks = [[1, 1, 4 + i] for i in range(40)]
    h.send(a, rq.allocate([0, 1, 2]), _long(0, 5, request_id=1, pages=[0]),
           _long(5, 40, outputs=[39], masks=masks, request_id=2),
           rq.forward_text([0, 1, 2], 14, [7], [45], outputs=[0], request_id=3), rq.synchronize(request_id=4))
    await h.settle()
    chunks = _chunks(h)[1:]
    assert [len(c.token_ids) for c in chunks] == [16, 16, 8, 1]  # then request 3, after every chunk
    assert [list(c.position_ids) for c in chunks[:3]] == [list(range(5, 21)), list(range(21, 37)), list(range(37, 45))]
    assert [(list(c.kv_page_ids), c.kv_last_page_length) for c in chunks[:3]] == [([0, 1], 5), ([0, 1, 2], 5),
                                                                                   ([0, 1, 2], 13)]
    rows = [[list(row.run_lengths) for row in c.attention_masks] for c in chunks[:3]]
    assert rows == [masks[:16], masks[16:32], masks[32:]]
    assert [list(c.output_indices) for c in chunks[:3]] == [[], [], [7]]
    # Request 1 joins the first chunk's batch (it comes before it); each later chunk has a batch of its own.
    assert [len(r.forward_text.items) for r in h.links[0].sent if r.WhichOneof("batch") == "forward_text"] == [2, 1, 1, 1]
    # One reply for the chunked command, in stream order, then the synchronize.
    assert [(e.WhichOneof("event"), e.request_id) for e in sink.events] == [
        ("forward_text", 2), ("forward_text", 3), ("synchronize", 4)]


async def test_outputs_land_where_the_unchunked_pass_puts_them(harness_factory) -> None:  # type: ignore[no-untyped-def]
    outputs = [30, 2, 17, 9, 40, 16]  # out of order, across every chunk and its edges
    samplers = [common_pb2.SamplerSpec(kind=common_pb2.SAMPLER_KIND_DISTRIBUTION, distribution_top_k=3)
                if i % 2 else rq.greedy() for i in range(len(outputs))]
    replies = []
    for chunk_tokens in (8, 0):  # 0: the default budget, which holds the whole command
        h = harness_factory(config={"prefill_chunk_tokens": chunk_tokens})
        h.links[0].keep_sent = True
        a, sink = h.open()
        h.send(a, rq.allocate([0, 1, 2]), _long(0, 41, outputs, samplers))
        await h.settle()
        assert len(_chunks(h)) == (6 if chunk_tokens else 1)
        replies.append([e.forward_text for e in sink.of("forward_text")])
    chunked, whole = replies
    assert len(chunked) == 1 and chunked == whole
    assert len(whole[0].outputs) == len(outputs)


async def test_other_streams_decode_steps_share_batches_with_the_chunks(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(config={"prefill_chunk_tokens": 16}, latency_s={"forward_text": 0.01})
    h.links[0].keep_sent = True
    a, sink_a = h.open()
    b, sink_b = h.open()
    h.send(b, rq.allocate([0]))
    h.send(a, rq.allocate(list(range(5))))
    await h.settle()

    async def decode(num_steps: int) -> None:
        for step in range(num_steps):
            h.send(b, rq.forward_text([0], step + 1, [5], [step], outputs=[0], request_id=100 + step))
            while len(sink_b.of("forward_text")) <= step:
                await asyncio.sleep(0.001)

    decoding = asyncio.ensure_future(decode(12))
    await asyncio.sleep(0.015)  # b is in its decode loop
    h.send(a, _long(0, 64, outputs=[63]))
    await decoding
    while not sink_a.of("forward_text"):
        await asyncio.sleep(0.001)
    batches = [r.forward_text.items for r in h.links[0].sent if r.WhichOneof("batch") == "forward_text"]
    with_chunks = [items for items in batches if any(len(i.token_ids) == 16 for i in items)]
    assert len(with_chunks) == 4  # one chunk a batch
    assert all(sum(len(i.token_ids) == 16 for i in items) == 1 for items in with_chunks)
    assert sum(any(len(i.token_ids) == 1 for i in items) for items in with_chunks) >= 3  # b's steps beside them
    assert len(sink_a.of("forward_text")) == 1 and len(sink_b.of("forward_text")) == 12
    assert sink_a.trap is None and sink_b.trap is None


async def test_a_failing_chunk_fails_the_command_once(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(config={"prefill_chunk_tokens": 16})
    h.links[0].keep_sent = True
    sim = h.sim()
    check = sim._check

    def reject_second_chunk(kind: str, index: int, item: object) -> None:
        if kind == "forward_text" and item.position_ids[0] == 16:  # type: ignore[attr-defined]
            raise BatchRejected(index, "boom")
        check(kind, index, item)

    sim._check = reject_second_chunk  # type: ignore[method-assign]
    a, sink = h.open()
    b, sink_b = h.open()
    h.send(b, rq.allocate([0]))
    h.send(a, rq.allocate([0, 1, 2, 3]), _long(0, 50, outputs=[1, 49], request_id=7),
           rq.forward_text([0], 1, [1], outputs=[0], request_id=8))
    await h.settle()
    assert [(e.WhichOneof("event"), e.request_id) for e in sink.events] == [("trap", 7)]
    assert sink.trap is not None and sink.trap.kind == l4m_pb2.TRAP_KIND_INVALID_COMMAND and "boom" in sink.trap.reason
    assert [c.position_ids[0] for c in _chunks(h)] == [0, 16]  # the chunks after it never ran
    h.send(b, rq.forward_text([0], 1, [5], outputs=[0], request_id=1))  # nothing else was disturbed
    await h.settle()
    assert len(sink_b.of("forward_text")) == 1 and h.free_pages() == 63


async def test_a_chunk_past_the_token_budget_fails_the_command_once(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(config={"prefill_chunk_tokens": 16})
    a, sink = h.open(max_tokens=40)
    h.send(a, rq.allocate([0, 1, 2, 3]), _long(0, 50, outputs=[49], request_id=7))
    await h.settle()
    assert [(e.WhichOneof("event"), e.request_id) for e in sink.events] == [("trap", 7)]
    assert sink.trap is not None and sink.trap.kind == l4m_pb2.TRAP_KIND_TOKEN_BUDGET


async def test_continuation_runs_only_with_the_last_chunk(harness_factory) -> None:  # type: ignore[no-untyped-def]
    replies = []
    for chunk_tokens in (16, 0):
        h = harness_factory(config={"prefill_chunk_tokens": chunk_tokens})
        h.links[0].keep_sent = True
        a, sink = h.open()
        request = _long(0, 40, outputs=[39], steps=4)
        request.forward_text.continuation_stop_token_ids.append(999)
        h.send(a, rq.allocate([0, 1, 2]), request)
        await h.settle()
        chunks = _chunks(h)
        assert [c.num_continuation_steps for c in chunks] == ([0, 0, 4] if chunk_tokens else [4])
        assert [list(c.continuation_stop_token_ids) for c in chunks][-1] == [999]
        assert all(not c.continuation_stop_token_ids for c in chunks[:-1])
        assert (chunks[-1].kv_last_page_length, len(chunks[-1].kv_page_ids)) == (12, 3)  # 44 slots: the steps too
        replies.append([e.forward_text for e in sink.of("forward_text")])
    assert len(replies[0][0].outputs) == 5 and replies[0] == replies[1]


async def test_too_long_for_the_context_or_the_pages_is_refused_naming_the_limit(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(config={"prefill_chunk_tokens": 16, "max_kv_pages_per_instance": 4}, max_context_tokens=256)
    a, sink = h.open()
    h.send(a, _long(0, 80, pages=list(range(5))))
    await h.settle()
    assert sink.trap is not None and "kv_page_ids lists 5 pages, more than max_kv_pages_per_instance 4" in sink.trap.reason
    b, sink_b = h.open()
    h.send(b, rq.forward_text([0], 1, [1] * 257, [0] * 257))
    await h.settle()
    assert sink_b.trap is not None
    assert "257 token_ids exceed the context window, max_context_tokens 256" in sink_b.trap.reason


def test_chunks_shrink_as_their_context_grows_each_within_the_first_chunks_cost() -> None:
    assert chunk_sizes(40, 5, 16, 0) == [16, 16, 8]  # fixed-size chunks without token slots
    for num_tokens, num_context, chunk_tokens, slots in [(4000, 0, 48, 850), (4000, 0, 16, 850), (300, 900, 32, 64),
                                                          (1000, 0, 2048, 1024), (37, 3, 5, 1)]:
        sizes = chunk_sizes(num_tokens, num_context, chunk_tokens, slots)
        assert sum(sizes) == num_tokens and min(sizes) >= 1 and max(sizes) <= chunk_tokens
        budget, done = chunk_cost(chunk_tokens, 0, slots), num_context
        least = -(-chunk_tokens // 8)
        for size in sizes[:-1]:  # each the most that fits the budget (the last one: what is left)
            assert chunk_cost(size, done, slots) <= budget or size == least
            assert size == chunk_tokens or chunk_cost(size + 1, done, slots) > budget
            done += size
        assert sizes == sorted(sizes, reverse=True)[: len(sizes) - 1] + sizes[-1:]  # never growing but the last
    sizes = chunk_sizes(4000, 0, 48, 850)
    assert sizes[0] == 48 and sizes[-2] < 12  # 4,000 tokens in: a chunk of ~8
    # Deep enough that one token costs more than the first chunk: an eighth of the chunk budget, never less.
    assert chunk_sizes(3, 10_000, 4, 1) == [1, 1, 1]
    assert chunk_sizes(100, 100_000, 64, 16) == [8] * 12 + [4]


async def test_shrinking_chunks_reach_the_executor_and_answer_as_the_unchunked_pass(
        harness_factory) -> None:  # type: ignore[no-untyped-def]
    outputs = [0, 70, 199, 120]
    replies = []
    for config in ({"prefill_chunk_tokens": 32, "prefill_chunk_token_slots": 16}, {"prefill_chunk_tokens": 0}):
        h = harness_factory(config=config)
        h.links[0].keep_sent = True
        a, sink = h.open()
        h.send(a, rq.allocate(list(range(14))), _long(0, 200, outputs))
        for _ in range(10):  # a round of ticks per few chunks
            await h.settle()
        chunks = _chunks(h)
        if config["prefill_chunk_tokens"]:
            sizes = chunk_sizes(200, 0, 32, 16)
            assert [len(c.token_ids) for c in chunks] == sizes and sizes[0] == 32 and sizes[-2] < 32
            starts = [sum(sizes[:j]) for j in range(len(sizes))]
            assert [c.position_ids[0] for c in chunks] == starts
            assert [len(c.kv_page_ids) for c in chunks] == [-(-(start + size) // PAGE) for start, size in
                                                             zip(starts, sizes, strict=True)]
        else:
            assert len(chunks) == 1
        replies.append([e.forward_text for e in sink.of("forward_text")])
    assert len(replies[0]) == 1 and replies[0] == replies[1]


async def test_get_info_reports_the_limits(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(max_batch_tokens=512)
    await h.settle()
    info = h.scheduler.get_info()
    assert (info.max_batch_tokens, info.prefill_chunk_tokens, info.max_tokens_per_forward_text) == (512, 256, 1024)
    assert info.max_tokens_per_command == 512  # a forward's inputs: one batch
    assert chunk_budget(0, 8192) == 2048 and chunk_budget(100_000, 8192) == 8192 and chunk_budget(0, 1) == 1


def test_executor_info_carries_max_batch_tokens() -> None:
    assert "max_batch_tokens" in executor_pb2.ExecutorServiceGetInfoResponse.DESCRIPTOR.fields_by_name


async def test_the_command_span_ends_once_with_its_reply(harness_factory) -> None:  # type: ignore[no-untyped-def]
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    h = harness_factory(tracer=SchedulerTracer(provider), config={"prefill_chunk_tokens": 16})
    a, sink = h.open()
    h.send(a, rq.allocate([0, 1, 2]), _long(0, 40, outputs=[3, 39], request_id=5), _long(0, 40, request_id=6))
    await h.settle()
    spans = [s for s in exporter.get_finished_spans() if s.name == "l4m.forward_text"]
    assert len(spans) == 2 and all(s.attributes["l4m.tokens"] == 40 for s in spans)
    assert len([s for s in exporter.get_finished_spans() if s.name == "scheduler.batch"]) >= 6
    assert len(sink.of("forward_text")) == 1 and len(sink.of("forward_text")[0].forward_text.outputs) == 2
