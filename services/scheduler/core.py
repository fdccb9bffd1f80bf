"""The scheduler core: instances, their commands, batching and executors, tied together.

A command's life: `submit` looks its kind up in the kind table (kinds.py), checks its shape and queues
it on its stream; the batcher moves it into its executor's batch queue when it reaches the head of the
stream; when the queue fires, `_fire` makes room (an allocate batch evicts before it is built), translates
virtual ids to physical ones *in send order* (translate.py; so the tables always describe exactly what
the executor has been told), sends one `ExecuteRequest`, and the reply, if the batch has one, is
dispatched back to the commands by position. A forward_text longer than the chunk budget queues as
consecutive chunks and is answered once, when its last chunk is (prefill.py). Scheduler-local commands
(exports.py, local.py) run when they reach the head of their stream, after everything the stream sent
before them was sent; they return a `LocalOutcome` (outbound.py) that the core acts on.

Freeing: a deallocate returns physical ids to the pool when it is sent; any later allocate that
reuses them is sent after it, and the executor runs batches in order. A trapped or closed instance
loses its queued commands (never sent) and everything it held; the executor is told to deallocate
the ids nobody holds any more.

Blame: two forward items of one instance writing one kv slot are split into ordered batches (one
stream) or trap that instance (two streams) before sending (`_plan_waves`). A batch the executor
rejects anyway traps the item it names and is sent again without it (`_on_batch_error`); fire-and-forget
batches are kept (`Executor.unanswered`) until a later reply shows they ran, so their rejections are
blamed the same way.

Memory pressure (contention.py; docs/operations.md "Under memory pressure"): an allocate of kv pages the
pool cannot hold first evicts persistent, unpinned exports, least recently used first (`_evict_exports`),
then preempts instances ranked after its instance (`_make_kv_room`, `_preempt`): their
unshared pages are copied to host swap slots (`swap_out`, sent before the allocate that reuses them) and
their commands are held, unsent, in `Instance.held` (at `_route` and at `_fire`; batches already sent
finish first: the executor runs in order). When nothing ranked after it can make room, the requester
itself parks, waiting (`_wait`): the admission queue, bounded in size and time. At each step, while
anything is parked, `_retry_parked` resumes parked instances in rank order (preempting again for the
first, never for a later one): `swap_in` to fresh pages, the table remapped, the held commands queued
again in order. An instance that resumed sees only a delay.

Synchronize resolves when it reaches the head of its stream (all earlier commands are sent) and every
earlier command of the stream that has a reply was answered; the executor runs in order, so
fire-and-forget commands sent before those replies are done too.

Everything here runs on one asyncio loop thread; nothing blocks.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from typing import Any, cast

from l4m.scheduler import contention
from l4m.scheduler.batcher import Batcher, BatchQueue, Command, Stream, parse_strategy
from l4m.scheduler.config import SchedulerConfig
from l4m.scheduler.errors import (
    Destroyed,
    Evicted,
    ExecutorLost,
    InvalidCommand,
    NoExecutor,
    ResourceExhausted,
    TooManyInstances,
    TrapError,
    UnknownParent,
    Unsupported,
)
from l4m.scheduler.executors import Executor, ExecutorLink, InflightBatch
from l4m.scheduler.exports import Export, ExportTable
from l4m.scheduler.instances import EventSink, Instance, InstanceRegistry, InstanceState
from l4m.scheduler.kinds import KINDS
from l4m.scheduler.metrics import SchedulerMetrics
from l4m.scheduler.models import ServedModel, UnknownModel
from l4m.scheduler.outbound import LocalOutcome
from l4m.scheduler.prefill import Chunk, ChunkedPrefill, chunk_budget
from l4m.scheduler.quotas import UserQuotas, spend_tokens
from l4m.scheduler.tracing import SchedulerTracer
from l4m.scheduler.translate import claim_allocation
from l4m.scheduler.validation import EMBED_SLOT, KV_PAGE, ModelLimits
from l4m.v1 import common_pb2, executor_pb2, l4m_pb2
from l4m.wire import limits as bounds
from l4m.wire import rules
from l4m.wire.rules import MAX_CONTINUATION_STEPS

log = logging.getLogger(__name__)

PROTOCOL_VERSION = "l4m.v1"

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
        # Memory pressure: the instances parked now (suspended or waiting), and those in the admission queue
        # (from a first failed allocation until one gets through, parked or being retried).
        self._parked: set[Instance] = set()
        self._waiters: set[Instance] = set()
        self._retried_at: tuple[int, ...] = ()  # what `_retry_parked` last saw (`_retry_key`)
        self._num_park_changes = 0
        self.metrics.bind_pressure_gauges(
            lambda: sum(len(i.table.swapped_kv_pages) for i in self._parked),
            lambda: sum(1 for i in self._parked if i.is_suspended),
            lambda: len(self._waiters),
        )
        self.models: dict[str, ServedModel] = {}  # by name, in the order their executors first connected
        self.watchers: list[Watcher] = []
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
        return any(m.limits is not None for m in self.models.values())

    @property
    def default_model(self) -> ServedModel | None:
        """The model of the first executor (in `--executor` order) that ever connected."""
        for executor in self.executors:
            if executor.info is not None:
                return self.models[executor.info.model.name]
        return None

    @property
    def model(self) -> common_pb2.ModelInfo | None:
        """The default model's info (None before any executor connected)."""
        model = self.default_model
        return model.info if model is not None else None

    def served_model(self, name: str = "") -> ServedModel:
        """The model `name` names ("" = the default); raises UnknownModel, or NoExecutor before any connected."""
        model = self.models.get(name) if name else self.default_model
        if model is None:
            if not self.models:
                raise NoExecutor("no executor is connected yet")
            raise UnknownModel(name, self.model_names())
        return model

    @staticmethod
    def limits_of(instance: Instance) -> ModelLimits:
        """The limits an instance's commands are checked against: those of the model its session serves."""
        model = instance.model
        if model is None or model.limits is None:
            raise NoExecutor("no executor is connected yet")
        return model.limits

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
        self.batcher.instance_launched(instance, self.clock())
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

    def open_session(self, instance: Instance, sink: EventSink, traceparent: str | None = None,
                     model: ServedModel | None = None) -> Instance:
        """A session of `instance` starts, on `model` (default: the default model); returns the instance
        the session speaks for. The instance's first session is its own; a later one on another model (the
        controller's `ctx.load_model`) gets a companion instance (see `Instance.companions`). Raises
        ValueError when it cannot: the instance ended, or it has a live session on that model already."""
        model = model or self.served_model()
        if instance.state is InstanceState.ACTIVE and instance.companion_of is None and model is not instance.model:
            instance = self._companion(instance, model)
        if instance.state is not InstanceState.REGISTERED:
            raise ValueError(f"instance {instance.instance_id!r} is {instance.state.value}; one session per instance "
                             f"and model")
        instance.model = model
        instance.state = InstanceState.ACTIVE
        instance.sink = sink
        instance.trace_context = self.tracer.extract(traceparent) if self.tracer.enabled else None
        self.metrics.session_opened(instance, self.clock())
        return instance

    def _companion(self, instance: Instance, model: ServedModel) -> Instance:
        """The instance a controller's session on a second model speaks for, registered for the session
        (and forgotten when it ends); a child of `instance` (same user, its tokens charged there too)."""
        companion = instance.companions.get(model.name)
        if companion is not None:
            return companion  # alive: open_session refuses a second session on that model
        companion = self.register_instance(
            # A token nobody holds: the companion is reached only through its main instance's token.
            f"{instance.instance_id}@{model.name}", secrets.token_urlsafe(24), 0, instance.launched_at_unix_ms,
            user=instance.user, is_admin=instance.is_admin, parent_instance_id=instance.instance_id,
        )
        companion.companion_of = instance
        instance.companions[model.name] = companion
        return companion

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
            self.batcher.submit(Command(stream, None, "synchronize", None, now, 0, is_executor_kind=False))
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
        name = request.WhichOneof("command")
        self.metrics.count_command(name or "none")
        kind = KINDS.get(name) if name is not None else None
        if kind is None:
            self.trap(instance, InvalidCommand("the SessionRequest carries no command"), request.request_id, name)
            return
        item = getattr(request, name)
        try:
            limits = self.limits_of(instance)
            if kind.capability is not None:
                kind.check_capability(limits)
            reply_cost = kind.check(item, limits)
        except TrapError as error:
            self.trap(instance, error, request.request_id, name)
            return
        num_tokens = kind.num_tokens(item)
        stream = instance.streams.get(request.stream_id) or instance.stream(request.stream_id)
        command = Command(stream, request.request_id, name, item, self.clock(), num_tokens,
                          is_executor_kind=kind.is_executor_kind, reply_cost=reply_cost)
        if self.tracer.enabled:
            command.span = self.tracer.command_span(
                name,
                instance.trace_context,
                {"l4m.instance_id": instance.instance_id, "l4m.command": name, "l4m.request_id": request.request_id,
                 "l4m.stream_id": request.stream_id, "l4m.tokens": num_tokens,
                 "l4m.kv_pages": kind.num_kv_pages(item),
                 "l4m.instance.kv_pages_held": len(instance.table.kv_pages)},
            )
        chunked = kind.split(item, limits, num_tokens) if kind.split is not None else None
        if chunked is None:
            self.batcher.submit(command)
        else:
            self._submit_chunks(command, chunked)
        self._schedule_step()

    def _submit_chunks(self, command: Command, prefill: ChunkedPrefill) -> None:
        """A forward_text too long for one batch queues as its chunks, in order (prefill.py). Each links
        the command's span to its batch; the last chunk's answer ends it and answers the command."""
        kind = KINDS[command.kind]
        for index, item in enumerate(prefill.items):
            chunk = Command(command.stream, command.request_id, command.kind, item, command.arrived_at,
                            kind.num_tokens(item), is_executor_kind=True)
            chunk.chunk = Chunk(prefill, index)
            chunk.span = command.span
            self.batcher.submit(chunk)

    def _schedule_step(self) -> None:
        if not self._step_scheduled and self._loop is not None:
            self._step_scheduled = True
            self._loop.call_soon(self.step)

    def step(self) -> None:
        """Move ready streams into queues and fire due batches, until nothing more can move."""
        self._step_scheduled = False
        batcher = self.batcher
        now = self.clock()
        num_retries = 0
        while True:
            if self._parked and self._retry_key() != self._retried_at:
                if num_retries == _MAX_RETRIES_PER_STEP:  # go on in a later turn of the loop: never spin here
                    self._schedule_step()
                    break
                num_retries += 1
                self._retry_parked()
            batcher.pump(self._route)
            batcher.fire_due(now, self._fire)
            if not batcher.has_ready() and not (self._parked and self._retry_key() != self._retried_at):
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
        kind = KINDS[command.kind]
        if instance.is_parked:  # the stream's commands wait, in order, until it resumes
            stream = command.stream
            instance.held.extend(stream.pending)
            stream.pending.clear()
            return None
        try:
            if kind.run_local is not None:
                if kind.permit is not None:
                    kind.permit(instance, command.item)
                self._run_local(command, kind.run_local(self, command, command.item))
                if kind.is_sharing:
                    self._dispatch_seq += 1
                    self._last_dispatch[instance] = self._dispatch_seq
                return None
            executor = instance.executor
            if executor is None:
                if kind.name != "allocate" and kind.translate is not None:
                    # Owns nothing yet: raises, naming the first id.
                    kind.translate(command.item, instance.table, None, self.limits_of(instance))
                executor = self._bind(instance)
            return executor.queues[kind.name]
        except TrapError as error:
            self.trap(instance, error, command.request_id, kind.name)
            return None

    def _bind(self, instance: Instance) -> Executor:
        """Bind an instance to the connected executor of its model with the most free pages (fewest
        instances on ties)."""
        name = instance.model.name if instance.model is not None else ""
        candidates = [e for e in self.executors if e.is_connected and e.info is not None and e.info.model.name == name]
        if not candidates:
            raise NoExecutor(f"no executor of model {name!r} is connected")
        executor = max(candidates, key=lambda e: (e.pools().kv_pages.num_free, -len(e.instances)))
        instance.executor = executor
        executor.instances.add(instance)
        return executor

    def _fire(self, queue: BatchQueue, commands: list[Command]) -> None:
        """Make room, translate and send one batch."""
        executor = cast(Executor, queue.target)
        kind = KINDS[queue.kind]
        translate = kind.translate
        if translate is None:  # only executor kinds have queues
            return
        limits = cast(ModelLimits, self.models[cast(Any, executor.info).model.name].limits)  # connected: it has both
        if kind.name == "allocate":
            self._make_room(executor, commands, limits)
        traps_before = self._num_traps
        items, sent = [], []
        for command in commands:
            instance = command.stream.instance
            if not instance.is_alive:
                continue
            if instance.is_parked:  # preempted or waiting: sent once it resumes
                instance.held.append(command)
                continue
            try:
                item = translate(command.item, instance.table, executor, limits)
                if command.num_tokens:
                    spend_tokens(self.quotas, instance, command.num_tokens)
            except TrapError as error:
                self.trap(instance, error, command.request_id, kind.name)
                continue
            if instance.wait_started is not None and kind.name == "allocate" and item.kind == KV_PAGE:
                self._admitted(instance)
            if item is not None:
                items.append(item)
                sent.append(command)
            elif command.span is not None:
                command.span.end()
        waves = self._plan_waves(sent) if queue.is_forward and len(sent) > 1 else None
        if self._num_traps != traps_before:  # a trap may have hit an instance already in this batch
            # A translated deallocate already returned its ids to the pool, so it must reach the executor
            # even when its instance trapped later in this batch (or the ids would be handed out again
            # while the executor still holds them).
            kept = [i for i, c in enumerate(sent) if c.stream.instance.is_alive or kind.frees_when_translated]
            items, sent = [items[i] for i in kept], [sent[i] for i in kept]
            waves = [waves[i] for i in kept] if waves is not None else None
        if not sent:
            return
        if waves is None:
            self._send_batch(executor, kind.name, items, sent)
            return
        for wave in range(max(waves) + 1):  # in order: a later wave reads what an earlier one wrote
            chosen = [i for i, w in enumerate(waves) if w == wave]
            self._send_batch(executor, kind.name, [items[i] for i in chosen], [sent[i] for i in chosen])

    def _make_room(self, executor: Executor, commands: list[Command], limits: ModelLimits) -> None:
        """Before an allocate batch is built: check each allocate against its instance and, where the pool
        cannot hold it on top of the batch's earlier allocates, preempt (kv pages) or evict (embed slots)
        until it can (contention.py). A kv requester that cannot be served so waits (`_wait`): its commands
        are held by the translation that follows, like those of the instances preempted here. What fails
        traps its own instance."""
        pools = executor.pools()
        claimed: dict[tuple[Instance, bool], set[int]] = {}  # virtual ids claimed in this batch
        admitted: list[tuple[Instance, bool, int]] = []  # (instance, is kv, ids) of the allocates that fit
        for command in commands:
            instance = command.stream.instance
            if not instance.is_alive or instance.is_parked:
                continue
            item: common_pb2.AllocateItem = command.item
            is_kv = item.kind == KV_PAGE
            try:
                num_ids = claim_allocation(item, instance.table, limits, claimed.setdefault((instance, is_kv), set()))
                if is_kv:
                    if not self._make_kv_room(executor, instance, num_ids, admitted):
                        self._wait(executor, instance, num_ids,
                                   item.max_wait_ms / 1000 if item.HasField("max_wait_ms") else None)
                        continue
                elif not pools.embed_slots.can_allocate(_num_claimed(admitted, False) + num_ids):
                    self._evict(executor, instance, is_kv, num_ids, admitted)
            except TrapError as error:
                self.trap(instance, error, command.request_id, "allocate")
                continue
            admitted.append((instance, is_kv, num_ids))

    def _make_kv_room(self, executor: Executor, requester: Instance, num_ids: int,
                      admitted: list[tuple[Instance, bool, int]], num_reserved: int = 0) -> bool:
        """Whether `num_ids` more kv pages fit beside the batch's admitted allocates (and `num_reserved`),
        after evicting persistent unpinned exports, least recently used first, then preempting instances
        ranked after `requester`, the last-ranked first, each as few as it takes (contention.py). Nothing is
        evicted nor preempted when all of it would not be enough, nor when an instance ranked before the
        requester is parked on this executor (it goes first: the requester waits behind it)."""
        pool = executor.pools().kv_pages

        def shortfall() -> int:
            return _num_claimed(admitted, True) + num_reserved + num_ids - pool.num_free

        if any(p.executor is executor and contention.rank(p) < contention.rank(requester) for p in self._parked):
            return False
        if shortfall() <= 0:
            return True
        evicted, num_evicted = contention.export_victims(self.exports.evictable_on(executor.index), pool.refcount,
                                                         shortfall())
        claiming = {i for i, k, n in admitted if k and n and i.is_alive and not i.is_parked}
        chosen, num_freed = [], num_evicted
        for victim in contention.preemption_victims(requester, executor.instances, claiming=claiming):
            if num_freed >= shortfall():
                break
            chosen.append(victim)
            num_freed += _num_movable(pool, victim) + sum(n for i, k, n in admitted if i is victim and k)
        if num_freed < shortfall():
            return False
        self._evict_exports(executor, evicted, requester)
        for victim in chosen:
            self._preempt(executor, victim, requester, num_ids)
        return shortfall() <= 0

    def _preempt(self, executor: Executor, victim: Instance, requester: Instance, num_ids: int) -> None:
        """Suspend `victim` for `requester`: its unshared kv pages go to host swap slots and are freed (a
        `swap_out` sent now, so it runs after every batch already sent and before any allocate that reuses
        the pages), its commands are held. Pages it shares (exported, imported: refcount > 1, or frozen)
        stay where they are. With the swap space too full for its pages it is evicted instead."""
        pools = executor.pools()
        pool, swap = pools.kv_pages, pools.swap_slots
        moving = [(v, p) for v, p in victim.table.kv_pages.items() if pool.refcount(p) == 1 and not pool.is_frozen(p)]
        if not swap.can_allocate(len(moving)):
            self.trap(victim, Evicted(
                f"evicted to make room: instance {requester.instance_id!r}, which goes before this one (priority, "
                f"then launch order), needed {num_ids} kv pages on executor {executor.index}, and the swap space "
                f"is full: {swap.num_free} of {swap.capacity} swap slots free, this instance's {len(moving)} "
                f"pages would need them (--swap-space-pages)"))
            return
        victim.is_suspended = True
        self._park(victim)
        self.metrics.num_preemptions += 1
        if moving:
            slots = swap.allocate(len(moving))
            table = victim.table
            for (virtual, _), slot in zip(moving, slots, strict=True):
                del table.kv_pages[virtual]
                table.swapped_kv_pages[virtual] = slot
            pages = [p for _, p in moving]
            pool.release(pages)
            request = executor_pb2.ExecuteRequest(correlation_id=executor.next_correlation_id())
            request.swap_out.items.add(kv_page_ids=pages, swap_slot_ids=slots)
            executor.link.send(request)
            self.metrics.num_pages_swapped_out += len(pages)
        # A rejected batch of it sent before this must not be sent again with the old pages (_on_batch_error).
        self._dispatch_seq += 1
        self._last_dispatch[victim] = self._dispatch_seq
        log.info("preempted instance %r (%d kv pages to swap) for %r on executor %d", victim.instance_id,
                 len(moving), requester.instance_id, executor.index)

    def _evict_exports(self, executor: Executor, exports: list[Export], requester: Instance) -> None:
        """Drop exports for `requester`'s pages as if unexported (their owners are not told; importers keep
        their pages): the deallocate of the pages they free is sent now, before the allocate that reuses them."""
        for export in exports:
            num_freed = self._drop_export(self.exports.remove(export))
            self.metrics.num_exports_evicted += 1
            self.metrics.num_export_pages_evicted += num_freed
            log.info("evicted export %r of user %r (%d kv pages freed) for %r on executor %d", export.name,
                     export.owner_user, num_freed, requester.instance_id, executor.index)

    def _wait(self, executor: Executor, instance: Instance, num_ids: int, max_wait_s: float | None) -> None:
        """Park a requester whose kv pages neither the pool nor preemption can give it: the admission
        queue, for at most --admission-timeout-s or the allocate's `max_wait_s`, whichever is smaller.
        Raises ResourceExhausted when the queue is full or the allocate will not wait."""
        pool = executor.pools().kv_pages
        if instance.wait_started is None:
            needs = (f"needs {num_ids} kv pages, {pool.num_free} of {pool.capacity} are free on executor "
                     f"{executor.index}, preempting instances that go after this one cannot make room")
            if max_wait_s == 0:
                raise ResourceExhausted(f"{needs}, and the allocate asked not to wait (max_wait_ms 0)")
            max_waiting = self.config.max_waiting_instances
            if len(self._waiters) >= max_waiting:
                raise ResourceExhausted(f"{needs}, and the admission queue is full ({len(self._waiters)} of "
                                        f"{max_waiting} instances wait; --max-waiting-instances)")
            timeout_s, limit = self.config.admission_timeout_s, f"--admission-timeout-s {self.config.admission_timeout_s:g}"
            if max_wait_s is not None and max_wait_s < timeout_s:
                timeout_s, limit = max_wait_s, f"its allocate's max_wait_ms {round(max_wait_s * 1000)}"
            instance.wait_started = self.clock()
            self._waiters.add(instance)
            if self._loop is not None:
                instance.wait_timer = self._loop.call_later(timeout_s, self._wait_timed_out, instance, num_ids, limit)
        instance.is_waiting = True
        instance.wait_num_pages = num_ids
        self._park(instance)

    def _admitted(self, instance: Instance) -> None:
        """An allocate of a waiting instance got through: it leaves the admission queue."""
        self.metrics.admission_wait_seconds.observe(self.clock() - cast(float, instance.wait_started))
        self._leave_queue(instance)

    def _leave_queue(self, instance: Instance) -> None:
        instance.wait_started = None
        self._waiters.discard(instance)
        if instance.wait_timer is not None:
            instance.wait_timer.cancel()
            instance.wait_timer = None

    def _wait_timed_out(self, instance: Instance, num_ids: int, limit: str) -> None:
        instance.wait_timer = None
        if not instance.is_alive or instance.wait_started is None:
            return
        held = next((c for c in instance.held if c.kind == "allocate"), None)
        self.trap(instance, ResourceExhausted(
            f"waited {self.clock() - instance.wait_started:.1f} s in the admission queue for {num_ids} kv pages "
            f"({limit}); instances that go before it held them"),
            held.request_id if held is not None else 0, "allocate")

    def _park(self, instance: Instance) -> None:
        self._parked.add(instance)
        self._num_park_changes += 1

    def _retry_key(self) -> tuple[int, ...]:
        """What decides whether a parked instance could resume: free pages per executor, parking changes."""
        return (self._num_park_changes, *(e.resources.kv_pages.num_free for e in self.executors if e.resources))

    def _retry_parked(self) -> None:
        """Resume parked instances in rank order, each when its swapped pages and the pages it waits for fit
        (preempting instances ranked after it); the first that cannot stops its executor's queue."""
        self._retried_at = self._retry_key()
        for executor in self.executors:
            if not executor.is_connected:
                continue
            num_reserved = 0
            for instance in sorted((i for i in self._parked if i.executor is executor), key=contention.rank):
                if instance not in self._parked:  # evicted to make room for one resumed before it
                    continue
                self._parked.discard(instance)  # ranks are compared among the others
                num_pages = len(instance.table.swapped_kv_pages) + instance.wait_num_pages
                fits = self._make_kv_room(executor, instance, num_pages, [], num_reserved)
                if not fits:
                    self._parked.add(instance)
                    break
                num_reserved += instance.wait_num_pages
                self._resume(executor, instance)
        self._retried_at = self._retry_key()

    def _resume(self, executor: Executor, instance: Instance) -> None:
        """Swap a parked instance's pages back in to fresh pages (the pool has them: `_make_kv_room`), remap
        its table and queue its held commands again, in order."""
        self._num_park_changes += 1
        table = instance.table
        if table.swapped_kv_pages:
            pools = executor.pools()
            virtual, slots = list(table.swapped_kv_pages), list(table.swapped_kv_pages.values())
            pages = pools.kv_pages.allocate(len(slots))
            request = executor_pb2.ExecuteRequest(correlation_id=executor.next_correlation_id())
            request.swap_in.items.add(kv_page_ids=pages, swap_slot_ids=slots)
            executor.link.send(request)
            table.kv_pages.update(zip(virtual, pages, strict=True))
            pools.swap_slots.release(table.clear_swapped())
            self._dispatch_seq += 1
            self._last_dispatch[instance] = self._dispatch_seq
        if instance.is_suspended:
            self.metrics.num_resumes += 1
        instance.is_suspended = instance.is_waiting = False
        instance.wait_num_pages = 0
        held, instance.held = instance.held, deque()
        by_stream: dict[Stream, list[Command]] = {}
        for command in held:
            by_stream.setdefault(command.stream, []).append(command)
        for stream, commands in by_stream.items():  # before what the stream queued or sent since it parked
            self.batcher.put_back(stream, commands)

    def _evict(self, executor: Executor, requester: Instance, is_kv: bool, num_ids: int,
               admitted: list[tuple[Instance, bool, int]]) -> None:
        """Contention policy (contention.py): evict newer instances until `num_ids` more fit beside what the
        batch's admitted allocates take (a victim's own allocates no longer count)."""
        what = "kv pages" if is_kv else "embed slots"
        pools = executor.pools()
        pool = pools.kv_pages if is_kv else pools.embed_slots
        while True:
            num_claimed = _num_claimed(admitted, is_kv)
            if pool.can_allocate(num_claimed + num_ids):
                return
            claiming = {i for i, k, n in admitted if k is is_kv and n}
            victim = contention.choose_victim(requester, executor.instances, kind_is_kv_page=is_kv, claiming=claiming)
            if victim is None:
                raise ResourceExhausted(
                    f"needs {num_ids} {what}, {pool.num_free - num_claimed} of {pool.capacity} are free on executor "
                    f"{executor.index} and no instance launched after this one holds any to evict"
                )
            self.trap(
                victim,
                Evicted(
                    f"evicted to make room: instance {requester.instance_id!r}, launched before this one, "
                    f"needed {num_ids} {what} on executor {executor.index}"
                ),
            )

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
        page_size = self.limits_of(commands[0].stream.instance).kv_page_size
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
        num_instances = len({id(c.stream.instance) for c in commands}) if len(commands) > 1 else 1
        self.metrics.observe_batch(kind, len(commands), num_instances)
        self._dispatch_seq += 1
        seq = self._dispatch_seq
        for command in commands:
            self._last_dispatch[command.stream.instance] = seq
        spec = KINDS[kind]
        if spec.is_replied:
            has_reply = spec.has_reply
            for command in commands:
                command.has_reply = counts = has_reply(command.item)
                chunk = command.chunk
                if chunk is not None:  # every chunk's answer is kept; the last one answers the command
                    counts = chunk.is_last and chunk.prefill.has_outputs
                    command.has_reply = counts or not chunk.is_last
                if counts and not is_resend:
                    command.stream.num_replies_sent += 1
            executor.inflight[correlation_id] = InflightBatch(kind, commands, batch_span, self.clock(), seq, items)
            if spec.is_forward:
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

    # ---- replies ----

    def _on_batch_reply(self, executor: Executor, response: executor_pb2.ExecuteResponse) -> None:
        correlation_id = response.correlation_id
        batch = executor.inflight.pop(correlation_id, None) or executor.unanswered.pop(correlation_id, None)
        executor.settle_unanswered(correlation_id)
        if batch is None:
            log.error("executor %d answered unknown correlation id %d (%s)", executor.index, correlation_id,
                      response.WhichOneof("result"))
            if response.WhichOneof("result") == "error":
                self.metrics.num_batch_errors += 1
            return
        now = self.clock()
        self.metrics.observe_batch_reply(batch.kind, now - batch.sent_at)
        if KINDS[batch.kind].is_forward:
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
                if command.chunk is None:
                    self._reply_forward_text(command, item_result)
                else:
                    self._chunk_answered(command, item_result)
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
        sink = instance.sink
        if not instance.is_alive or sink is None:
            return
        sink.send(l4m_pb2.SessionResponse(stream_id=stream.stream_id, request_id=command.request_id, **event))
        self.metrics.observe_reply(command.kind, self.clock() - command.arrived_at)
        if command.span is not None:
            command.span.end()
        stream.num_replies_done += 1
        waiters = stream.sync_waiters
        while waiters and waiters[0][0] <= stream.num_replies_done:
            self._resolve_sync(waiters.popleft()[1])

    def _reply_forward_text(self, command: Command, result: common_pb2.ForwardTextResult) -> None:
        """Reply, counting the sampled tokens the reply carries (generated tokens, TTFT, ITL) first: the reply
        may end the instance (the last one a half-closed session waited for)."""
        instance = command.stream.instance
        if instance.is_alive:
            outputs = result.outputs
            num_tokens = len(outputs)
            # Every output is a sampled token unless a sampler asked for a distribution, which `reply_cost`
            # counted in num_entries when the command arrived (a chunk's counts only its own outputs).
            if command.num_entries or command.chunk is not None:
                num_tokens = sum(1 for output in outputs if output.HasField("token"))
            if num_tokens:
                self.metrics.observe_sampled(instance, num_tokens, self.clock())
        self._reply(command, forward_text=result)

    def _chunk_answered(self, command: Command, result: common_pb2.ForwardTextResult) -> None:
        """A chunk of a long forward_text was answered: its outputs are kept; the last chunk answers the
        command with all of them (a last chunk is answered only when the command has outputs)."""
        chunk = cast(Chunk, command.chunk)
        prefill = chunk.prefill
        prefill.collect(chunk.index, result)
        if chunk.is_last:
            self._reply_forward_text(command, prefill.result())

    def _on_batch_error(self, executor: Executor, batch: InflightBatch, error: executor_pb2.BatchError) -> None:
        """The executor rejected a whole batch (it should not: we validate what it checks); a rejected
        batch changed nothing. The offender named by `item_index` is trapped with the executor's reason
        and the other items are sent again as a new batch, so bystanders finish normally. Two cases
        cannot be re-sent, and their instances are trapped EXECUTOR_LOST naming the batch rather than
        left with silently inconsistent state: an error that names no item, and an instance that already
        sent (or exported, imported) something after the batch, which may depend on the lost item."""
        self.metrics.num_batch_errors += 1
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
            self.metrics.num_batches_resent += 1
            self._send_batch(executor, kind, [item for _, item in again], [c for c, _ in again], is_resend=True)
        if KINDS[kind].frees_when_translated:  # the ids are free in the pools already: they must reach the executor
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

    # ---- scheduler-local commands (run at the head of their stream; exports.py, local.py) ----

    def _run_local(self, command: Command, outcome: LocalOutcome) -> None:
        """Do what a local command decided (outbound.py)."""
        for export in outcome.dropped_exports:
            self._drop_export(export)
        if outcome.priority is not None:
            self.batcher.set_priority(command.stream, outcome.priority)
        if outcome.forward_strategy is not None:
            self.batcher.forward_strategy = outcome.forward_strategy
            self._schedule_step()
        if outcome.waits_for_replies:
            self._synchronize(command)
        elif outcome.reply is not None:
            self._reply_local(command, **outcome.reply)
        else:
            self._done_local(command)

    def _synchronize(self, command: Command) -> None:
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

    def _reply_local(self, command: Command, **event: Any) -> None:
        stream = command.stream
        sink = stream.instance.sink
        if sink is not None:
            sink.send(l4m_pb2.SessionResponse(stream_id=stream.stream_id, request_id=command.request_id, **event))
        self.metrics.observe_reply(command.kind, self.clock() - command.arrived_at)
        self._done_local(command)

    def _done_local(self, command: Command) -> None:
        if command.span is not None:
            command.span.end()

    def _drop_export(self, export: Export) -> int:
        """Release an export's page references; returns the pages freed."""
        executor = self.executors[export.executor_index]
        if not executor.is_connected:
            return 0
        return len(self._release(executor, list(export.physical_page_ids), []))

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
        self.metrics.count_trap(l4m_pb2.TrapKind.Name(error.trap_kind))
        freed = self._end_instance(instance, trap.reason)
        if instance.sink is not None:
            instance.sink.send(l4m_pb2.SessionResponse(request_id=request_id, trap=trap))
            instance.sink.end(trap)
        if error.trap_kind != l4m_pb2.TRAP_KIND_DESTROYED and instance.companion_of is None:
            for watcher in list(self.watchers):
                watcher(instance.instance_id, trap)
        return freed

    def _end_instance(self, instance: Instance, reason: str = "session closed") -> tuple[int, int]:
        instance.state = InstanceState.ENDED
        for companion in list(instance.companions.values()):  # the controller's sessions on other models end too
            self.trap(companion, Destroyed(f"the controller's main session ended: {reason}"))
        main = instance.companion_of
        if main is not None:
            del main.companions[instance.model.name]
            self._forget(instance.instance_id)
        for stream in instance.streams.values():
            if self.tracer.enabled:
                for command in stream.pending:
                    self.tracer.end_with_error(command.span, reason)
                for _, command in stream.sync_waiters:
                    self.tracer.end_with_error(command.span, reason)
            self.batcher.drop_stream(stream)
            stream.sync_waiters.clear()
        self._last_dispatch.pop(instance, None)
        self.metrics.forget_instance(instance)
        executor: Executor | None = instance.executor
        swap_slots = self._unpark(instance, reason)
        if executor is None or not executor.is_connected:
            instance.table.clear()
            return 0, 0
        if swap_slots:  # only the scheduler tracks which swap slots hold something: nothing to send
            executor.pools().swap_slots.release(swap_slots)
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
        if self._parked and num_pages_freed:  # parked instances may resume now
            self._schedule_step()
        return num_pages_freed, num_slots_freed

    def _unpark(self, instance: Instance, reason: str) -> list[int]:
        """An ending instance leaves the parked set and the admission queue; returns its swap slots."""
        if instance.wait_started is not None:
            self._leave_queue(instance)
        if instance in self._parked:
            self._parked.discard(instance)
            self._num_park_changes += 1
            self._schedule_step()  # what it held may let others resume
        if self.tracer.enabled:
            for command in instance.held:
                self.tracer.end_with_error(command.span, reason)
        instance.held.clear()
        instance.is_suspended = instance.is_waiting = False
        return instance.table.clear_swapped()

    def _release(self, executor: Executor, pages: list[int], slots: list[int]) -> list[int]:
        """Drop one reference from each id; tell the executor to deallocate those nobody holds."""
        pools = executor.pools()
        freed: list[int] = []
        for ids, pool, kind in ((pages, pools.kv_pages, KV_PAGE), (slots, pools.embed_slots, EMBED_SLOT)):
            if not ids:
                continue
            now_free = pool.release(ids)
            freed.extend(now_free)
            if now_free:
                request = executor_pb2.ExecuteRequest(correlation_id=executor.next_correlation_id())
                request.deallocate.items.add(kind=kind, ids=now_free)
                executor.link.send(request)
        return freed

    # ---- executors ----

    def _on_executor_connected(self, executor: Executor, info: executor_pb2.ExecutorServiceGetInfoResponse) -> None:
        name = info.model.name
        if executor.info is not None and executor.info.model.name != name:
            log.error("executor %s came back serving %r instead of %r; ignored", executor.link.address, name,
                      executor.info.model.name)
            return
        model = self.models.get(name)
        if model is None:
            model = self.models[name] = ServedModel.from_info(info.model)
        elif model.info.vocab_size != info.model.vocab_size or model.info.num_layers != info.model.num_layers:
            log.error("executor %s serves a model named %r whose shape differs from its other executors'; ignored",
                      executor.link.address, name)
            return
        self.batcher.add_queues(executor.connect(info))
        self._update_limits(model)
        log.info("executor %d (%s) connected%s: model %r, %d pages", executor.index, executor.link.address,
                 f" over {transport}" if (transport := getattr(executor.link, "transport_in_use", "")) else "",
                 name, info.num_kv_pages)
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

    def _update_limits(self, served: ServedModel) -> None:
        """The limits of `served`'s pool: what every one of its connected executors allows."""
        infos = [e.info for e in self.executors if e.is_connected and e.info is not None
                 and e.info.model.name == served.name]
        model = served.info
        if not infos:
            return
        max_pages = min(i.num_kv_pages for i in infos)
        max_slots = min(i.num_embed_slots for i in infos)
        config = self.config
        max_batch_tokens = min(i.max_batch_tokens or (1 << 30) for i in infos)
        served.limits = ModelLimits(
            vocab_size=model.vocab_size,
            kv_page_size=infos[0].kv_page_size,
            max_context_tokens=model.max_context_tokens,
            max_batch_tokens=max_batch_tokens,
            prefill_chunk_tokens=chunk_budget(config.prefill_chunk_tokens, max_batch_tokens),
            prefill_chunk_token_slots=config.prefill_chunk_token_slots,
            max_kv_pages_per_instance=min(max_pages, config.max_kv_pages_per_instance or max_pages),
            max_embed_slots_per_instance=min(max_slots, config.max_embed_slots_per_instance or max_slots),
            capabilities=frozenset(model.capabilities),
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

    def get_info(self, omit_tokenizer_json: bool = False, model_name: str = "") -> l4m_pb2.GetInfoResponse:
        """About one model (`model_name`, "" = the default) and the names of all; raises UnknownModel."""
        served = self.served_model(model_name)
        limits = served.limits
        if limits is None:
            raise NoExecutor(f"no executor of model {served.name!r} is connected yet")
        executors = [e for e in self.executors if e.resources is not None and e.info is not None
                     and e.info.model.name == served.name]
        return l4m_pb2.GetInfoResponse(
            protocol_version=PROTOCOL_VERSION,
            model=served.info_without_tokenizer if omit_tokenizer_json else served.info,
            kv_page_size=limits.kv_page_size,
            max_kv_pages_per_instance=limits.max_kv_pages_per_instance,
            max_embed_slots_per_instance=limits.max_embed_slots_per_instance,
            num_free_kv_pages=sum(e.resources.kv_pages.num_free for e in executors),  # type: ignore[union-attr]
            num_executors=len(executors),
            max_continuation_steps=limits.max_continuation_steps,
            max_distribution_entries_per_command=limits.max_distribution_entries_per_command,
            max_tokens_per_command=limits.max_batch_tokens,
            max_batch_tokens=limits.max_batch_tokens,
            prefill_chunk_tokens=limits.prefill_chunk_tokens,
            max_tokens_per_forward_text=min(limits.max_context_tokens,
                                            limits.max_kv_pages_per_instance * limits.kv_page_size),
            max_command_bytes=bounds.MAX_COMMAND_BYTES,
            max_response_bytes=bounds.MAX_RESPONSE_BYTES,
            max_mask_runs_per_command=limits.max_mask_runs_per_command,
            model_names=self.model_names(),
        )

    def model_names(self) -> list[str]:
        """The served models in `--executor` order of the first executor of each: the default first."""
        names = dict.fromkeys(e.info.model.name for e in self.executors if e.info is not None)
        return list(names)


def _written_ranges(command: Command, page_size: int) -> list[tuple[int, int, int]]:
    """(physical page, first slot, end slot) of each page a translated forward item writes: its last
    `num written` token slots (the LENGTH RULE), continuation steps included."""
    item = command.item
    num_written = command.num_tokens  # forward_text: tokens and continuation steps; forward: inputs
    pages = item.kv_page_ids
    total = rules.context_slots(len(pages), item.kv_last_page_length, page_size)
    first = max(0, total - num_written)
    ranges = []
    for index in range(first // page_size, min(len(pages), -(-total // page_size))):
        start = max(first, index * page_size) - index * page_size
        end = min(total, (index + 1) * page_size) - index * page_size
        ranges.append((pages[index], start, end))
    return ranges


def _num_claimed(admitted: list[tuple[Instance, bool, int]], is_kv: bool) -> int:
    """Ids of one kind that the admitted allocates of a batch take (a trapped or parked instance's none)."""
    return sum(n for i, k, n in admitted if k is is_kv and i.is_alive and not i.is_parked)


def _num_movable(pool: Any, instance: Instance) -> int:
    """An instance's kv pages that preempting it frees: those nobody else holds and no export froze."""
    return sum(1 for p in instance.table.kv_pages.values() if pool.refcount(p) == 1 and not pool.is_frozen(p))


# Rounds of resuming parked instances in one step (each resume may free or take pages for the next).
_MAX_RETRIES_PER_STEP = 16

# Fire-and-forget batches not yet known to have run, per executor, before a barrier ping is sent.
_MAX_UNANSWERED = 64

__all__ = ["Scheduler", "PROTOCOL_VERSION"]
