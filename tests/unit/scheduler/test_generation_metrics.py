"""Generation metrics of the scheduler (metrics.py, counted on core.py's reply path): generated tokens,
time to first token and inter-token latency, per instance, with a frozen clock only the test moves; and
the per-instance timing state goes when the instance ends, however it ends."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from l4m.scheduler import requests as rq
from l4m.scheduler.metrics import SchedulerMetrics
from l4m.v1 import common_pb2, l4m_pb2


class Clock:
    """Frozen time that only the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _continued(tokens: list[int], positions: list[int], steps: int, request_id: int = 0) -> l4m_pb2.SessionRequest:
    """One decode step on page 0 (16 slots) that runs `steps` continuation steps after it."""
    last = positions[-1] + 1 + steps
    request = rq.forward_text([0], last, tokens, positions, outputs=[len(tokens) - 1], request_id=request_id)
    request.forward_text.num_continuation_steps = steps
    return request


def _samples(metrics: SchedulerMetrics) -> dict[str, float]:
    """The scraped samples of the generation families, by name (and `le` for buckets)."""
    samples = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            if "generated_tokens" in sample.name or "token_seconds" in sample.name:
                le = sample.labels.get("le")
                samples[sample.name + (f"[{le}]" if le else "")] = sample.value
    return samples


async def test_a_reply_adds_its_sampled_tokens_continuation_included_and_no_distribution(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory()
    metrics = h.scheduler.metrics
    a, sink = h.open()
    h.send(a, rq.allocate([0]), rq.forward_text([0], 2, [3, 4], outputs=[1]))
    await h.settle()
    assert metrics.num_generated_tokens == 1
    h.send(a, _continued([7], [2], 5))  # one sampled token and 5 continuation steps: 6 tokens in one reply
    await h.settle()
    assert [len(e.forward_text.outputs) for e in sink.of("forward_text")] == [1, 6]
    assert metrics.num_generated_tokens == 7
    # A distribution is no sampled token; outputs of a forward without outputs are no reply at all.
    distribution = common_pb2.SamplerSpec(kind=common_pb2.SAMPLER_KIND_DISTRIBUTION, distribution_top_k=3)
    h.send(a, rq.forward_text([0], 9, [1], [8], outputs=[0], samplers=[distribution]),
           rq.forward_text([0], 10, [2], [9]))
    await h.settle()
    assert len(sink.of("forward_text")) == 3 and sink.of("forward_text")[-1].forward_text.outputs[0].distribution
    assert metrics.num_generated_tokens == 7
    h.send(a, rq.forward_text([0], 12, [5, 6], [10, 11], outputs=[0, 1], samplers=[rq.greedy(), distribution]))
    await h.settle()  # a token beside a distribution: one
    assert [o.WhichOneof("result") for o in sink.of("forward_text")[-1].forward_text.outputs] == ["token",
                                                                                                  "distribution"]
    assert metrics.num_generated_tokens == 8
    assert metrics.counts()["generated_tokens"] == 8
    assert _samples(metrics)["l4m_scheduler_generated_tokens_total"] == 8


async def test_time_to_first_token_is_observed_once_per_instance_from_its_session_opening(harness_factory) -> None:  # type: ignore[no-untyped-def]
    clock = Clock()
    h = harness_factory(clock=clock)
    ttft = h.scheduler.metrics.time_to_first_token
    a, _ = h.open()
    clock.now += 0.3
    h.send(a, rq.allocate([0]), rq.forward_text([0], 1, [3], outputs=[0]))
    await h.settle()
    assert sum(ttft.counts) == 1 and abs(ttft.sum_s - 0.3) < 1e-9
    clock.now += 0.1
    h.send(a, rq.forward_text([0], 2, [4], [1], outputs=[0]))
    await h.settle()
    assert sum(ttft.counts) == 1  # later tokens are inter-token gaps
    b, _ = h.open()  # another instance: its own first token, from its own opening
    clock.now += 2.0
    h.send(b, rq.allocate([0]), rq.forward_text([0], 1, [3], outputs=[0]))
    await h.settle()
    assert sum(ttft.counts) == 2 and abs(ttft.sum_s - 2.3) < 1e-9
    samples = _samples(h.scheduler.metrics)
    assert samples["l4m_scheduler_time_to_first_token_seconds_count"] == 2
    assert samples["l4m_scheduler_time_to_first_token_seconds_bucket[0.5]"] == 1  # 0.3 s
    assert samples["l4m_scheduler_time_to_first_token_seconds_bucket[2.5]"] == 2  # and 2.0 s


async def test_inter_token_latency_is_the_gap_over_the_later_replys_tokens_once_per_token(harness_factory) -> None:  # type: ignore[no-untyped-def]
    clock = Clock()
    h = harness_factory(clock=clock)
    itl = h.scheduler.metrics.inter_token
    a, _ = h.open()
    h.send(a, rq.allocate([0]), rq.forward_text([0], 1, [3], outputs=[0]))
    await h.settle()
    assert sum(itl.counts) == 0  # the first token has no gap before it
    clock.now += 0.02
    h.send(a, rq.forward_text([0], 2, [4], [1], outputs=[0]))
    await h.settle()
    assert sum(itl.counts) == 1 and abs(itl.sum_s - 0.02) < 1e-9
    clock.now += 0.16
    h.send(a, _continued([5], [2], 3))  # 4 tokens in one reply, 0.16 s after the last: 0.04 s each
    await h.settle()
    assert sum(itl.counts) == 5 and abs(itl.sum_s - 0.18) < 1e-9
    samples = _samples(h.scheduler.metrics)
    assert samples["l4m_scheduler_inter_token_seconds_bucket[0.025]"] == 1
    assert samples["l4m_scheduler_inter_token_seconds_bucket[0.05]"] == 5
    assert samples["l4m_scheduler_inter_token_seconds_count"] == 5
    # Two instances keep their own clocks: b's first token is no gap of a's.
    b, _ = h.open()
    h.send(b, rq.allocate([0]), rq.forward_text([0], 1, [3], outputs=[0]))
    await h.settle()
    assert sum(itl.counts) == 5


async def test_timing_state_goes_when_the_instance_ends_however_it_ends(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory()
    metrics = h.scheduler.metrics
    for round_ in range(30):
        a, _ = h.open(f"closed{round_}")
        b, _ = h.open(f"trapped{round_}")
        c, _ = h.open(f"destroyed{round_}")
        d, _ = h.open(f"idle{round_}")  # opened, never sampled a token
        for instance in (a, b, c):
            h.send(instance, rq.allocate([0]), rq.forward_text([0], 1, [3], outputs=[0]))
        await h.settle()
        assert metrics.num_timed_instances == 4
        h.scheduler.close_session(a)
        h.send(b, rq.deallocate([5]))  # never allocated: trapped
        h.scheduler.destroy_instance(c.instance_id, "done")
        h.scheduler.destroy_instance(d.instance_id, "done")
        await h.settle()
        assert not b.is_alive and metrics.num_timed_instances == 0
    assert metrics.num_generated_tokens == 90 and sum(metrics.time_to_first_token.counts) == 90


async def test_a_half_closed_sessions_last_reply_is_counted(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory()
    a, sink = h.open()
    h.send(a, rq.allocate([0]), rq.forward_text([0], 1, [3], outputs=[0]))
    h.scheduler.finish_session(a)  # the reply it waits for ends the session
    await h.settle()
    assert sink.ended and len(sink.of("forward_text")) == 1
    assert h.scheduler.metrics.num_generated_tokens == 1 and h.scheduler.metrics.num_timed_instances == 0


async def test_chunked_prefills_count_once_with_their_last_chunk(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(config={"prefill_chunk_tokens": 8})
    a, sink = h.open()
    h.send(a, rq.allocate([0, 1]), rq.forward_text([0, 1], 4, list(range(1, 21)), outputs=[19]))
    await h.settle()
    assert len(sink.of("forward_text")) == 1
    assert h.scheduler.metrics.num_generated_tokens == 1
    assert sum(h.scheduler.metrics.time_to_first_token.counts) == 1
