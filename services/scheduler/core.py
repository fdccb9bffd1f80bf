"""The scheduler core: instances, their commands, batching and executors, tied together.

A command's life: `submit` checks its shape (validation.check_command) and queues it on its stream;
the batcher moves it into its executor's batch queue when it reaches the head of the stream; when the
queue fires, `_fire` translates virtual ids to physical ones *in send order* (so the tables always
describe exactly what the executor has been told), sends one `ExecuteRequest`, and the reply, if the
batch has one, is dispatched back to the commands by position. Scheduler-local commands (exports,
synchronize, get_info, ...) run when they reach the head of their stream, after everything the
stream sent before them was sent.

Freeing: a deallocate returns physical ids to the pool when it is sent; any later allocate that
reuses them is sent after it, and the executor runs batches in order. A trapped or closed instance
loses its queued commands (never sent) and everything it held; the executor is told to deallocate
the ids nobody holds any more.

Blame: two forward items of one instance writing one kv slot are split into ordered batches (one
stream) or trap that instance (two streams) before sending (`_plan_waves`). A batch the executor
rejects anyway traps the item it names and is sent again without it (`_on_batch_error`); fire-and-forget
batches are kept (`Executor.unanswered`) until a later reply shows they ran, so their rejections are
blamed the same way.

Synchronize resolves when it reaches the head of its stream (all earlier commands are sent) and every
earlier command of the stream that has a reply was answered; the executor runs in order, so
fire-and-forget commands sent before those replies are done too.

Everything here runs on one asyncio loop thread; nothing blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from l4m.scheduler import contention
from l4m.scheduler.batcher import Batcher, BatchQueue, Command, Stream, parse_strategy
from l4m.scheduler.config import SchedulerConfig
from l4m.scheduler.errors import (
    Destroyed,
    Evicted,
    ExecutorLost,
    InvalidCommand,
    NoExecutor,
    PermissionDenied,
    ResourceExhausted,
    TokenBudgetExceeded,
    TooManyInstances,
    TrapError,
    UnknownParent,
    Unsupported,
)
from l4m.scheduler.executors import Executor, ExecutorLink, InflightBatch
from l4m.scheduler.exports import Export, ExportTable
from l4m.scheduler.instances import EventSink, Instance, InstanceRegistry, InstanceState
from l4m.scheduler.metrics import SchedulerMetrics
from l4m.scheduler.quotas import UserQuotas
from l4m.scheduler.tracing import SchedulerTracer, num_kv_pages_named
from l4m.scheduler.validation import (
    EMBED_SLOT,
    KV_PAGE,
    MAX_CONTINUATION_STEPS,
    ModelLimits,
    check_command,
    check_forward_text,
    resource_name,
    translate_ids,
    translate_one,
)
from l4m.v1 import common_pb2, executor_pb2, l4m_pb2
from l4m.wire import limits as bounds

log = logging.getLogger(__name__)

PROTOCOL_VERSION = "l4m.v1"
# Batches the executor always answers. forward_text is answered even without outputs, so that every
# forward pass counts as in flight (the adaptive strategy fires the next one when none is); only its
# items with output indices get a reply of their own (`Command.has_reply`).
_REPLIED_KINDS = frozenset({"forward", "forward_text", "sample_top_k"})

Watcher = Callable[[str, l4m_pb2.Trap], None]


class Scheduler:
    """The L4M service core (no gRPC): see the module docstring."""

    def __init__(
        self,
        config: SchedulerConfig,
        links: list[ExecutorLink],
        *,
        clock: Callable[[], float] = time.monotonic,
        tracer: SchedulerTracer | None = None,
        metrics: SchedulerMetrics | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.instances = InstanceRegistry()
        self.exports = ExportTable()
        self.quotas = UserQuotas(clock)
        self.executors = [Executor(index, link) for index, link in enumerate(links)]
        self.batcher = Batcher(parse_strategy(config.batching))
        self.tracer = tracer or SchedulerTracer()
        self.metrics = metrics or SchedulerMetrics()
        self.metrics.bind_gauges(
            lambda: self.batcher.num_queued,
            lambda: sum(e.resources.kv_pages.num_used for e in self.executors if e.resources),
            self.instances.num_active,
            lambda: sum(e.resources.embed_slots.num_used for e in self.executors if e.resources),
        )
        self.limits: ModelLimits | None = None
        self.model: common_pb2.ModelInfo | None = None
        self._model_without_tokenizer: common_pb2.ModelInfo | None = None  # for GetInfo(omit_tokenizer_json)
        self.watchers: list[Watcher] = []
        self.stats: dict[str, Any] = {"commands": 0, "batches": {}, "items": {}, "max_instances_per_batch": {},
                                      "multi_instance_batches": {}, "traps": {}, "batch_errors": 0,
                                      "batches_resent": 0}
        self._anonymous_seq = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._step_scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_deadline: float | None = None
        self._num_traps = 0
        # Dispatch order: each batch sent and each local command that changes what pages mean (export,
        # import, unexport) takes the next number; an instance's entry is its latest. A rejected batch's
        # items may be sent again only for instances whose latest dispatch is that batch.
        self._dispatch_seq = 0
        self._last_dispatch: dict[Instance, int] = {}

    # ---- lifecycle ----

    def start(self) -> None:
        """Bind to the running loop and start connecting to every executor."""
        self._loop = asyncio.get_running_loop()
        for executor in self.executors:
            executor.link.start(
                lambda info, e=executor: self._on_executor_connected(e, info),
                lambda response, e=executor: self._on_batch_reply(e, response),
                lambda reason, e=executor: self._on_executor_lost(e, reason),
            )

    async def close(self) -> None:
        for instance in self.instances:
            if instance.is_alive:
                self.trap(instance, ExecutorLost("the scheduler is shutting down"))
        for executor in self.executors:
            await executor.link.close()

    @property
    def is_ready(self) -> bool:
        return self.limits is not None

    # ---- instances ----

    def register_instance(
        self, instance_id: str, token: str, max_tokens: int, launched_at_unix_ms: int, *, user: str = "",
        is_admin: bool = False, parent_instance_id: str = "", user_max_tokens_per_minute: int = 0,
    ) -> Instance:
        """Raises a RegistrationError (too many instances, unknown parent, id or token taken)."""
        if len(self.instances) >= self.config.max_instances:
            raise TooManyInstances(f"the scheduler holds its maximum of {self.config.max_instances} instances")
        parent = self.instances.get(parent_instance_id) if parent_instance_id else None
        if parent_instance_id and parent is None:
            raise UnknownParent(f"parent instance {parent_instance_id!r} is not registered")
        instance = self.instances.register(instance_id, token, max_tokens, launched_at_unix_ms,
                                           user=user, is_admin=is_admin, parent=parent)
        self.quotas.add_instance(instance.user, user_max_tokens_per_minute)
        return instance

    def register_anonymous(self) -> Instance:
        """A dev-mode session without a token: a user of its own, never admin."""
        self._anonymous_seq += 1
        name = f"anonymous-{self._anonymous_seq}"
        instance = self.register_instance(name, f"{name}-token", 0, int(time.time() * 1000))
        instance.is_anonymous = True
        return instance

    def _forget(self, instance_id: str) -> Instance | None:
        """Remove an instance from every table (registry, quotas); its resources are freed by the caller."""
        instance = self.instances.remove(instance_id)
        if instance is not None:
            self.quotas.remove_instance(instance.user)
        return instance

    def open_session(self, instance: Instance, sink: EventSink, traceparent: str | None = None) -> None:
        """The instance's session starts; raises ValueError when it cannot (already open or ended)."""
        if instance.state is not InstanceState.REGISTERED:
            raise ValueError(f"instance {instance.instance_id!r} is {instance.state.value}; one session per instance")
        instance.state = InstanceState.ACTIVE
        instance.sink = sink
        instance.trace_context = self.tracer.extract(traceparent) if self.tracer.enabled else None

    def close_session(self, instance: Instance) -> None:
        """The controller closed its stream: free everything, no trap."""
        if instance.is_alive:
            self._end_instance(instance)
            if instance.sink is not None:
                instance.sink.end(None)
        if instance.is_anonymous:
            self._forget(instance.instance_id)

    def finish_session(self, instance: Instance) -> None:
        """The controller half-closed its stream: run what it sent (traps included), then close."""
        if not instance.is_alive:
            return
        streams = list(instance.streams.values())
        if not streams:
            self.close_session(instance)
            return
        instance.num_streams_closing = len(streams)
        now = self.clock()
        for stream in streams:  # a synchronize per stream, with no request id: answered by closing
            self.batcher.submit(Command(stream, None, "synchronize", None, now, 0))  # type: ignore[arg-type]
        self._schedule_step()

    def destroy_instance(self, instance_id: str, reason: str) -> tuple[int, int]:
        """The spawner forgets an instance; returns (kv pages, embed slots) freed. Idempotent."""
        instance = self._forget(instance_id)
        if instance is None or instance.state is InstanceState.ENDED:
            return 0, 0
        if instance.state is InstanceState.REGISTERED:
            instance.state = InstanceState.ENDED
            return 0, 0
        return self.trap(instance, Destroyed(reason or "destroyed by the spawner"))

    # ---- commands ----

    def submit(self, instance: Instance, request: l4m_pb2.SessionRequest) -> None:
        """Accept one command of an instance's session (the hot path)."""
        if not instance.is_alive:
            return
        kind = request.WhichOneof("command")
        item = getattr(request, kind) if kind is not None else None
        self.stats["commands"] += 1
        self.metrics.count_command(kind or "none")
        try:
            if kind == "forward_text":
                check_forward_text(item, self.limits)  # type: ignore[arg-type]
                # What it may feed: its tokens and every continuation step (the budget is spent up front).
                num_tokens = len(item.token_ids) + item.num_continuation_steps  # type: ignore[union-attr]
            else:
                check_command(kind, item, self.limits)  # type: ignore[arg-type]
                num_tokens = len(item.input_embed_slot_ids) if kind == "forward" else 0  # type: ignore[union-attr]
        except TrapError as error:
            self.trap(instance, error, request.request_id, kind)
            return
        stream = instance.streams.get(request.stream_id) or instance.stream(request.stream_id)
        command = Command(stream, request.request_id, kind, item, self.clock(), num_tokens)  # type: ignore[arg-type]
        if self.tracer.enabled:
            command.span = self.tracer.command_span(
                kind,  # type: ignore[arg-type]
                instance.trace_context,
                {"l4m.instance_id": instance.instance_id, "l4m.command": kind, "l4m.request_id": request.request_id,
                 "l4m.stream_id": request.stream_id, "l4m.tokens": num_tokens,
                 "l4m.kv_pages": num_kv_pages_named(kind, item),
                 "l4m.instance.kv_pages_held": len(instance.table.kv_pages)},
            )
        self.batcher.submit(command)
        self._schedule_step()

    def _schedule_step(self) -> None:
        if not self._step_scheduled and self._loop is not None:
            self._step_scheduled = True
            self._loop.call_soon(self.step)

    def step(self) -> None:
        """Move ready streams into queues and fire due batches, until nothing more can move."""
        self._step_scheduled = False
        batcher = self.batcher
        now = self.clock()
        while True:
            batcher.pump(self._route)
            batcher.fire_due(now, self._fire)
            if not batcher.has_ready():
                break
        self._arm_timer(batcher.next_deadline())

    def _arm_timer(self, deadline: float | None) -> None:
        if deadline == self._timer_deadline or self._loop is None:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_deadline = deadline
        if deadline is not None:
            self._timer = self._loop.call_later(max(0.0, deadline - self.clock()), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_deadline = None
        self.step()

    def _route(self, command: Command) -> BatchQueue | None:
        """Where the command at the head of its stream goes; local commands run here."""
        instance = command.stream.instance
        kind = command.kind
        local = _LOCAL_HANDLERS.get(kind)
        try:
            if local is not None:
                local(self, command)
                if kind in _SHARING_KINDS:
                    self._dispatch_seq += 1
                    self._last_dispatch[instance] = self._dispatch_seq
                return None
            executor = instance.executor
            if executor is None:
                if kind != "allocate":
                    self._translate(None, command)  # owns nothing yet: raises, naming the first id
                executor = self._bind(instance)
            return executor.queues[kind]
        except TrapError as error:
            self.trap(instance, error, command.request_id, kind)
            return None

    def _bind(self, instance: Instance) -> Executor:
        """Bind an instance to the connected executor with the most free pages (fewest instances on ties)."""
        candidates = [e for e in self.executors if e.is_connected]
        if not candidates:
            raise NoExecutor("no executor is connected")
        executor = max(candidates, key=lambda e: (e.resources.kv_pages.num_free, -len(e.instances)))  # type: ignore[union-attr]
        instance.executor = executor
        executor.instances.add(instance)
        return executor

    def _fire(self, queue: BatchQueue, commands: list[Command]) -> None:
        """Translate and send one batch."""
        executor: Executor = queue.target  # type: ignore[assignment]
        kind = queue.kind
        traps_before = self._num_traps
        items, sent = [], []
        for command in commands:
            instance = command.stream.instance
            if not instance.is_alive:
                continue
            try:
                item = self._translate(executor, command)
            except TrapError as error:
                self.trap(instance, error, command.request_id, kind)
                continue
            if item is not None:
                items.append(item)
                sent.append(command)
            elif command.span is not None:
                command.span.end()
        executor.unsent_kv_pages.clear()
        executor.unsent_embed_slots.clear()
        waves = self._plan_waves(sent) if queue_is_forward(kind) and len(sent) > 1 else None
        if self._num_traps != traps_before:  # an eviction may have hit an instance already in this batch
            # A translated deallocate already returned its ids to the pool, so it must reach the executor
            # even when its instance trapped later in this batch (or the ids would be handed out again
            # while the executor still holds them).
            kept = [i for i, c in enumerate(sent) if c.stream.instance.is_alive or kind == "deallocate"]
            items, sent = [items[i] for i in kept], [sent[i] for i in kept]
            waves = [waves[i] for i in kept] if waves is not None else None
        if not sent:
            return
        if waves is None:
            self._send_batch(executor, kind, items, sent)
            return
        for wave in range(max(waves) + 1):  # in order: a later wave reads what an earlier one wrote
            chosen = [i for i, w in enumerate(waves) if w == wave]
            self._send_batch(executor, kind, [items[i] for i in chosen], [sent[i] for i in chosen])

    def _plan_waves(self, commands: list[Command]) -> list[int] | None:
        """Split a forward batch where items of one instance write the same kv page slot, which the
        executor refuses in one pass. On one stream the commands are ordered, so a later one that writes
        a slot an earlier one writes goes into a later batch (a wave), sent right after; on two streams
        nothing orders them, so the instance is trapped here, naming both requests, and the rest of the
        batch runs. Returns each command's wave, None when all fit in one batch. Items of different
        instances never collide (they share only frozen, read-only pages); only instances with several
        items pay for the check."""
        by_instance: dict[Instance, list[int]] = {}
        for index, command in enumerate(commands):
            by_instance.setdefault(command.stream.instance, []).append(index)
        if len(by_instance) == len(commands):
            return None
        page_size = self.limits.kv_page_size  # type: ignore[union-attr]
        waves = [0] * len(commands)
        for instance, own in by_instance.items():
            if len(own) < 2:
                continue
            written: dict[int, list[tuple[int, int, int]]] = {}  # physical page -> [(start, end, command index)]
            stream_wave: dict[Stream, int] = {}
            for index in own:
                command = commands[index]
                ranges = _written_ranges(command, page_size)
                wave = stream_wave.get(command.stream, 0)
                for page, start, end in ranges:
                    for first, last, other in written.get(page, ()):
                        if not (first < end and start < last):
                            continue
                        if commands[other].stream is not command.stream:
                            self._trap_collision(instance, command, commands[other], page, max(start, first))
                            break
                        wave = max(wave, waves[other] + 1)
                    if not instance.is_alive:
                        break
                if not instance.is_alive:
                    break
                waves[index] = stream_wave[command.stream] = wave
                for page, start, end in ranges:
                    written.setdefault(page, []).append((start, end, index))
        return waves if any(waves) else None

    def _trap_collision(self, instance: Instance, command: Command, other: Command, page: int, slot: int) -> None:
        virtual = next((v for v, p in instance.table.kv_pages.items() if p == page), page)
        self.trap(instance, InvalidCommand(
            f"writes kv page {virtual} slot {slot}, which request {other.request_id} (stream "
            f"{other.stream.stream_id}) also writes in the same forward batch (stream {command.stream.stream_id}); "
            f"order the two with one stream or synchronize"), command.request_id, command.kind)

    def _send_batch(self, executor: Executor, kind: str, items: list[Any], commands: list[Command], *,
                    is_resend: bool = False) -> None:
        """Send one batch. `is_resend`: its commands were sent before in a batch the executor rejected for
        another item, so their replies are already counted on their streams."""
        correlation_id = executor.next_correlation_id()
        request = executor_pb2.ExecuteRequest(correlation_id=correlation_id)
        getattr(request, kind).items.extend(items)
        batch_span = None
        if self.tracer.enabled:
            batch_span, traceparent, tracestate = self.tracer.batch_span(kind, executor.index, [c.span for c in commands])
            request.trace_context.traceparent = traceparent
            request.trace_context.tracestate = tracestate
        self._count_batch(kind, commands)
        self._dispatch_seq += 1
        seq = self._dispatch_seq
        for command in commands:
            self._last_dispatch[command.stream.instance] = seq
        if kind in _REPLIED_KINDS:
            if kind != "forward_text":
                for command in commands:
                    command.has_reply = True
            if not is_resend:
                for command in commands:
                    if command.has_reply:
                        command.stream.num_replies_sent += 1
            executor.inflight[correlation_id] = InflightBatch(kind, commands, batch_span, self.clock(), seq, items)
            if queue_is_forward(kind):
                executor.num_forward_in_flight += 1
        else:
            executor.unanswered[correlation_id] = InflightBatch(kind, list(commands), None, self.clock(), seq, items)
            if len(executor.unanswered) % _MAX_UNANSWERED == 0:
                self._send_barrier(executor)
            if batch_span is not None:
                batch_span.end()
        if self.tracer.enabled:
            for command in commands:
                if not command.has_reply and command.span is not None:
                    command.span.end()
        executor.link.send(request)

    def _send_barrier(self, executor: Executor) -> None:
        """A ping with a reply, so that the fire-and-forget batches sent before it are known to have run
        (`Executor.unanswered` stays bounded when no forward pass is sent for a long while)."""
        correlation_id = executor.next_correlation_id()
        request = executor_pb2.ExecuteRequest(correlation_id=correlation_id)
        request.debug_query.queries.append("ping")
        executor.inflight[correlation_id] = InflightBatch("debug_query", [], None, self.clock())
        executor.link.send(request)

    def _count_batch(self, kind: str, commands: list[Command]) -> None:
        stats = self.stats
        stats["batches"][kind] = stats["batches"].get(kind, 0) + 1
        stats["items"][kind] = stats["items"].get(kind, 0) + len(commands)
        num_instances = len({id(c.stream.instance) for c in commands}) if len(commands) > 1 else 1
        if num_instances > stats["max_instances_per_batch"].get(kind, 0):
            stats["max_instances_per_batch"][kind] = num_instances
        if num_instances > 1:
            stats["multi_instance_batches"][kind] = stats["multi_instance_batches"].get(kind, 0) + 1
        self.metrics.observe_batch(kind, len(commands))

    # ---- translation (virtual -> physical), in send order ----

    def _translate(self, executor: Executor | None, command: Command) -> Any:
        """Rewrite the command's item to physical ids in place; None when nothing must be sent."""
        instance = command.stream.instance
        item = command.item
        table = instance.table
        kind = command.kind
        if kind == "forward_text":
            physical = translate_ids(table.kv_pages, item.kv_page_ids, "kv page")
            self._check_writable(executor, item.kv_page_ids, physical, item.kv_last_page_length,
                                 len(item.token_ids) + item.num_continuation_steps)
            self._spend_tokens(instance, command.num_tokens)
            item.kv_page_ids[:] = physical
            command.has_reply = len(item.output_indices) > 0
            return item
        if kind == "forward":
            pages = translate_ids(table.kv_pages, item.kv_page_ids, "kv page")
            inputs = translate_ids(table.embed_slots, item.input_embed_slot_ids, "embed slot")
            outputs = translate_ids(table.embed_slots, item.output_embed_slot_ids, "embed slot")
            self._check_writable(executor, item.kv_page_ids, pages, item.kv_last_page_length, len(inputs))
            self._spend_tokens(instance, command.num_tokens)
            item.kv_page_ids[:] = pages
            item.input_embed_slot_ids[:] = inputs
            item.output_embed_slot_ids[:] = outputs
            return item
        if kind == "allocate":
            return self._allocate(executor, instance, item)  # type: ignore[arg-type]
        if kind == "deallocate":
            return self._deallocate(executor, instance, item)  # type: ignore[arg-type]
        if kind == "embed_text":
            item.embed_slot_ids[:] = translate_ids(table.embed_slots, item.embed_slot_ids, "embed slot")
            return item
        if kind == "sample_top_k":
            item.embed_slot_id = translate_one(table.embed_slots, item.embed_slot_id, "embed slot")
            return item
        if kind == "copy_kv_page":
            source = translate_one(table.kv_pages, item.source_kv_page_id, "kv page")
            destination = translate_one(table.kv_pages, item.destination_kv_page_id, "kv page")
            self._check_writable(executor, [item.destination_kv_page_id], [destination])
            item.destination_kv_page_id = destination
            item.source_kv_page_id = source
            return item
        if kind == "mask_kv_page":
            physical_id = translate_one(table.kv_pages, item.kv_page_id, "kv page")
            self._check_writable(executor, [item.kv_page_id], [physical_id])
            item.kv_page_id = physical_id
            return item
        if kind == "embed_image":
            item.embed_slot_ids[:] = translate_ids(table.embed_slots, item.embed_slot_ids, "embed slot")
            return item
        raise InvalidCommand(f"command kind {kind} cannot be sent to an executor")

    def _check_writable(self, executor: Executor | None, virtual_ids: Any, physical_ids: list[int],
                        last_page_length: int = 0, num_written: int = 0) -> None:
        """Traps when a command would write into a frozen (exported or imported) page. With
        `num_written`, only the pages holding the last `num_written` token slots are written (the
        LENGTH RULE puts the new tokens at the end); without it every listed page is."""
        pool = executor.resources.kv_pages  # type: ignore[union-attr]
        if not pool.has_frozen:  # the common case: nothing is exported on this executor
            return
        first = 0
        if num_written:
            page_size = self.limits.kv_page_size  # type: ignore[union-attr]
            num_slots = page_size * (len(physical_ids) - 1) + last_page_length
            first = (num_slots - num_written) // page_size
        for index in range(first, len(physical_ids)):
            if pool.is_frozen(physical_ids[index]):
                raise InvalidCommand(f"kv page {virtual_ids[index]} is shared by an export (read-only): "
                                     f"copy_kv_page it into a page you own first")

    def _spend_tokens(self, instance: Instance, num_tokens: int) -> None:
        """Charge the instance, each ancestor and the user; all or nothing. The trap names whose
        budget ran out."""
        payers = (instance, *instance.ancestors()) if instance.parent is not None else (instance,)
        for payer in payers:
            used = payer.num_tokens_used + num_tokens
            if payer.max_tokens and used > payer.max_tokens:
                whose = "the instance's" if payer is instance else f"its ancestor {payer.instance_id!r}'s"
                raise TokenBudgetExceeded(
                    f"feeding {num_tokens} more tokens would use {used} of {whose} budget of {payer.max_tokens}"
                )
        self.quotas.check(instance.user, num_tokens)
        for payer in payers:
            payer.num_tokens_used += num_tokens
        self.quotas.spend(instance.user, num_tokens)

    def _allocate(self, executor: Executor | None, instance: Instance, item: common_pb2.AllocateItem) -> Any:
        if executor is None:
            raise NoExecutor("no executor is connected")
        is_kv = item.kind == KV_PAGE
        what = resource_name(item.kind)
        table = instance.table.kv_pages if is_kv else instance.table.embed_slots
        for virtual_id in item.ids:
            if virtual_id in table:
                raise InvalidCommand(f"{what} id {virtual_id} is already allocated by this instance")
        num_ids = len(item.ids)
        limit = self.limits.max_kv_pages_per_instance if is_kv else self.limits.max_embed_slots_per_instance  # type: ignore[union-attr]
        if len(table) + num_ids > limit:
            raise ResourceExhausted(
                f"allocating {num_ids} {what}s would hold {len(table) + num_ids}, more than the {limit} one instance may hold"
            )
        self._make_room(executor, instance, is_kv, num_ids)
        resources = executor.resources
        pool = resources.kv_pages if is_kv else resources.embed_slots  # type: ignore[union-attr]
        physical = pool.allocate(num_ids)
        (executor.unsent_kv_pages if is_kv else executor.unsent_embed_slots).update(physical)
        table.update(zip(item.ids, physical, strict=True))
        item.ids[:] = physical
        return item

    def _make_room(self, executor: Executor, requester: Instance, is_kv: bool, num_ids: int) -> None:
        """Contention policy (contention.py): evict newer instances until `num_ids` are free."""
        what = "kv pages" if is_kv else "embed slots"
        while True:
            pool = executor.resources.kv_pages if is_kv else executor.resources.embed_slots  # type: ignore[union-attr]
            if pool.can_allocate(num_ids):
                return
            victim = contention.choose_victim(requester, executor.instances, kind_is_kv_page=is_kv)
            if victim is None:
                raise ResourceExhausted(
                    f"needs {num_ids} {what}, {pool.num_free} of {pool.capacity} are free on executor "
                    f"{executor.index} and no instance launched after this one holds any to evict"
                )
            self.trap(
                victim,
                Evicted(
                    f"evicted to make room: instance {requester.instance_id!r}, launched before this one, "
                    f"needed {num_ids} {what} on executor {executor.index}"
                ),
            )

    def _deallocate(self, executor: Executor | None, instance: Instance, item: common_pb2.DeallocateItem) -> Any:
        is_kv = item.kind == KV_PAGE
        what = resource_name(item.kind)
        table = instance.table.kv_pages if is_kv else instance.table.embed_slots
        physical = translate_ids(table, item.ids, what)
        for virtual_id in item.ids:
            del table[virtual_id]
        pool = executor.resources.kv_pages if is_kv else executor.resources.embed_slots  # type: ignore[union-attr]
        freed = pool.release(physical)
        if not freed:  # every page is still shared: the executor keeps it
            return None
        item.ids[:] = freed
        return item

    # ---- replies ----

    def _on_batch_reply(self, executor: Executor, response: executor_pb2.ExecuteResponse) -> None:
        correlation_id = response.correlation_id
        batch = executor.inflight.pop(correlation_id, None) or executor.unanswered.pop(correlation_id, None)
        executor.settle_unanswered(correlation_id)
        if batch is None:
            log.error("executor %d answered unknown correlation id %d (%s)", executor.index, correlation_id,
                      response.WhichOneof("result"))
            if response.WhichOneof("result") == "error":
                self.stats["batch_errors"] += 1
            return
        now = self.clock()
        self.metrics.observe_batch_reply(batch.kind, now - batch.sent_at)
        if queue_is_forward(batch.kind):
            executor.num_forward_in_flight -= 1
            queue = executor.queues.get(batch.kind)
            if queue is not None:  # the streams that get an answer now will likely send their next step
                answered = [c.stream for c in batch.commands if c.has_reply]
                self.batcher.forward_returned(queue, answered, now, now - batch.sent_at)
        result = response.WhichOneof("result")
        commands = batch.commands
        if result == "error":
            self._on_batch_error(executor, batch, response.error)
        elif result == "forward_text":
            answered = [c for c in commands if c.has_reply]
            results = response.forward_text.items
            if len(results) == len(commands):
                pairs = [(c, r) for c, r in zip(commands, results, strict=True) if c.has_reply]
            elif len(results) == len(answered):
                pairs = list(zip(answered, results, strict=True))
            else:
                self._fail_batch(executor, batch, f"executor answered {len(results)} results for {len(commands)} items")
                pairs = []
            for command, item_result in pairs:
                self._reply(command, forward_text=item_result)
        elif result == "forward":
            for command in commands:
                self._reply(command, forward=l4m_pb2.ForwardDone())
        elif result == "debug_query" and batch.kind == "debug_query":
            pass  # a barrier (`_send_barrier`): it only settles older fire-and-forget batches
        elif result == "sample_top_k":
            results = response.sample_top_k.items
            if len(results) != len(commands):
                self._fail_batch(executor, batch, f"executor answered {len(results)} results for {len(commands)} items")
            else:
                for command, distribution in zip(commands, results, strict=True):
                    self._reply(command, sample_top_k=distribution)
        else:
            self._fail_batch(executor, batch, f"executor answered a {batch.kind} batch with {result!r}")
        if batch.span is not None:
            batch.span.end()
        self._schedule_step()

    def _reply(self, command: Command, **event: Any) -> None:
        stream = command.stream
        instance = stream.instance
        if not instance.is_alive:
            return
        instance.sink.send(  # type: ignore[union-attr]
            l4m_pb2.SessionResponse(stream_id=stream.stream_id, request_id=command.request_id, **event)
        )
        self.metrics.observe_reply(command.kind, self.clock() - command.arrived_at)
        if command.span is not None:
            command.span.end()
        stream.num_replies_done += 1
        waiters = stream.sync_waiters
        while waiters and waiters[0][0] <= stream.num_replies_done:
            self._resolve_sync(waiters.popleft()[1])

    def _on_batch_error(self, executor: Executor, batch: InflightBatch, error: executor_pb2.BatchError) -> None:
        """The executor rejected a whole batch (it should not: we validate what it checks); a rejected
        batch changed nothing. The offender named by `item_index` is trapped with the executor's reason
        and the other items are sent again as a new batch, so bystanders finish normally. Two cases
        cannot be re-sent, and their instances are trapped EXECUTOR_LOST naming the batch rather than
        left with silently inconsistent state: an error that names no item, and an instance that already
        sent (or exported, imported) something after the batch, which may depend on the lost item."""
        self.stats["batch_errors"] += 1
        commands, kind = batch.commands, batch.kind
        reason = f"the executor rejected the {kind} batch: {error.reason}"
        if not error.has_item_index or error.item_index >= len(commands):
            self._fail_batch(executor, batch, reason)
            return
        culprit = commands[error.item_index]
        if culprit is not None:
            cause = Unsupported(error.reason) if error.is_unsupported else InvalidCommand(error.reason)
            self.trap(culprit.stream.instance, cause, culprit.request_id, kind)
        for command in commands:
            if command is None:
                continue
            instance = command.stream.instance
            if instance.is_alive and self._last_dispatch.get(instance) != batch.seq:
                self.trap(instance, ExecutorLost(f"{reason}; the batch held an item of another instance and "
                                                 f"this instance had already sent later commands"),
                          command.request_id, kind)
        again = [(c, item) for index, (c, item) in enumerate(zip(commands, batch.items, strict=True))
                 if index != error.item_index and c is not None and c.stream.instance.is_alive]
        if again and executor.is_connected:
            self.stats["batches_resent"] += 1
            self._send_batch(executor, kind, [item for _, item in again], [c for c, _ in again], is_resend=True)
        if kind == "deallocate":  # the ids are free in the pools already: they must reach the executor
            ended = [item for index, (c, item) in enumerate(zip(commands, batch.items, strict=True))
                     if index != error.item_index and (c is None or not c.stream.instance.is_alive)]
            if ended and executor.is_connected:
                request = executor_pb2.ExecuteRequest(correlation_id=executor.next_correlation_id())
                request.deallocate.items.extend(ended)
                executor.link.send(request)

    def _fail_batch(self, executor: Executor, batch: InflightBatch, reason: str) -> None:
        for command in batch.commands:
            if command is not None:
                self.trap(command.stream.instance, ExecutorLost(reason), command.request_id, batch.kind)

    # ---- scheduler-local commands (run at the head of their stream) ----

    def _local_get_info(self, command: Command) -> None:
        self._reply_local(command, info=self.get_info(command.item.omit_tokenizer_json))

    def _local_export(self, command: Command) -> None:
        item: l4m_pb2.ExportKvPagesCommand = command.item
        instance = command.stream.instance
        if not self.exports.can_add(item.name, instance.user, item.is_public):
            raise InvalidCommand(f"name {item.name!r} is already exported")
        physical = translate_ids(instance.table.kv_pages, item.kv_page_ids, "kv page")
        executor: Executor = instance.executor
        if item.persistent:
            self._check_export_quota(instance.user, executor, physical)
        executor.resources.kv_pages.retain(physical)  # type: ignore[union-attr]
        executor.resources.kv_pages.freeze(physical)  # type: ignore[union-attr]
        self.exports.add(Export(item.name, executor.index, tuple(physical), item.persistent, bytes(item.metadata),
                                instance.instance_id, instance.user, item.is_public))
        self._done_local(command)

    def _check_export_quota(self, user: str, executor: Executor, physical: list[int]) -> None:
        """Persistent exports outlive their instances: a user's hold at most `max_export_pages_per_user`
        distinct pages together (default half of the smallest executor), so other users can always get
        pages."""
        limit = self.config.max_export_pages_per_user
        if limit is None:
            limit = min(e.resources.kv_pages.capacity for e in self.executors if e.resources) // 2
        if not limit:
            return
        held = self.exports.num_persistent_pages(user)
        total = held + self.exports.num_new_persistent_pages(user, executor.index, physical)
        if total > limit:
            raise ResourceExhausted(
                f"a persistent export of {len(physical)} kv pages would bring user {user!r}'s persistent exports to "
                f"{total} kv pages, more than its quota of {limit} (--max-export-pages-per-user); unexport some first"
            )

    def _find_export(self, instance: Instance, name: str) -> Export:
        """The export `name` as the instance sees it; another user's private export is 'no export'."""
        export = self.exports.find(name, instance.user, instance.is_admin)
        if export is None:
            raise InvalidCommand(f"no export is named {name!r}")
        return export

    def _local_unexport(self, command: Command) -> None:
        instance = command.stream.instance
        export = self._find_export(instance, command.item.name)
        if export.owner_user != instance.user and not instance.is_admin:
            raise PermissionDenied(f"export {export.name!r} belongs to another user; only its user or an admin "
                                   f"may unexport it")
        self._drop_export(self.exports.remove(export))
        self._done_local(command)

    def _drop_export(self, export: Export) -> int:
        executor = self.executors[export.executor_index]
        if not executor.is_connected:
            return 0
        return len(self._release(executor, list(export.physical_page_ids), []))

    def _local_import(self, command: Command) -> None:
        item: l4m_pb2.ImportKvPagesCommand = command.item
        instance = command.stream.instance
        export = self._find_export(instance, item.name)
        if len(item.kv_page_ids) != len(export.physical_page_ids):
            raise InvalidCommand(
                f"export {item.name!r} has {len(export.physical_page_ids)} pages; kv_page_ids lists {len(item.kv_page_ids)}"
            )
        table = instance.table.kv_pages
        for virtual_id in item.kv_page_ids:
            if virtual_id in table:
                raise InvalidCommand(f"kv page id {virtual_id} is already allocated by this instance")
        limit = self.limits.max_kv_pages_per_instance  # type: ignore[union-attr]
        if len(table) + len(item.kv_page_ids) > limit:
            raise ResourceExhausted(f"importing {item.name!r} would hold more than the {limit} kv pages one instance may hold")
        executor = self.executors[export.executor_index]
        if instance.executor is None:
            instance.executor = executor
            executor.instances.add(instance)
        elif instance.executor is not executor:
            raise InvalidCommand(
                f"export {item.name!r} lives on executor {executor.index}; this instance is bound to executor "
                f"{instance.executor.index}"
            )
        executor.resources.kv_pages.retain(export.physical_page_ids)  # type: ignore[union-attr]
        table.update(zip(item.kv_page_ids, export.physical_page_ids, strict=True))
        self._reply_local(
            command,
            import_kv_pages=l4m_pb2.ImportKvPagesResult(num_kv_pages=len(export.physical_page_ids), metadata=export.metadata),
        )

    def _local_list_exports(self, command: Command) -> None:
        instance = command.stream.instance
        infos = [
            l4m_pb2.ExportInfo(name=e.name, num_kv_pages=len(e.physical_page_ids), persistent=e.is_persistent,
                               metadata_bytes=len(e.metadata), is_public=e.is_public)
            for e in self.exports.visible_to(instance.user, instance.is_admin)
        ]
        self._reply_local(command, list_exports=l4m_pb2.ListExportsResult(exports=infos))

    def _local_synchronize(self, command: Command) -> None:
        stream = command.stream
        if stream.num_replies_done >= stream.num_replies_sent:
            self._resolve_sync(command)
        else:
            stream.sync_waiters.append((stream.num_replies_sent, command))

    def _resolve_sync(self, command: Command) -> None:
        if command.request_id is None:  # the closing marker of finish_session
            instance = command.stream.instance
            instance.num_streams_closing -= 1
            if instance.num_streams_closing == 0:
                self.close_session(instance)
            return
        self._reply_local(command, synchronize=l4m_pb2.SynchronizeDone())

    def _local_set_stream_priority(self, command: Command) -> None:
        self.batcher.set_priority(command.stream, command.item.priority)
        self._done_local(command)

    def _local_debug_query(self, command: Command) -> None:
        query = command.item.query
        if query == "ping":
            answer = "pong"
        elif query == "stats":
            answer = json.dumps(self.stats_snapshot(), sort_keys=True)
        elif query == "batching":
            answer = self.batcher.forward_strategy.name
        else:  # "batching:<strategy>" (validation let nothing else through): a cluster-wide knob
            if not command.stream.instance.is_admin:
                raise PermissionDenied(f"{query!r} changes batching for every instance: it needs an admin instance")
            self.batcher.forward_strategy = parse_strategy(query.removeprefix("batching:"))
            answer = self.batcher.forward_strategy.name
            self._schedule_step()
        self._reply_local(command, debug_query=l4m_pb2.DebugQueryResult(response=answer))

    def _reply_local(self, command: Command, **event: Any) -> None:
        stream = command.stream
        stream.instance.sink.send(
            l4m_pb2.SessionResponse(stream_id=stream.stream_id, request_id=command.request_id, **event)
        )
        self.metrics.observe_reply(command.kind, self.clock() - command.arrived_at)
        self._done_local(command)

    def _done_local(self, command: Command) -> None:
        if command.span is not None:
            command.span.end()

    # ---- traps and freeing ----

    def trap(
        self, instance: Instance, error: TrapError, request_id: int = 0, command_kind: str | None = None
    ) -> tuple[int, int]:
        """Stop an instance: Trap event, free everything, end its session; returns (pages, slots) freed."""
        if not instance.is_alive:
            return 0, 0
        self._num_traps += 1
        prefix = f"{command_kind} (request {request_id}): " if command_kind else ""
        trap = l4m_pb2.Trap(kind=error.trap_kind, reason=prefix + error.reason, offending_request_id=request_id)
        instance.trap = trap
        kind_name = l4m_pb2.TrapKind.Name(error.trap_kind)
        self.stats["traps"][kind_name] = self.stats["traps"].get(kind_name, 0) + 1
        self.metrics.traps.labels(kind_name).inc()
        freed = self._end_instance(instance, trap.reason)
        if instance.sink is not None:
            instance.sink.send(l4m_pb2.SessionResponse(request_id=request_id, trap=trap))
            instance.sink.end(trap)
        if error.trap_kind != l4m_pb2.TRAP_KIND_DESTROYED:
            for watcher in list(self.watchers):
                watcher(instance.instance_id, trap)
        return freed

    def _end_instance(self, instance: Instance, reason: str = "session closed") -> tuple[int, int]:
        instance.state = InstanceState.ENDED
        for stream in instance.streams.values():
            if self.tracer.enabled:
                for command in stream.pending:
                    self.tracer.end_with_error(command.span, reason)
                for _, command in stream.sync_waiters:
                    self.tracer.end_with_error(command.span, reason)
            self.batcher.drop_stream(stream)
            stream.sync_waiters.clear()
        self._last_dispatch.pop(instance, None)
        executor: Executor | None = instance.executor
        if executor is None or not executor.is_connected:
            instance.table.clear()
            return 0, 0
        for queue in executor.queues.values():
            if queue.num_items:
                queue.remove_instance(instance)
        executor.instances.discard(instance)
        if executor.unanswered:
            executor.forget_instance(instance)
        pages, slots = instance.table.clear()
        num_pages_freed = len(self._release(executor, pages, []))
        num_slots_freed = len(self._release(executor, [], slots))
        for export in self.exports.owned_by(instance.instance_id, is_persistent=False):
            num_pages_freed += self._drop_export(self.exports.remove(export))
        return num_pages_freed, num_slots_freed

    def _release(self, executor: Executor, pages: list[int], slots: list[int]) -> list[int]:
        """Drop one reference from each id; tell the executor to deallocate those nobody holds."""
        resources = executor.resources
        freed: list[int] = []
        for ids, pool, unsent, kind in (
            (pages, resources.kv_pages, executor.unsent_kv_pages, KV_PAGE),  # type: ignore[union-attr]
            (slots, resources.embed_slots, executor.unsent_embed_slots, EMBED_SLOT),  # type: ignore[union-attr]
        ):
            if not ids:
                continue
            now_free = pool.release(ids)
            freed.extend(now_free)
            told = [i for i in now_free if i not in unsent] if unsent else now_free
            if told:
                request = executor_pb2.ExecuteRequest(correlation_id=executor.next_correlation_id())
                request.deallocate.items.add(kind=kind, ids=told)
                executor.link.send(request)
        return freed

    # ---- executors ----

    def _on_executor_connected(self, executor: Executor, info: executor_pb2.ExecutorServiceGetInfoResponse) -> None:
        if self.model is not None and info.model.name != self.model.name:
            log.error("executor %s serves %r, not %r; ignored", executor.link.address, info.model.name, self.model.name)
            return
        self.batcher.add_queues(executor.connect(info))
        if self.model is None:
            self.model = info.model
            self._model_without_tokenizer = common_pb2.ModelInfo()
            self._model_without_tokenizer.CopyFrom(info.model)
            self._model_without_tokenizer.ClearField("tokenizer_json")
        self._update_limits()
        log.info("executor %d (%s) connected: %d pages", executor.index, executor.link.address, info.num_kv_pages)
        self._schedule_step()

    def _on_executor_lost(self, executor: Executor, reason: str) -> None:
        if not executor.is_connected:
            return
        for instance in list(executor.instances):
            self.trap(instance, ExecutorLost(f"executor {executor.index} ({executor.link.address}) was lost: {reason}"))
        for export in self.exports.on_executor(executor.index):
            self.exports.remove(export)
        self.batcher.remove_queues(executor.disconnect())
        log.warning("executor %d (%s) lost: %s", executor.index, executor.link.address, reason)

    def _update_limits(self) -> None:
        infos = [e.info for e in self.executors if e.is_connected and e.info is not None]
        if not infos:
            return
        model = self.model
        max_pages = min(i.num_kv_pages for i in infos)
        max_slots = min(i.num_embed_slots for i in infos)
        config = self.config
        self.limits = ModelLimits(
            vocab_size=model.vocab_size,  # type: ignore[union-attr]
            kv_page_size=infos[0].kv_page_size,
            max_context_tokens=model.max_context_tokens,  # type: ignore[union-attr]
            max_batch_tokens=min(i.max_batch_tokens or (1 << 30) for i in infos),
            max_kv_pages_per_instance=min(max_pages, config.max_kv_pages_per_instance or max_pages),
            max_embed_slots_per_instance=min(max_slots, config.max_embed_slots_per_instance or max_slots),
            capabilities=frozenset(model.capabilities),  # type: ignore[union-attr]
            max_continuation_steps=min(config.max_continuation_steps, MAX_CONTINUATION_STEPS),
            max_export_name_bytes=config.max_export_name_bytes,
            max_export_metadata_bytes=config.max_export_metadata_bytes,
            # Per command, the smaller of what every executor allows one batch and the scheduler's default;
            # the reply must fit an empty batch's reply on every link and the controller's stream.
            max_distribution_entries_per_command=min(
                bounds.DEFAULT_MAX_DISTRIBUTION_ENTRIES_PER_COMMAND,
                *(i.max_distribution_entries_per_batch or bounds.EXECUTOR_MAX_DISTRIBUTION_ENTRIES_PER_BATCH
                  for i in infos)),
            max_reply_bytes=min(bounds.MAX_RESPONSE_BYTES, bounds.EXECUTOR_MAX_REPLY_BYTES,
                                *(i.max_reply_bytes or bounds.EXECUTOR_MAX_REPLY_BYTES for i in infos))
            - bounds.MESSAGE_MARGIN_BYTES,
        )

    def get_info(self, omit_tokenizer_json: bool = False) -> l4m_pb2.GetInfoResponse:
        limits = self.limits
        if limits is None:
            raise NoExecutor("no executor is connected yet")
        return l4m_pb2.GetInfoResponse(
            protocol_version=PROTOCOL_VERSION,
            model=self._model_without_tokenizer if omit_tokenizer_json else self.model,
            kv_page_size=limits.kv_page_size,
            max_kv_pages_per_instance=limits.max_kv_pages_per_instance,
            max_embed_slots_per_instance=limits.max_embed_slots_per_instance,
            num_free_kv_pages=sum(e.resources.kv_pages.num_free for e in self.executors if e.resources),
            num_executors=sum(1 for e in self.executors if e.is_connected),
            max_continuation_steps=limits.max_continuation_steps,
            max_distribution_entries_per_command=limits.max_distribution_entries_per_command,
            max_tokens_per_command=limits.max_batch_tokens,
            max_command_bytes=bounds.MAX_COMMAND_BYTES,
            max_response_bytes=bounds.MAX_RESPONSE_BYTES,
            max_mask_runs_per_command=limits.max_mask_runs_per_command,
        )

    def stats_snapshot(self) -> dict[str, Any]:
        return {
            **self.stats,
            "batching": self.batcher.forward_strategy.name,
            "queued": self.batcher.num_queued,
            "instances_active": self.instances.num_active(),
            "instances_registered": len(self.instances),
            "exports": len(self.exports),
            "executors": [
                {
                    "address": e.link.address,
                    "connected": e.is_connected,
                    "kv_pages_free": e.resources.kv_pages.num_free if e.resources else 0,
                    "kv_pages_total": e.resources.kv_pages.capacity if e.resources else 0,
                    "embed_slots_free": e.resources.embed_slots.num_free if e.resources else 0,
                    "embed_slots_total": e.resources.embed_slots.capacity if e.resources else 0,
                    "batches_in_flight": len(e.inflight),
                }
                for e in self.executors
            ],
        }


def queue_is_forward(kind: str) -> bool:
    return kind == "forward_text" or kind == "forward"


def _written_ranges(command: Command, page_size: int) -> list[tuple[int, int, int]]:
    """(physical page, first slot, end slot) of each page a translated forward item writes: its last
    `num written` token slots (the LENGTH RULE), continuation steps included."""
    item = command.item
    if command.kind == "forward_text":
        num_written = len(item.token_ids) + item.num_continuation_steps
    else:
        num_written = len(item.input_embed_slot_ids)
    pages = item.kv_page_ids
    total = page_size * (len(pages) - 1) + item.kv_last_page_length
    first = max(0, total - num_written)
    ranges = []
    for index in range(first // page_size, min(len(pages), -(-total // page_size))):
        start = max(first, index * page_size) - index * page_size
        end = min(total, (index + 1) * page_size) - index * page_size
        ranges.append((pages[index], start, end))
    return ranges


# Local commands that change what an instance's pages mean to others: a rejected batch of the instance
# sent before one of them is not sent again (see `Scheduler._on_batch_error`).
_SHARING_KINDS = frozenset({"export_kv_pages", "unexport_kv_pages", "import_kv_pages"})
# Fire-and-forget batches not yet known to have run, per executor, before a barrier ping is sent.
_MAX_UNANSWERED = 64


_LOCAL_HANDLERS: dict[str, Callable[[Scheduler, Command], None]] = {
    "get_info": Scheduler._local_get_info,
    "export_kv_pages": Scheduler._local_export,
    "unexport_kv_pages": Scheduler._local_unexport,
    "import_kv_pages": Scheduler._local_import,
    "list_exports": Scheduler._local_list_exports,
    "synchronize": Scheduler._local_synchronize,
    "set_stream_priority": Scheduler._local_set_stream_priority,
    "debug_query": Scheduler._local_debug_query,
}

__all__ = ["Scheduler", "Stream", "PROTOCOL_VERSION"]
