"""Per-stream FIFOs, per-kind batch queues and the strategies that fire them.

Vertical batching: a stream's consecutive commands of one kind move together into that kind's batch
queue (one queue per executor and kind). While any of them is still queued the stream does not move
on, so a stream's commands reach its executor in the order it sent them, across kinds. A chunk of a
long forward_text (prefill.py) ends its group: the next chunk moves once this one was fired, so each
chunk joins a batch of its own beside other streams' work.
Horizontal batching: a queue's strategy decides when and how many items (from any instances) fire
as one batch. HIGH streams' items fire before NORMAL, NORMAL before LOW.

Every batch stays within its executor's bounds (`BatchBounds`): the tokens of a forward pass, the
distribution entries its reply carries, and the bytes of the batch and of its reply at their worst case,
so that neither message passes a gRPC limit of the executor link (one would break the stream, and every
instance on it). A batch always takes its first item: validation bounds each command by the same limits.

Forward queues (forward, forward_text: `kinds.py` says which) use the configured strategy; every other
kind fires eagerly.
Commands that never reach an executor (exports, synchronize, ...) run as soon as they are at the head
of their stream: everything the stream sent before them has been sent by then.

This module is a synchronous state machine driven by a clock value; no asyncio, no I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from l4m.wire import limits

# StreamPriority value -> level index; level 0 fires first.
PRIORITY_LEVEL = {3: 0, 2: 1, 0: 1, 1: 2}
NUM_LEVELS = 3


# Id fields the scheduler rewrites (virtual -> physical) after a command was counted, by kind.
_ID_FIELDS = {
    "allocate": ("ids",),
    "deallocate": ("ids",),
    "embed_text": ("embed_slot_ids",),
    "forward": ("kv_page_ids", "input_embed_slot_ids", "output_embed_slot_ids"),
    "forward_text": ("kv_page_ids",),
    "embed_image": ("embed_slot_ids",),
}
_NUM_SCALAR_IDS = 2  # sample_top_k's slot, copy_kv_page's two pages, mask_kv_page's page


def request_bytes(kind: str, item: Any) -> int:
    """Upper bound on the bytes an item adds to its batch: its own size, its framing, and 4 more bytes for
    each id it names (a uint32 varint of 1 byte may become one of 5 when the id is rewritten)."""
    if kind == "forward_text":  # the hot path
        num_ids = _NUM_SCALAR_IDS + len(item.kv_page_ids)
    else:
        num_ids = _NUM_SCALAR_IDS + sum(len(getattr(item, name)) for name in _ID_FIELDS.get(kind, ()))
    return item.ByteSize() + limits.ITEM_BYTES + 4 * num_ids


class Command:
    """One L4M command on its way through the scheduler (the item is the protobuf message), with what it
    costs a batch: tokens, distribution entries, and request and reply bytes at their worst case."""

    __slots__ = ("stream", "request_id", "kind", "item", "arrived_at", "num_tokens", "num_entries",
                 "request_bytes", "reply_bytes", "has_reply", "span", "chunk", "is_first_forward")

    def __init__(self, stream: Stream, request_id: int, kind: str, item: Any, arrived_at: float, num_tokens: int, *,
                 is_executor_kind: bool, reply_cost: tuple[int, int] | None = None) -> None:
        self.stream = stream
        self.request_id = request_id
        self.kind = kind
        self.item = item
        self.arrived_at = arrived_at
        self.num_tokens = num_tokens
        if is_executor_kind:  # `reply_cost`: validation's, when it counted it
            self.num_entries, self.reply_bytes = reply_cost or limits.reply_cost(kind, item)
            self.request_bytes = request_bytes(kind, item)
        else:
            self.num_entries = self.reply_bytes = self.request_bytes = 0
        self.has_reply = False
        self.span: Any = None
        # A chunk of a long forward_text (prefill.py): it moves into its batch queue alone, so that the
        # stream's next chunk joins a later batch, and nothing of the stream overtakes it.
        self.chunk: Any = None
        # The first forward-kind command of an instance that was launched recently (`Batcher.launched`):
        # the adaptive strategy may hold a batch of these for the launches still to come.
        self.is_first_forward = False


class Stream:
    """One FIFO of one instance. `num_queued` counts its items still in a batch queue (it may not
    move on while > 0); `num_replies_sent/done` resolve synchronize."""

    __slots__ = (
        "instance",
        "stream_id",
        "level",
        "pending",
        "num_queued",
        "is_ready",
        "num_replies_sent",
        "num_replies_done",
        "sync_waiters",
    )

    def __init__(self, instance: Any, stream_id: int) -> None:
        self.instance = instance
        self.stream_id = stream_id
        self.level = PRIORITY_LEVEL[2]
        self.pending: deque[Command] = deque()
        self.num_queued = 0
        self.is_ready = False
        self.num_replies_sent = 0
        self.num_replies_done = 0
        self.sync_waiters: deque[tuple[int, Command]] = deque()


class FireTarget(Protocol):
    """What a batch queue fires into (an executor): the adaptive strategy reads its in-flight count; the
    queue's bounds come from its GetInfo (`info`, when it has one)."""

    num_forward_in_flight: int


@dataclass(frozen=True)
class BatchBounds:
    """What one batch may hold besides tokens: the smaller of what the executor advertises in GetInfo
    (0 = not advertised) and the scheduler's own link limits, each less the envelope of the message."""

    max_request_bytes: int = limits.EXECUTOR_MAX_REQUEST_BYTES - limits.MESSAGE_MARGIN_BYTES
    max_reply_bytes: int = limits.EXECUTOR_MAX_REPLY_BYTES - limits.MESSAGE_MARGIN_BYTES
    max_distribution_entries: int = limits.EXECUTOR_MAX_DISTRIBUTION_ENTRIES_PER_BATCH

    @classmethod
    def from_info(cls, info: Any) -> BatchBounds:
        if info is None:
            return cls()
        margin = limits.MESSAGE_MARGIN_BYTES
        return cls(
            max_request_bytes=min(info.max_request_bytes or limits.EXECUTOR_MAX_REQUEST_BYTES,
                                  limits.EXECUTOR_MAX_REQUEST_BYTES) - margin,
            max_reply_bytes=min(info.max_reply_bytes or limits.EXECUTOR_MAX_REPLY_BYTES,
                                limits.EXECUTOR_MAX_REPLY_BYTES) - margin,
            max_distribution_entries=info.max_distribution_entries_per_batch
            or limits.EXECUTOR_MAX_DISTRIBUTION_ENTRIES_PER_BATCH,
        )


class BatchQueue:
    """Queued items of one kind for one executor, one deque per priority level."""

    __slots__ = ("kind", "target", "levels", "num_items", "is_forward", "max_batch_tokens", "bounds", "awaited",
                 "hold_until", "late", "num_first_forwards", "launched")

    def __init__(self, kind: str, target: FireTarget, max_batch_tokens: int, bounds: BatchBounds | None = None, *,
                 is_forward: bool) -> None:
        self.kind = kind
        self.target = target
        self.levels: tuple[deque[Command], ...] = tuple(deque() for _ in range(NUM_LEVELS))
        self.num_items = 0
        self.is_forward = is_forward
        self.max_batch_tokens = max_batch_tokens if self.is_forward else 1 << 62
        self.bounds = bounds or BatchBounds.from_info(getattr(target, "info", None))
        # Adaptive regrouping: streams of the batch that just returned which have not sent their next
        # item yet, and until when the next fire may wait for them; streams that did not answer within
        # their last hold, which are not waited for until one of their items arrives within a hold.
        self.awaited: dict[Stream, None] = {}
        self.hold_until = 0.0
        self.late: dict[Stream, None] = {}
        # Queued items that are their instance's first forward (`Command.is_first_forward`), and the
        # batcher's instances launched but not yet heard from (`Batcher.launched`, shared by its queues).
        self.num_first_forwards = 0
        self.launched: dict[Any, float] = {}

    def push(self, command: Command, level: int) -> None:
        self.levels[level].append(command)
        self.num_items += 1
        if command.is_first_forward:
            self.num_first_forwards += 1
        if self.awaited:
            self.awaited.pop(command.stream, None)
        if self.late and command.arrived_at <= self.hold_until:
            self.late.pop(command.stream, None)  # it answered within the hold: waited for again

    def streams(self) -> set[Stream]:
        return {command.stream for level in self.levels for command in level}

    def oldest_arrival(self) -> float:
        return min(level[0].arrived_at for level in self.levels if level)

    def pop(self, max_items: int) -> list[Command]:
        """Up to `max_items` items, highest priority first, within `max_batch_tokens` and `bounds` (at
        least one). An item that does not fit ends the batch: it fires first in the next one."""
        taken: list[Command] = []
        bounds = self.bounds
        tokens, entries = self.max_batch_tokens, bounds.max_distribution_entries
        request, reply = bounds.max_request_bytes, bounds.max_reply_bytes
        for level in self.levels:
            while level and len(taken) < max_items:
                command = level[0]
                if taken and (command.num_tokens > tokens or command.num_entries > entries
                              or command.request_bytes > request or command.reply_bytes > reply):
                    return self._count_out(taken)
                tokens -= command.num_tokens
                entries -= command.num_entries
                request -= command.request_bytes
                reply -= command.reply_bytes
                taken.append(level.popleft())
        return self._count_out(taken)

    def _count_out(self, taken: list[Command]) -> list[Command]:
        self.num_items -= len(taken)
        if self.num_first_forwards:
            self.num_first_forwards -= sum(command.is_first_forward for command in taken)
        return taken

    def _recount_first_forwards(self) -> None:
        self.num_first_forwards = sum(command.is_first_forward for level in self.levels for command in level)

    def remove_stream(self, stream: Stream) -> list[Command]:
        """Take the stream's queued items out, in order (they go back to its pending: `Batcher.put_back`)."""
        taken: list[Command] = []
        for level in self.levels:
            if any(c.stream is stream for c in level):
                taken.extend(c for c in level if c.stream is stream)
                kept = [c for c in level if c.stream is not stream]
                level.clear()
                level.extend(kept)
        self.num_items -= len(taken)
        self._recount_first_forwards()
        return taken

    def remove_instance(self, instance: Any) -> None:
        for level in self.levels:
            kept = [c for c in level if c.stream.instance is not instance]
            if len(kept) != len(level):
                self.num_items -= len(level) - len(kept)
                level.clear()
                level.extend(kept)
        self._recount_first_forwards()


# ---- strategies: how many items of a queue to fire now (0 = wait) ----


class Eager:
    name = "eager"

    def take(self, queue: BatchQueue, now: float) -> int:
        return queue.num_items

    def deadline(self, queue: BatchQueue) -> float | None:
        return None


class TOnly:
    """Fire everything once the oldest item has waited `t_s`."""

    def __init__(self, t_s: float) -> None:
        self.t_s = t_s
        self.name = f"t-only:{t_s * 1000:g}"

    def take(self, queue: BatchQueue, now: float) -> int:
        return queue.num_items if now - queue.oldest_arrival() >= self.t_s else 0

    def deadline(self, queue: BatchQueue) -> float | None:
        return queue.oldest_arrival() + self.t_s


class KOnly:
    """Fire `k` items at a time, once `k` are queued (fewer never fire: a pure count rule)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.name = f"k-only:{k}"

    def take(self, queue: BatchQueue, now: float) -> int:
        return self.k if queue.num_items >= self.k else 0

    def deadline(self, queue: BatchQueue) -> float | None:
        return None


class KOrT:
    """Fire `k` items once `k` are queued, or everything once the oldest has waited `t_s`."""

    def __init__(self, k: int, t_s: float) -> None:
        self.k = k
        self.t_s = t_s
        self.name = f"k-or-t:{k}:{t_s * 1000:g}"

    def take(self, queue: BatchQueue, now: float) -> int:
        if queue.num_items >= self.k:
            return self.k
        return queue.num_items if now - queue.oldest_arrival() >= self.t_s else 0

    def deadline(self, queue: BatchQueue) -> float | None:
        return queue.oldest_arrival() + self.t_s


# The adaptive hold's bound. The returned batch's time bounds it too (DEFAULT_HOLD_FRACTION), so this one
# matters for long batches: one that carries continuation (nine decode steps) returns 64 streams' worth of
# tokens at once, and 64 controllers on two cores need ~100 ms to answer; a shorter bound splits them into
# alternating groups again.
DEFAULT_MAX_HOLD_S = 0.250
# The launch hold's bound: how long an idle executor's first forwards wait for the instances launched
# beside them, from the oldest one's arrival (and how long after its registration an instance is waited for).
DEFAULT_LAUNCH_HOLD_S = 0.150
# The hold as a fraction of the returned batch's execution time. Waiting w for the stragglers and running
# one batch of n beats two alternating batches of n/2 while w + t(n) < 2 t(n/2). Where a step's time barely
# grows with the batch (a GPU's decode step), that is w < t(n): one batch's time. Where it grows with the
# batch (a CPU), waiting pays less, but lock-step streams answer within a few ms of steps of tens of ms,
# well inside the bound (docs/benchmarks.md, "Round 16").
DEFAULT_HOLD_FRACTION = 1.0


class Adaptive:
    """One forward batch in flight per executor; when it returns, what is queued fires, after waiting
    (briefly, bounded) for the streams of the returned batch to send their next item.

    Without the wait, lock-step streams (decode loops) split into groups that alternate: while group
    A's batch runs, group B's items queue; when A returns B fires at once, before A's streams have
    had time to answer, so A queues behind B, and so on for ever, each step costing N / 2-item
    batches instead of one N-item batch. So when a batch returns (`forward_returned`), its streams
    that have nothing queued become awaited: the queue fires once none is awaited (each arrival
    removes itself) or at `hold_until` = return + min(`max_hold_s`, `hold_fraction` x the batch's
    execution time), whichever comes first. A lone stream that answers at once is never held; a stream
    that ended is no longer awaited; one that went silent delays the others by the bound at most, once:
    a stream the hold ran out on is late, not awaited again until one of its items arrives within a
    hold (so a controller that is always slow to answer does not hold the others back at every step).
    `max_hold_s` = 0 turns the wait off.

    The same for a burst of launches (`launch_hold_s`): when an idle executor's queue holds nothing but
    first forwards (each the first of an instance launched within `launch_hold_s`) and instances launched
    within `launch_hold_s` have not sent theirs yet, the queue waits for them, at most `launch_hold_s`
    from its oldest item's arrival. Without it the first prompt of a burst runs alone and the others
    queue behind it: on a CPU, on the one core the launches leave it. A queue holding any other item (a
    stream that is decoding) never waits for launches. `launch_hold_s` = 0 turns this wait off.
    """

    def __init__(self, max_hold_s: float = DEFAULT_MAX_HOLD_S, hold_fraction: float = DEFAULT_HOLD_FRACTION,
                 launch_hold_s: float = DEFAULT_LAUNCH_HOLD_S) -> None:
        self.max_hold_s = max_hold_s
        self.hold_fraction = hold_fraction
        self.launch_hold_s = launch_hold_s
        if hold_fraction != DEFAULT_HOLD_FRACTION:
            self.name = f"adaptive:{max_hold_s * 1000:g}:{launch_hold_s * 1000:g}:{hold_fraction:g}"
        elif launch_hold_s != DEFAULT_LAUNCH_HOLD_S:
            self.name = f"adaptive:{max_hold_s * 1000:g}:{launch_hold_s * 1000:g}"
        elif max_hold_s != DEFAULT_MAX_HOLD_S:
            self.name = f"adaptive:{max_hold_s * 1000:g}"
        else:
            self.name = "adaptive"

    def take(self, queue: BatchQueue, now: float) -> int:
        if queue.target.num_forward_in_flight:
            return 0
        if queue.awaited:
            if now < queue.hold_until:
                return 0
            queue.late.update(queue.awaited)  # the hold ran out on them: not waited for next time
            queue.awaited.clear()
        if _holds_first_forwards_only(queue):
            expire_launches(queue.launched, now, self.launch_hold_s)
            if queue.launched and now < queue.oldest_arrival() + self.launch_hold_s:
                return 0
        return queue.num_items

    def deadline(self, queue: BatchQueue) -> float | None:
        if queue.target.num_forward_in_flight:
            return None
        if queue.awaited:
            return queue.hold_until
        if _holds_first_forwards_only(queue):
            # Look again when the oldest launch stops being waited for, or the bound ends the wait.
            return min(next(iter(queue.launched.values())), queue.oldest_arrival()) + self.launch_hold_s
        return None

    def returned(self, queue: BatchQueue, streams: list[Stream], now: float, duration_s: float) -> None:
        hold = min(self.max_hold_s, self.hold_fraction * max(duration_s, 0.0))
        if hold <= 0:
            queue.awaited.clear()
            return
        queued = queue.streams() if queue.num_items else set()
        late = queue.late
        queue.awaited = {s: None for s in streams if s not in queued and s not in late and s.instance.is_alive}
        queue.hold_until = now + hold


def _holds_first_forwards_only(queue: BatchQueue) -> bool:
    """Launches are pending and every queued item is its instance's first forward: the launch hold applies."""
    return bool(queue.launched) and queue.num_first_forwards == queue.num_items


def expire_launches(launched: dict[Any, float], now: float, hold_s: float) -> None:
    """Forget the launches (instance -> registration time, oldest first) older than `hold_s`."""
    while launched:
        instance, at = next(iter(launched.items()))
        if at + hold_s > now:
            return
        del launched[instance]


Strategy = Eager | TOnly | KOnly | KOrT | Adaptive
EAGER = Eager()


def parse_strategy(spec: str) -> Strategy:
    """"adaptive" | "adaptive:<max_hold_ms>[:<launch_hold_ms>[:<hold_fraction>]]" | "t-only:<t_ms>" | "k-only:<k>" |
    "k-or-t:<k>:<t_ms>"; ValueError when malformed."""
    name, *args = spec.split(":")
    try:
        if name == "adaptive" and len(args) <= 3:
            given = [float(arg) for arg in args]
            if all(value >= 0 for value in given):
                scaled = dict(zip(("max_hold_s", "launch_hold_s", "hold_fraction"), given, strict=False))
                for key in ("max_hold_s", "launch_hold_s"):  # given in ms
                    if key in scaled:
                        scaled[key] /= 1000
                return Adaptive(**scaled)
        if name == "eager" and not args:
            return Eager()
        if name == "t-only" and len(args) == 1:
            t_ms = float(args[0])
            if t_ms >= 0:
                return TOnly(t_ms / 1000)
        if name == "k-only" and len(args) == 1 and int(args[0]) > 0:
            return KOnly(int(args[0]))
        if name == "k-or-t" and len(args) == 2 and int(args[0]) > 0 and float(args[1]) >= 0:
            return KOrT(int(args[0]), float(args[1]) / 1000)
    except ValueError:
        pass
    raise ValueError(
        f"bad batching strategy {spec!r}; use adaptive, adaptive:<max_hold_ms>, adaptive:<max_hold_ms>:"
        "<launch_hold_ms>, adaptive:<max_hold_ms>:<launch_hold_ms>:<hold_fraction>, t-only:<t_ms>, k-only:<k> or "
        "k-or-t:<k>:<t_ms>"
    )


# Route a command at the head of its stream: its executor's batch queue, or None when it was
# consumed on the spot (a scheduler-local command ran, or the instance was trapped).
Router = Callable[[Command], "BatchQueue | None"]
Fire = Callable[[BatchQueue, list[Command]], None]


class Batcher:
    """Moves commands from stream FIFOs into batch queues and fires the queues by strategy."""

    def __init__(self, forward_strategy: Strategy) -> None:
        self.forward_strategy: Strategy = forward_strategy
        self.queues: list[BatchQueue] = []
        self._ready: tuple[dict[Stream, None], ...] = tuple({} for _ in range(NUM_LEVELS))
        # Instances launched recently that have not sent a forward yet -> when they were registered, oldest
        # first: what the adaptive strategy's launch hold waits for (kept only while it has one).
        self.launched: dict[Any, float] = {}

    @property
    def num_queued(self) -> int:
        return sum(q.num_items for q in self.queues)

    def add_queues(self, queues: list[BatchQueue]) -> None:
        for queue in queues:
            queue.launched = self.launched
        self.queues.extend(queues)

    def instance_launched(self, instance: Any, now: float) -> None:
        """An instance was registered: its first forward may be waited for (`Adaptive.launch_hold_s`)."""
        hold_s = getattr(self.forward_strategy, "launch_hold_s", 0.0)
        if hold_s > 0:
            expire_launches(self.launched, now, hold_s)
            self.launched[instance] = now

    def remove_queues(self, queues: list[BatchQueue]) -> None:
        self.queues = [q for q in self.queues if q not in queues]

    def submit(self, command: Command) -> None:
        stream = command.stream
        stream.pending.append(command)
        if stream.num_queued == 0 and not stream.is_ready:
            self._mark_ready(stream)

    def put_back(self, stream: Stream, commands: list[Command]) -> None:
        """Commands of `stream` held back (a preempted instance resumes) go first again, in their order,
        with the stream's items still in batch queues after them, then what it has pending."""
        for queue in self.queues:
            if stream.num_queued and queue.num_items:
                queued = queue.remove_stream(stream)
                stream.num_queued -= len(queued)
                commands = commands + queued
        stream.pending.extendleft(reversed(commands))
        if stream.num_queued == 0 and not stream.is_ready:
            self._mark_ready(stream)

    def has_ready(self) -> bool:
        return any(self._ready)

    def _mark_ready(self, stream: Stream) -> None:
        stream.is_ready = True
        self._ready[stream.level][stream] = None

    def drop_stream(self, stream: Stream) -> None:
        """Forget a stream's pending commands (its instance ended); queued items are removed by
        `remove_instance` on the queues. No queue waits for it any more."""
        stream.pending.clear()
        self.launched.pop(stream.instance, None)
        for queue in self.queues:
            if queue.awaited:
                queue.awaited.pop(stream, None)
            queue.late.pop(stream, None)
        if stream.is_ready:
            self._ready[stream.level].pop(stream, None)
            stream.is_ready = False

    def set_priority(self, stream: Stream, priority: int) -> None:
        level = PRIORITY_LEVEL[priority]
        if stream.is_ready:
            self._ready[stream.level].pop(stream, None)
            self._ready[level][stream] = None
        stream.level = level

    def pump(self, route: Router) -> None:
        """Move each ready stream's head group into its batch queue, HIGH streams first."""
        for ready in self._ready:
            while ready:
                stream = next(iter(ready))
                del ready[stream]
                stream.is_ready = False
                self._advance(stream, route)

    def _advance(self, stream: Stream, route: Router) -> None:
        pending = stream.pending
        while pending:
            command = pending[0]
            queue = route(command)
            if queue is None:
                if pending and pending[0] is command:
                    pending.popleft()
                continue
            kind, level, num_moved = command.kind, stream.level, 0
            if self.launched and queue.is_forward and self.launched.pop(stream.instance, None) is not None:
                command.is_first_forward = True
            while pending and pending[0].kind == kind:
                moved = pending.popleft()
                queue.push(moved, level)
                num_moved += 1
                if moved.chunk is not None:  # its next chunk waits until this one was fired
                    break
            stream.num_queued = num_moved
            return

    def fire_due(self, now: float, fire: Fire) -> int:
        """Fire every queue whose strategy says so; returns the number of batches fired."""
        num_fired = 0
        for queue in self.queues:
            if not queue.num_items:
                continue
            strategy = self.forward_strategy if queue.is_forward else EAGER
            while queue.num_items:
                max_items = strategy.take(queue, now)
                if max_items == 0:
                    break
                commands = queue.pop(max_items)
                for command in commands:
                    stream = command.stream
                    stream.num_queued -= 1
                    if stream.num_queued == 0 and stream.pending and not stream.is_ready:
                        self._mark_ready(stream)
                fire(queue, commands)
                num_fired += 1
        return num_fired

    def forward_returned(self, queue: BatchQueue, streams: list[Stream], now: float, duration_s: float) -> None:
        """A forward batch fired from `queue` was answered after `duration_s`; `streams` sent its items."""
        returned = getattr(self.forward_strategy, "returned", None)
        if returned is not None:
            returned(queue, streams, now, duration_s)

    def next_deadline(self) -> float | None:
        deadlines = [
            d
            for q in self.queues
            if q.num_items and q.is_forward and (d := self.forward_strategy.deadline(q)) is not None
        ]
        return min(deadlines) if deadlines else None
