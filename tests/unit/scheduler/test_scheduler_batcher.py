"""The batcher state machine with a fake clock: firing rule of every strategy, priorities, order."""

from __future__ import annotations

import pytest

from l4m.scheduler import requests as rq
from l4m.scheduler.batcher import (
    Adaptive,
    BatchBounds,
    Batcher,
    BatchQueue,
    Command,
    Eager,
    KOnly,
    KOrT,
    Stream,
    TOnly,
    parse_strategy,
)
from l4m.scheduler.kinds import KINDS
from l4m.v1 import common_pb2, executor_pb2
from l4m.wire import limits


class FakeExecutor:
    num_forward_in_flight = 0


class FakeInstance:
    is_alive = True


class Rig:
    """One executor's queues, streams of fake instances, and a log of fired batches."""

    def __init__(self, strategy: object, max_batch_tokens: int = 1000, bounds: BatchBounds | None = None) -> None:
        self.now = 0.0
        self.executor = FakeExecutor()
        self.batcher = Batcher(strategy)  # type: ignore[arg-type]
        self.queues = {k: BatchQueue(k, self.executor, max_batch_tokens, bounds, is_forward=KINDS[k].is_forward)
                       for k in ("forward_text", "allocate", "sample_top_k")}
        self.batcher.add_queues(list(self.queues.values()))
        self.fired: list[tuple[str, list[tuple[int, int]]]] = []
        self.locals: list[int] = []

    def stream(self) -> Stream:
        return Stream(FakeInstance(), 0)

    def submit(self, stream: Stream, kind: str, request_id: int, num_tokens: int = 1, item: object = None) -> None:
        is_executor_kind = item is not None and KINDS[kind].is_executor_kind  # an item-less command costs nothing
        self.batcher.submit(Command(stream, request_id, kind, item, self.now, num_tokens,
                                    is_executor_kind=is_executor_kind))

    def route(self, command: Command) -> BatchQueue | None:
        if command.kind == "synchronize":
            self.locals.append(command.request_id)
            return None
        return self.queues[command.kind]

    def fire(self, queue: BatchQueue, commands: list[Command]) -> None:
        self.fired.append((queue.kind, [(id(c.stream), c.request_id) for c in commands]))
        if queue.is_forward and isinstance(self.batcher.forward_strategy, Adaptive):
            self.executor.num_forward_in_flight += 1

    def step(self) -> None:
        while True:
            self.batcher.pump(self.route)
            self.batcher.fire_due(self.now, self.fire)
            if not self.batcher.has_ready():
                break

    def fired_ids(self) -> list[list[int]]:
        return [[r for _, r in items] for _, items in self.fired]


def test_eager_fires_everything_at_once() -> None:
    rig = Rig(Eager())
    a, b = rig.stream(), rig.stream()
    rig.submit(a, "forward_text", 1)
    rig.submit(b, "forward_text", 2)
    rig.step()
    assert rig.fired_ids() == [[1, 2]]


def test_t_only_waits_for_the_oldest_item_to_age() -> None:
    rig = Rig(TOnly(0.010))
    a, b = rig.stream(), rig.stream()
    rig.submit(a, "forward_text", 1)
    rig.now = 0.004
    rig.submit(b, "forward_text", 2)
    rig.step()
    assert rig.fired == []
    assert rig.batcher.next_deadline() == pytest.approx(0.010)
    rig.now = 0.0099
    rig.step()
    assert rig.fired == []
    rig.now = 0.010
    rig.step()
    assert rig.fired_ids() == [[1, 2]]
    assert rig.batcher.next_deadline() is None


def test_k_only_fires_exactly_k_and_never_fewer() -> None:
    rig = Rig(KOnly(2))
    streams = [rig.stream() for _ in range(3)]
    rig.submit(streams[0], "forward_text", 1)
    rig.step()
    rig.now = 100.0
    rig.step()
    assert rig.fired == []  # pure count rule: one item waits however long
    rig.submit(streams[1], "forward_text", 2)
    rig.submit(streams[2], "forward_text", 3)
    rig.step()
    assert rig.fired_ids() == [[1, 2]]
    assert rig.queues["forward_text"].num_items == 1


def test_k_or_t_fires_at_k_or_when_the_oldest_waited_t() -> None:
    rig = Rig(KOrT(3, 0.005))
    streams = [rig.stream() for _ in range(4)]
    for i in range(3):
        rig.submit(streams[i], "forward_text", i)
    rig.step()
    assert rig.fired_ids() == [[0, 1, 2]]
    rig.submit(streams[3], "forward_text", 3)
    rig.step()
    assert len(rig.fired) == 1
    rig.now = 0.005
    rig.step()
    assert rig.fired_ids() == [[0, 1, 2], [3]]


def test_adaptive_keeps_one_forward_batch_in_flight_then_fires_all_queued() -> None:
    rig = Rig(Adaptive())
    streams = [rig.stream() for _ in range(4)]
    rig.submit(streams[0], "forward_text", 0)
    rig.step()
    assert rig.fired_ids() == [[0]]
    for i in range(1, 4):
        rig.submit(streams[i], "forward_text", i)
    rig.step()
    assert len(rig.fired) == 1  # one in flight: the rest wait
    rig.executor.num_forward_in_flight = 0  # its reply came back
    rig.step()
    assert rig.fired_ids() == [[0], [1, 2, 3]]


def test_non_forward_kinds_fire_eagerly_under_any_forward_strategy() -> None:
    rig = Rig(KOnly(100))
    rig.submit(rig.stream(), "allocate", 1)
    rig.step()
    assert rig.fired == [("allocate", rig.fired[0][1])]


def test_high_priority_items_fire_before_normal_and_low() -> None:
    rig = Rig(KOnly(2))
    low1, low2, high1, high2, normal = (rig.stream() for _ in range(5))
    for stream in (low1, low2):
        rig.batcher.set_priority(stream, 1)
    for stream in (high1, high2):
        rig.batcher.set_priority(stream, 3)
    rig.submit(low1, "forward_text", 10)
    rig.submit(low2, "forward_text", 11)
    rig.submit(normal, "forward_text", 20)
    rig.submit(high1, "forward_text", 30)
    rig.submit(high2, "forward_text", 31)
    rig.step()
    assert rig.fired_ids() == [[30, 31], [20, 10]]


def test_vertical_grouping_and_per_stream_order_across_kinds() -> None:
    rig = Rig(KOnly(3))
    a, b = rig.stream(), rig.stream()
    rig.submit(a, "forward_text", 1)
    rig.submit(a, "forward_text", 2)  # grouped with 1
    rig.submit(a, "allocate", 3)  # must wait for 1 and 2 to fire
    rig.submit(a, "synchronize", 4)
    rig.step()
    assert rig.fired == [] and rig.locals == []
    assert a.num_queued == 2
    rig.submit(b, "forward_text", 5)
    rig.step()
    assert rig.fired_ids() == [[1, 2, 5], [3]]
    assert rig.locals == [4]  # ran after everything before it was sent


def test_a_group_split_across_batches_keeps_the_stream_blocked_until_all_fired() -> None:
    rig = Rig(KOnly(1))
    a = rig.stream()
    rig.submit(a, "forward_text", 1)
    rig.submit(a, "forward_text", 2)
    rig.submit(a, "allocate", 3)
    rig.step()
    assert rig.fired_ids() == [[1], [2], [3]]


def test_forward_batches_respect_max_batch_tokens() -> None:
    rig = Rig(Eager(), max_batch_tokens=10)
    streams = [rig.stream() for _ in range(3)]
    for i, stream in enumerate(streams):
        rig.submit(stream, "forward_text", i, num_tokens=6)
    rig.step()
    assert rig.fired_ids() == [[0], [1], [2]]


def test_dropped_stream_and_removed_instance_leave_the_queues() -> None:
    rig = Rig(KOnly(5))
    a, b = rig.stream(), rig.stream()
    rig.submit(a, "forward_text", 1)
    rig.submit(b, "forward_text", 2)
    rig.step()
    rig.queues["forward_text"].remove_instance(a.instance)
    rig.batcher.drop_stream(a)
    assert rig.queues["forward_text"].num_items == 1
    assert rig.batcher.num_queued == 1


@pytest.mark.parametrize(
    ("spec", "name"),
    [
        ("adaptive", "adaptive"),
        ("adaptive:250", "adaptive"),
        ("adaptive:50", "adaptive:50"),
        ("adaptive:0", "adaptive:0"),
        ("adaptive:7.5", "adaptive:7.5"),
        ("adaptive:250:150", "adaptive"),
        ("adaptive:250:0", "adaptive:250:0"),
        ("adaptive:100:40", "adaptive:100:40"),
        ("adaptive:250:150:1", "adaptive"),
        ("adaptive:250:150:0.5", "adaptive:250:150:0.5"),
        ("adaptive:100:40:2", "adaptive:100:40:2"),
        ("t-only:5", "t-only:5"),
        ("k-only:8", "k-only:8"),
        ("k-or-t:8:2.5", "k-or-t:8:2.5"),
    ],
)
def test_parse_strategy(spec: str, name: str) -> None:
    assert parse_strategy(spec).name == name


@pytest.mark.parametrize("spec", ["", "fast", "k-only:0", "k-only:x", "t-only", "t-only:-1", "k-or-t:1", "adaptive:-1", "adaptive:x", "adaptive:1:2:3:4", "adaptive:1:2:-3", "adaptive:1:2:x", "adaptive:1:-2", "adaptive:1:x"])
def test_parse_strategy_rejects_malformed_specs(spec: str) -> None:
    with pytest.raises(ValueError, match="bad batching strategy"):
        parse_strategy(spec)


# ---- adaptive regrouping: lock-step streams share one batch ----


class DecodeRig(Rig):
    """Adaptive with regrouping; `answer` plays the executor returning the batch in flight."""

    def __init__(self, strategy: Adaptive | None = None) -> None:
        super().__init__(strategy or Adaptive(max_hold_s=0.050, hold_fraction=0.5))
        self.in_flight: list[Stream] = []
        self.by_id: dict[int, Stream] = {}

    def stream(self) -> Stream:
        stream = super().stream()
        self.by_id[id(stream)] = stream
        return stream

    def fire(self, queue: BatchQueue, commands: list[Command]) -> None:
        super().fire(queue, commands)
        self.in_flight = [c.stream for c in commands]
        self.sent_at = self.now

    def answer(self) -> list[Stream]:
        """The batch in flight returns now: the batcher learns which streams were answered."""
        returned, self.in_flight = self.in_flight, []
        self.executor.num_forward_in_flight = 0
        self.batcher.forward_returned(self.queues["forward_text"], returned, self.now, self.now - self.sent_at)
        self.step()
        return returned

    def batch_sizes(self) -> list[int]:
        return [len(items) for _, items in self.fired]


def test_regrouping_merges_two_alternating_groups_into_one_batch() -> None:
    rig = DecodeRig()
    group_a = [rig.stream() for _ in range(3)]
    group_b = [rig.stream() for _ in range(3)]
    request = iter(range(1000))
    for s in group_a:
        rig.submit(s, "forward_text", next(request))
    rig.step()  # A fires alone
    rig.now = 0.010
    for s in group_b:  # B arrives while A runs
        rig.submit(s, "forward_text", next(request))
    rig.step()
    assert rig.batch_sizes() == [3]
    rig.now = 0.100  # A returns after 100 ms: B is queued, but A's streams are awaited
    returned = rig.answer()
    assert rig.batch_sizes() == [3], "B must wait for A's streams (hold = min(50 ms, 0.5 x 100 ms))"
    assert rig.batcher.next_deadline() == pytest.approx(0.150)
    rig.now = 0.102
    for s in returned[:2]:
        rig.submit(s, "forward_text", next(request))
        rig.step()
    assert rig.batch_sizes() == [3], "one of A's streams is still awaited"
    rig.submit(returned[2], "forward_text", next(request))
    rig.step()  # the last awaited stream arrived: everything fires at once, before the deadline
    assert rig.batch_sizes() == [3, 6]
    assert rig.batcher.next_deadline() is None


def test_a_lone_stream_is_never_held() -> None:
    rig = DecodeRig()
    s = rig.stream()
    rig.submit(s, "forward_text", 0)
    rig.step()
    for step in range(1, 4):
        rig.now += 0.020
        rig.answer()
        assert rig.batcher.next_deadline() is None  # nothing queued: no timer
        rig.submit(s, "forward_text", step)
        rig.step()
        assert len(rig.fired) == step + 1, "its next step fires the moment it arrives"


def test_a_silent_stream_delays_the_others_by_the_bound_once() -> None:
    rig = DecodeRig()
    quiet, busy, other = rig.stream(), rig.stream(), rig.stream()
    rig.submit(quiet, "forward_text", 0)
    rig.submit(busy, "forward_text", 1)
    rig.step()
    rig.now = 0.010
    rig.submit(other, "forward_text", 2)
    rig.step()
    rig.now = 0.210  # the batch took 200 ms: hold = min(50 ms, 100 ms) = 50 ms
    rig.answer()
    rig.submit(busy, "forward_text", 3)
    rig.step()
    assert rig.batch_sizes() == [2], "`quiet` is still awaited"
    assert rig.batcher.next_deadline() == pytest.approx(0.260)
    rig.now = 0.259
    rig.step()
    assert rig.batch_sizes() == [2]
    rig.now = 0.260  # the deadline: fire without `quiet`, and stop waiting for it
    rig.step()
    assert rig.fired_ids()[-1] == [2, 3]
    assert not rig.queues["forward_text"].awaited


def test_the_hold_is_a_fraction_of_the_batch_time_for_fast_batches() -> None:
    rig = DecodeRig()
    a, b = rig.stream(), rig.stream()
    rig.submit(a, "forward_text", 0)
    rig.step()
    rig.submit(b, "forward_text", 1)
    rig.now = 0.004  # a 4 ms batch (a GPU): hold 2 ms, not 50
    rig.answer()
    assert rig.batcher.next_deadline() == pytest.approx(0.006)


def test_by_default_the_hold_is_the_returned_batch_time() -> None:
    """Where steps take about as long at any batch size (a GPU), waiting up to one step for the stragglers
    beats running two alternating half batches."""
    rig = DecodeRig(Adaptive())
    a, b = rig.stream(), rig.stream()
    rig.submit(a, "forward_text", 0)
    rig.step()
    rig.submit(b, "forward_text", 1)
    rig.now = 0.004  # a 4 ms batch: a waits up to 4 ms, b with it
    rig.answer()
    assert rig.batcher.next_deadline() == pytest.approx(0.008)
    rig.now = 0.007
    rig.submit(a, "forward_text", 2)
    rig.step()
    assert rig.fired_ids()[-1] == [1, 2], "a answered within the hold: one batch of both"


def test_a_stream_the_hold_ran_out_on_is_not_awaited_until_it_answers_within_one() -> None:
    """A controller that is always slow to answer (it computes between steps) holds the others back once,
    not at every step; once it answers within a hold again it is waited for again."""
    rig = DecodeRig()  # hold = min(50 ms, 0.5 x the batch's time)
    slow, a, b = rig.stream(), rig.stream(), rig.stream()
    request = iter(range(1000))
    for s in (slow, a, b):
        rig.submit(s, "forward_text", next(request))
    rig.step()
    rig.now = 0.040  # 40 ms batch: hold 20 ms, until 0.060
    rig.answer()
    rig.now = 0.041
    for s in (a, b):
        rig.submit(s, "forward_text", next(request))
    rig.step()
    assert rig.batch_sizes() == [3], "slow is awaited the first time"
    rig.now = 0.060
    rig.step()  # the hold ran out on slow: a and b go without it
    assert rig.batch_sizes() == [3, 2]
    assert slow in rig.queues["forward_text"].late
    rig.now = 0.070
    rig.submit(slow, "forward_text", next(request))  # after the hold: still late
    rig.step()
    rig.now = 0.100  # [a, b] returns after 40 ms; slow is queued, a and b are awaited
    rig.answer()
    rig.now = 0.101
    for s in (a, b):
        rig.submit(s, "forward_text", next(request))
    rig.step()
    assert rig.batch_sizes() == [3, 2, 3]
    rig.now = 0.141  # that batch returns; slow is late: a and b do not wait for it
    rig.answer()
    rig.now = 0.142
    for s in (a, b):
        rig.submit(s, "forward_text", next(request))
    rig.step()
    assert rig.batch_sizes() == [3, 2, 3, 2], "a and b fire the moment they are both back"
    assert rig.batcher.next_deadline() is None
    rig.now = 0.150  # slow answers within that batch's hold (until 0.161): it is waited for again
    rig.submit(slow, "forward_text", next(request))
    rig.step()
    assert slow not in rig.queues["forward_text"].late
    rig.now = 0.182
    rig.answer()  # [a, b] returns: slow is queued, a and b are awaited and answer
    for s in (a, b):
        rig.submit(s, "forward_text", next(request))
    rig.step()
    assert rig.batch_sizes()[-1] == 3
    rig.now = 0.222
    rig.answer()
    rig.submit(a, "forward_text", next(request))
    rig.submit(b, "forward_text", next(request))
    rig.step()
    assert rig.batch_sizes()[-1] == 3, "slow, punctual again, is awaited again: a and b wait for it"
    rig.now = 0.223
    rig.submit(slow, "forward_text", next(request))
    rig.step()
    assert rig.batch_sizes()[-1] == 3 and len(rig.fired) == 6


def test_an_ended_instance_is_no_longer_awaited() -> None:
    rig = DecodeRig()
    leaving, staying, waiting = rig.stream(), rig.stream(), rig.stream()
    rig.submit(leaving, "forward_text", 0)
    rig.submit(staying, "forward_text", 1)
    rig.step()
    rig.submit(waiting, "forward_text", 2)
    rig.now = 0.050
    rig.answer()
    rig.submit(staying, "forward_text", 3)
    rig.step()
    assert rig.batch_sizes() == [2]
    rig.batcher.drop_stream(leaving)  # its instance ended
    rig.step()
    assert rig.fired_ids()[-1] == [2, 3]


def test_streams_already_queued_again_are_not_awaited() -> None:
    """A stream that pipelined its next step before the reply came is in the queue: no hold for it."""
    rig = DecodeRig()
    a, b = rig.stream(), rig.stream()
    rig.submit(a, "forward_text", 0)
    rig.step()
    rig.submit(a, "forward_text", 1)  # sent ahead of the reply
    rig.submit(b, "forward_text", 2)
    rig.step()
    rig.now = 0.030
    rig.answer()
    assert rig.fired_ids()[-1] == [1, 2]


def test_adaptive_0_fires_at_once_as_before() -> None:
    rig = DecodeRig(Adaptive(max_hold_s=0.0))
    a, b = rig.stream(), rig.stream()
    rig.submit(a, "forward_text", 0)
    rig.step()
    rig.submit(b, "forward_text", 1)
    rig.now = 0.100
    rig.answer()
    assert rig.batch_sizes() == [1, 1]


# ---- the launch hold: a burst of launches shares its first batch ----


def launch_rig(launch_hold_s: float = 0.100) -> DecodeRig:
    return DecodeRig(Adaptive(max_hold_s=0.050, hold_fraction=0.5, launch_hold_s=launch_hold_s))


def launch(rig: DecodeRig, count: int) -> list[Stream]:
    """`count` instances registered now (the scheduler calls `instance_launched` at RegisterInstance)."""
    streams = [rig.stream() for _ in range(count)]
    for s in streams:
        rig.batcher.instance_launched(s.instance, rig.now)
    return streams


def test_a_burst_of_launches_fires_its_first_forwards_as_one_batch() -> None:
    rig = launch_rig()
    streams = launch(rig, 3)
    for request, at in enumerate((0.010, 0.030, 0.050)):
        rig.now = at
        rig.submit(streams[request], "forward_text", request, num_tokens=100)
        rig.step()
        if request < 2:
            assert rig.fired == [], f"{2 - request} launched instance(s) have not sent their first forward"
            assert rig.batcher.next_deadline() == pytest.approx(0.100)  # the oldest launch stops being waited for
    assert rig.fired_ids() == [[0, 1, 2]], "the last launch's forward arrived: all three fire, before the bound"
    assert not rig.batcher.launched and rig.batcher.next_deadline() is None


def test_a_silent_launch_delays_the_first_forwards_by_the_bound_once() -> None:
    rig = launch_rig()
    talker, _silent = launch(rig, 2)
    rig.now = 0.020
    rig.submit(talker, "forward_text", 0)
    rig.step()
    rig.now = 0.099
    rig.step()
    assert rig.fired == []
    rig.now = 0.100  # `_silent` was registered 100 ms ago: no longer waited for
    rig.step()
    assert rig.fired_ids() == [[0]] and not rig.batcher.launched
    rig.executor.num_forward_in_flight = 0
    rig.submit(talker, "forward_text", 1)
    rig.step()
    assert rig.fired_ids() == [[0], [1]], "its next forward is not a first one: it fires at once"


def test_launches_that_keep_coming_hold_a_queue_at_most_the_bound_from_its_oldest_item() -> None:
    rig = launch_rig()
    first, _silent = launch(rig, 2)
    rig.now = 0.020
    rig.submit(first, "forward_text", 0)
    rig.step()
    for at in (0.030, 0.060, 0.090):  # a new launch every 30 ms, none of which sends anything
        rig.now = at
        launch(rig, 1)
        rig.step()
    assert rig.batcher.next_deadline() == pytest.approx(0.100)  # `_silent` stops being waited for
    rig.now = 0.100
    rig.step()
    assert rig.fired == [], "three launches are still pending"
    assert rig.batcher.next_deadline() == pytest.approx(0.120)  # the item's own bound comes first
    rig.now = rig.batcher.next_deadline()
    rig.step()
    assert rig.fired_ids() == [[0]], "100 ms after it arrived, with three launches still pending"


def test_a_decoding_stream_never_waits_for_launches() -> None:
    rig = launch_rig()
    decoding = rig.stream()  # running before the burst: never registered as a launch here
    newcomer, _silent = launch(rig, 2)
    rig.submit(decoding, "forward_text", 0)
    rig.step()
    assert rig.fired_ids() == [[0]], "a queue with a decoding stream's item fires at once"
    rig.now = 0.010
    rig.answer()
    rig.submit(newcomer, "forward_text", 1)
    rig.submit(decoding, "forward_text", 2)
    rig.step()
    assert rig.fired_ids() == [[0], [1, 2]], "a first forward beside a decode step does not wait either"


def test_a_launch_older_than_the_bound_or_ended_is_not_waited_for() -> None:
    rig = launch_rig()
    old, ended = launch(rig, 2)[0], None
    rig.now = 0.150
    talker, ended = launch(rig, 2)
    rig.batcher.drop_stream(ended)  # its instance ended before sending anything
    rig.submit(talker, "forward_text", 0)
    rig.step()
    assert rig.fired_ids() == [[0]]
    assert old.instance not in rig.batcher.launched and not rig.batcher.launched


@pytest.mark.parametrize("strategy", [Adaptive(launch_hold_s=0.0), TOnly(0.0), Eager()], ids=lambda s: s.name)
def test_without_a_launch_hold_no_launch_is_kept_or_waited_for(strategy: object) -> None:
    rig = Rig(strategy)
    streams = [rig.stream() for _ in range(2)]
    for s in streams:
        rig.batcher.instance_launched(s.instance, rig.now)
    assert not rig.batcher.launched
    rig.submit(streams[0], "forward_text", 0)
    rig.step()
    assert rig.fired_ids() == [[0]]


def test_priorities_still_order_a_regrouped_batch() -> None:
    rig = DecodeRig()
    low, high = rig.stream(), rig.stream()
    rig.batcher.set_priority(low, 1)
    rig.batcher.set_priority(high, 3)
    rig.submit(low, "forward_text", 0)
    rig.submit(high, "forward_text", 1)
    rig.step()
    rig.now = 0.020
    rig.answer()
    rig.submit(low, "forward_text", 2)
    rig.submit(high, "forward_text", 3)
    rig.step()
    assert rig.fired_ids() == [[1, 0], [3, 2]]


# ---- the executor's bounds on a batch (BatchBounds, from its GetInfo) ----


def distribution_item(num_outputs: int, top_k: int) -> common_pb2.ForwardTextItem:
    return rq.forward_text([0], 16, [1] * num_outputs, outputs=list(range(num_outputs)),
                           samplers=[common_pb2.SamplerSpec(kind=1, distribution_top_k=top_k)] * num_outputs).forward_text


def submit_items(rig: Rig, kind: str, items: list[object]) -> None:
    for i, item in enumerate(items):
        rig.submit(rig.stream(), kind, i, item=item)
    rig.step()


def test_forward_text_batches_respect_the_distribution_entries_bound() -> None:
    rig = Rig(Eager(), bounds=BatchBounds(max_distribution_entries=2500))
    submit_items(rig, "forward_text", [distribution_item(2, 500) for _ in range(5)])
    assert rig.fired_ids() == [[0, 1], [2, 3], [4]]


def test_sample_top_k_batches_respect_the_distribution_entries_bound() -> None:
    rig = Rig(Eager(), bounds=BatchBounds(max_distribution_entries=1000))
    submit_items(rig, "sample_top_k", [common_pb2.SampleTopKItem(embed_slot_id=0, k=400) for _ in range(5)])
    assert rig.fired_ids() == [[0, 1], [2, 3], [4]]


def test_forward_text_batches_respect_the_reply_bytes_bound() -> None:
    """Greedy outputs carry no entries; their bytes count: 100 outputs are 16 + 100 x 32 bytes at worst."""
    item = rq.forward_text([0], 16, [1] * 100, outputs=list(range(100))).forward_text
    assert limits.reply_bytes("forward_text", item) == 3216
    rig = Rig(Eager(), bounds=BatchBounds(max_reply_bytes=3 * 3216))
    submit_items(rig, "forward_text", [item] * 4)
    assert rig.fired_ids() == [[0, 1, 2], [3]]


def test_batches_respect_the_request_bytes_bound() -> None:
    """Items with an attention mask are large; a batch holds what the executor's receive limit allows."""
    item = rq.forward_text([0, 1], 16, [1] * 16, masks=[[17 + i] for i in range(16)]).forward_text
    cost = Command(Stream(FakeInstance(), 0), 0, "forward_text", item, 0.0, 16, is_executor_kind=True).request_bytes
    assert cost >= item.ByteSize() + 4 * len(item.kv_page_ids)
    rig = Rig(Eager(), bounds=BatchBounds(max_request_bytes=2 * cost + cost // 2))
    submit_items(rig, "forward_text", [item] * 5)
    assert rig.fired_ids() == [[0, 1], [2, 3], [4]]


def test_an_item_over_a_bound_alone_still_fires_alone() -> None:
    """A batch always takes its first item (validation keeps every command within the bounds)."""
    rig = Rig(Eager(), bounds=BatchBounds(max_distribution_entries=10, max_reply_bytes=10, max_request_bytes=10))
    submit_items(rig, "forward_text", [distribution_item(1, 100) for _ in range(3)])
    assert rig.fired_ids() == [[0], [1], [2]]


def test_bounds_are_the_smaller_of_the_executors_and_the_links() -> None:
    margin = limits.MESSAGE_MARGIN_BYTES
    assert BatchBounds.from_info(executor_pb2.ExecutorServiceGetInfoResponse()) == BatchBounds()
    small = executor_pb2.ExecutorServiceGetInfoResponse(max_request_bytes=4 * margin, max_reply_bytes=3 * margin,
                                                        max_distribution_entries_per_batch=7)
    assert BatchBounds.from_info(small) == BatchBounds(3 * margin, 2 * margin, 7)
    big = executor_pb2.ExecutorServiceGetInfoResponse(max_request_bytes=1 << 40, max_reply_bytes=1 << 40)
    assert BatchBounds.from_info(big) == BatchBounds(limits.EXECUTOR_MAX_REQUEST_BYTES - margin,
                                                     limits.EXECUTOR_MAX_REPLY_BYTES - margin)


async def test_the_scheduler_never_sends_a_batch_over_the_executors_entries_bound(harness_factory) -> None:  # type: ignore[no-untyped-def]
    """Six instances each ask for 1,000 entries at once; the executor allows 2,500 per batch (and rejects
    more): every command is served, in batches of two at most, and the executor rejects nothing."""
    h = harness_factory("eager", max_distribution_entries_per_batch=2500)
    opened = [h.open() for _ in range(6)]
    for instance, _ in opened:
        h.send(instance, rq.allocate([0]))
    for instance, _ in opened:
        h.send(instance, rq.request(forward_text=distribution_item(2, 500)))
    await h.settle()
    for instance, sink in opened:
        (reply,) = sink.of("forward_text")
        assert [len(o.distribution.token_ids) for o in reply.forward_text.outputs] == [500, 500]
        assert instance.is_alive
    sizes = [size for kind, size in h.sim().batch_sizes if kind == "forward_text"]
    assert sum(sizes) == 6 and max(sizes) <= 2 and h.sim().num_errors == 0
