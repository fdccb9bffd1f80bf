"""Memory pressure over simulated executors: preemption to host swap and resumption (pages intact, commands
in order), who is preempted (priority, then launch order), shared pages, the admission queue (its bound
and timeout), eviction only when the swap space is full, and the metrics."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest

from l4m.scheduler import requests as rq
from l4m.scheduler.__main__ import parse_config
from l4m.scheduler.simulated import next_token
from l4m.v1 import common_pb2, l4m_pb2

TRAP = l4m_pb2


def _tokens(sink) -> list[int]:  # type: ignore[no-untyped-def]
    return [o.token.token_id for e in sink.of("forward_text") for o in e.forward_text.outputs]


def _fill(h, instance, pages: list[int], first_token: int) -> None:  # type: ignore[no-untyped-def]
    """Allocate `pages` and write 16 tokens into each (page size 16)."""
    h.send(instance, rq.allocate(pages))
    tokens = [first_token + i for i in range(16 * len(pages))]
    h.send(instance, rq.forward_text(pages, 16, tokens))


def _priority(level: int) -> l4m_pb2.SessionRequest:
    return rq.request(set_stream_priority=l4m_pb2.SetStreamPriorityCommand(priority=level))


async def test_a_preempted_instance_resumes_with_its_pages_intact_and_its_commands_in_order(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(num_kv_pages=8, num_swap_slots=8)
    old, sink_old = h.open("old")
    new, sink_new = h.open("new")
    _fill(h, new, [0, 1, 2, 3], 100)
    await h.settle()
    _fill(h, old, [0, 1, 2, 3], 500)
    await h.settle()
    before = h.sim().contents(new.table.kv_pages.values())
    h.send(old, rq.allocate([4, 5]))  # 0 free: "new" is preempted, all 4 of its pages to swap
    await h.settle()
    assert new.is_suspended and len(new.table.swapped_kv_pages) == 4 and not new.table.kv_pages
    assert old.table.kv_pages.keys() == {0, 1, 2, 3, 4, 5} and h.free_pages() == 2
    # Its later commands wait, in order: no reply while suspended.
    h.send(new, rq.allocate([4]), rq.forward_text([0, 1, 2, 3, 4], 1, [7], positions=[64], outputs=[0], request_id=9))
    await h.settle()
    assert not sink_new.of("forward_text") and new.is_suspended and len(new.held) == 2
    h.send(old, rq.deallocate([0, 1, 2, 3, 4, 5]))
    await h.settle()
    # Resumed on fresh pages (its virtual ids unchanged), its K/V copied back exactly, then its commands ran.
    assert not new.is_parked and new.table.kv_pages.keys() == {0, 1, 2, 3, 4}
    assert h.sim().contents([new.table.kv_pages[v] for v in (0, 1, 2, 3)]) == before
    assert _tokens(sink_new) == [next_token(7, 64, 1000)] and sink_new.of("forward_text")[0].request_id == 9
    counts = h.scheduler.metrics.counts()
    assert counts["preemptions"] == 1 and counts["resumes"] == 1 and counts["kv_pages_swapped_out"] == 4
    assert sink_new.trap is None and sink_old.trap is None and h.sim().num_errors == 0
    assert h.scheduler.executors[0].resources.swap_slots.num_free == 8  # type: ignore[union-attr]


async def test_victims_are_chosen_by_priority_then_newest_and_never_for_a_later_one(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(num_kv_pages=6, num_swap_slots=8)
    low_old, _ = h.open("low_old")
    normal_mid, _ = h.open("normal_mid")
    normal_new, _ = h.open("normal_new")
    h.send(low_old, _priority(l4m_pb2.STREAM_PRIORITY_LOW), rq.allocate([0, 1]))
    h.send(normal_mid, rq.allocate([0, 1]))
    h.send(normal_new, rq.allocate([0, 1]))
    await h.settle()
    high_newest, sink_high = h.open("high_newest")
    h.send(high_newest, _priority(l4m_pb2.STREAM_PRIORITY_HIGH), rq.allocate([0, 1, 2]))
    await h.settle()
    # LOW goes first although it is the oldest; then the newest NORMAL; the older NORMAL keeps its pages.
    assert low_old.is_suspended and normal_new.is_suspended and not normal_mid.is_parked
    assert high_newest.table.kv_pages.keys() == {0, 1, 2} and sink_high.trap is None
    # The older NORMAL instance cannot preempt the HIGH one (it ranks before): it waits instead.
    h.send(normal_mid, rq.allocate([2, 3]))
    await h.settle()
    assert normal_mid.is_waiting and not high_newest.is_parked
    # Pages free up: the queue resumes in rank order (normal_mid, normal_new, then LOW).
    h.scheduler.close_session(high_newest)
    await h.settle()
    assert normal_mid.table.kv_pages.keys() == {0, 1, 2, 3} and not normal_mid.is_parked
    assert not normal_new.is_parked and normal_new.table.kv_pages.keys() == {0, 1}
    assert low_old.is_suspended and h.free_pages() == 0  # 2 pages would fit nowhere yet
    h.scheduler.close_session(normal_new)
    await h.settle()
    assert not low_old.is_parked and low_old.table.kv_pages.keys() == {0, 1} and h.sim().num_errors == 0


async def test_shared_pages_stay_resident_and_only_the_rest_is_swapped(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(num_kv_pages=6, num_swap_slots=8)
    old, _ = h.open("old")
    new, sink_new = h.open("new")
    _fill(h, new, [0, 1, 2], 10)
    h.send(new, rq.export("prefix", [0]))  # page 0 is shared (frozen, refcount 2): it cannot move
    await h.settle()
    _fill(h, old, [0, 1, 2], 50)
    await h.settle()
    shared = new.table.kv_pages[0]
    h.send(old, rq.allocate([3, 4]))
    await h.settle()
    assert new.is_suspended and new.table.kv_pages == {0: shared} and new.table.swapped_kv_pages.keys() == {1, 2}
    assert h.scheduler.metrics.counts()["kv_pages_swapped_out"] == 2
    h.scheduler.close_session(old)
    await h.settle()
    assert not new.is_parked and new.table.kv_pages[0] == shared and new.table.kv_pages.keys() == {0, 1, 2}
    h.send(new, rq.forward_text([0, 1, 2, 3], 1, [5], positions=[48], outputs=[0]))  # needs page 3: refused
    await h.settle()
    assert sink_new.trap.kind == TRAP.TRAP_KIND_INVALID_COMMAND and h.sim().num_errors == 0  # type: ignore[union-attr]


async def test_an_instance_ending_while_suspended_frees_its_swap_slots(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(num_kv_pages=4, num_swap_slots=4)
    old, _ = h.open("old")
    new, _ = h.open("new")
    _fill(h, new, [0, 1, 2], 10)
    await h.settle()
    h.send(old, rq.allocate([0, 1, 2]))
    await h.settle()
    swap = h.scheduler.executors[0].resources.swap_slots  # type: ignore[union-attr]
    assert new.is_suspended and swap.num_free == 1
    h.scheduler.destroy_instance("new", "gone")
    await h.settle()
    assert swap.num_free == 4 and not new.table.swapped_kv_pages and not h.scheduler._parked
    assert old.table.kv_pages.keys() == {0, 1, 2} and h.sim().num_errors == 0


async def test_with_the_swap_space_full_the_victim_is_evicted_saying_so(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(num_kv_pages=4, num_swap_slots=1)
    old, _ = h.open("old")
    new, sink_new = h.open("new")
    h.send(new, rq.allocate([0, 1, 2]))
    await h.settle()
    h.send(old, rq.allocate([0]))
    await h.settle()
    h.send(old, rq.allocate([1, 2]))
    await h.settle()
    assert sink_new.trap.kind == TRAP.TRAP_KIND_EVICTED  # type: ignore[union-attr]
    assert "the swap space is full: 1 of 1 swap slots free, this instance's 3 pages would need them" in (
        sink_new.trap.reason)  # type: ignore[union-attr]
    assert old.table.kv_pages.keys() == {0, 1, 2} and h.sim().num_errors == 0


async def test_a_requester_nobody_can_make_room_for_waits_then_times_out_saying_so(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(num_kv_pages=4, num_swap_slots=4, config={"admission_timeout_s": 0.2})
    old, _ = h.open("old")
    new, sink_new = h.open("new")
    h.send(old, rq.allocate([0, 1, 2]))
    await h.settle()
    h.send(new, rq.allocate([0, 1], request_id=7), rq.forward_text([0], 1, [1], outputs=[0]))
    await h.settle()
    assert new.is_waiting and sink_new.trap is None and not sink_new.events and h.free_pages() == 1
    metrics = generate_latest(h.scheduler.metrics.registry).decode()
    assert "l4m_scheduler_admission_queue_depth 1.0" in metrics
    await asyncio.sleep(0.3)
    assert sink_new.trap.kind == TRAP.TRAP_KIND_RESOURCE_EXHAUSTED and sink_new.trap.offending_request_id == 7  # type: ignore[union-attr]
    assert "waited 0.2 s in the admission queue for 2 kv pages (--admission-timeout-s 0.2)" in sink_new.trap.reason  # type: ignore[union-attr]
    assert old.is_alive and not h.scheduler._waiters and h.free_pages() == 1


async def test_a_waiting_requester_is_served_when_pages_free_up(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(num_kv_pages=4, num_swap_slots=4)
    old, _ = h.open("old")
    new, sink_new = h.open("new")
    h.send(old, rq.allocate([0, 1, 2]))
    await h.settle()
    h.send(new, rq.allocate([0, 1]), rq.forward_text([0], 1, [3], outputs=[0]))
    await h.settle()
    assert new.is_waiting
    h.send(old, rq.deallocate([2]))
    await h.settle()
    assert not new.is_parked and _tokens(sink_new) == [next_token(3, 0, 1000)] and not h.scheduler._waiters
    metrics = generate_latest(h.scheduler.metrics.registry).decode()
    assert "l4m_scheduler_admission_wait_seconds_count 1.0" in metrics
    assert "l4m_scheduler_admission_queue_depth 0.0" in metrics


async def test_the_admission_queue_is_bounded(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(num_kv_pages=2, num_swap_slots=4, config={"max_waiting_instances": 1})
    old, _ = h.open("old")
    first, _ = h.open("first")
    second, sink_second = h.open("second")
    h.send(old, rq.allocate([0, 1]))
    await h.settle()
    h.send(first, rq.allocate([0]))
    await h.settle()
    h.send(second, rq.allocate([0], request_id=3))
    await h.settle()
    assert first.is_waiting and sink_second.trap.kind == TRAP.TRAP_KIND_RESOURCE_EXHAUSTED  # type: ignore[union-attr]
    assert "the admission queue is full (1 of 1 instances wait; --max-waiting-instances)" in sink_second.trap.reason  # type: ignore[union-attr]
    assert sink_second.trap.offending_request_id == 3  # type: ignore[union-attr]


async def test_when_everyone_waits_holding_pages_the_newest_is_swapped_out(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(num_kv_pages=8, num_swap_slots=8)
    a, sink_a = h.open("a")
    b, sink_b = h.open("b")
    _fill(h, a, [0, 1, 2, 3], 1)
    await h.settle()
    _fill(h, b, [0, 1, 2, 3], 200)
    await h.settle()
    b_pages = h.sim().contents(b.table.kv_pages.values())
    # Both grow at once, in one allocate batch; b's allocate comes first.
    h.send(b, rq.allocate([4]), rq.forward_text([0, 1, 2, 3, 4], 1, [9], positions=[64], outputs=[0]))
    h.send(a, rq.allocate([4]), rq.forward_text([0, 1, 2, 3, 4], 1, [8], positions=[64], outputs=[0]))
    await h.settle()
    assert _tokens(sink_a) == [next_token(8, 64, 1000)] and b.is_suspended
    h.scheduler.close_session(a)
    await h.settle()
    assert _tokens(sink_b) == [next_token(9, 64, 1000)] and not b.is_parked
    assert h.sim().contents([b.table.kv_pages[v] for v in range(4)]) == b_pages
    assert sink_b.trap is None and h.sim().num_errors == 0
    metrics = generate_latest(h.scheduler.metrics.registry).decode()
    for line in ("l4m_scheduler_preemptions_total 1.0", "l4m_scheduler_resumes_total 1.0",
                 "l4m_scheduler_kv_pages_swapped 0.0", "l4m_scheduler_suspended_instances 0.0"):
        assert line in metrics


def test_the_pressure_knobs_reach_the_config_and_bad_values_are_refused(capsys) -> None:  # type: ignore[no-untyped-def]
    config = parse_config(["--executor", "unix:/x", "--max-waiting-instances", "0", "--admission-timeout-s", "2.5"])[0]
    assert (config.max_waiting_instances, config.admission_timeout_s) == (0, 2.5)
    defaults = parse_config(["--executor", "unix:/x"])[0]
    assert (defaults.max_waiting_instances, defaults.admission_timeout_s) == (256, 60.0)
    for flag, value, message in (("--max-waiting-instances", "-1", "--max-waiting-instances must be >= 0"),
                                 ("--admission-timeout-s", "0", "--admission-timeout-s must be more than 0")):
        with pytest.raises(SystemExit) as exit_info:
            parse_config(["--executor", "unix:/x", flag, value])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


async def test_a_waiter_resumed_in_the_step_that_parked_it_keeps_its_commands_in_order(harness_factory) -> None:  # type: ignore[no-untyped-def]
    """Its allocate waits (held) while the command after it is still pending on its stream; pages free up in
    the same step, so it resumes at once: the allocate must go first, not after that command."""
    h = harness_factory(num_kv_pages=4, num_swap_slots=4)
    old, _ = h.open("old")
    new, sink_new = h.open("new")
    h.send(old, rq.allocate([0, 1, 2]))
    h.send(new, rq.allocate([0]))
    await h.settle()
    h.send(new, rq.allocate([1]), rq.forward_text([0, 1], 1, [4], positions=[16], outputs=[0]))
    h.send(old, rq.deallocate([2]))  # fires after the allocate batch, in the same step
    await h.settle()
    assert sink_new.trap is None, sink_new.trap.reason  # type: ignore[union-attr]
    assert _tokens(sink_new) == [next_token(4, 16, 1000)] and not new.is_parked and h.sim().num_errors == 0


def test_l4m_up_passes_its_swap_space_to_every_executor(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import argparse

    from l4m.cluster import service_specs
    from l4m.up import add_cluster_arguments, cluster_config

    parser = argparse.ArgumentParser()
    add_cluster_arguments(parser)
    for flags, expected in (([], None), (["--swap-space-pages", "0"], "0"), (["--swap-space-pages", "96"], "96")):
        config = cluster_config(parser.parse_args(["--state-dir", str(tmp_path), "--devices", "cpu,cpu", *flags]))
        executors = [s for s in service_specs(config) if s.name.startswith("executor-")]
        assert len(executors) == 2
        for spec in executors:
            given = spec.argv[spec.argv.index("--swap-space-pages") + 1] if "--swap-space-pages" in spec.argv else None
            assert given == expected


def _allocate_waiting(ids: list[int], max_wait_ms: int, request_id: int) -> l4m_pb2.SessionRequest:
    item = common_pb2.AllocateItem(kind=common_pb2.RESOURCE_KIND_KV_PAGE, ids=ids, max_wait_ms=max_wait_ms)
    return rq.request(allocate=item, request_id=request_id)


async def test_an_allocate_may_shorten_its_wait_or_refuse_to_wait(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(num_kv_pages=4, num_swap_slots=4, config={"admission_timeout_s": 0.3})
    old, _ = h.open("old")
    h.send(old, rq.allocate([0, 1, 2]))
    await h.settle()
    impatient, sink_impatient = h.open("impatient")
    brief, sink_brief = h.open("brief")
    patient, sink_patient = h.open("patient")
    h.send(impatient, _allocate_waiting([0, 1], 0, 4))
    h.send(brief, _allocate_waiting([0, 1], 50, 5))
    h.send(patient, _allocate_waiting([0, 1], 10_000, 6))  # longer than the scheduler's: its 0.3 s hold
    await h.settle()
    assert sink_impatient.trap.kind == TRAP.TRAP_KIND_RESOURCE_EXHAUSTED  # type: ignore[union-attr]
    assert "and the allocate asked not to wait (max_wait_ms 0)" in sink_impatient.trap.reason  # type: ignore[union-attr]
    assert brief.is_waiting and patient.is_waiting
    await asyncio.sleep(0.15)
    assert "(its allocate's max_wait_ms 50)" in sink_brief.trap.reason and patient.is_waiting  # type: ignore[union-attr]
    await asyncio.sleep(0.3)
    assert "(--admission-timeout-s 0.3)" in sink_patient.trap.reason  # type: ignore[union-attr]
    assert sink_patient.trap.offending_request_id == 6 and old.is_alive and h.free_pages() == 1  # type: ignore[union-attr]
