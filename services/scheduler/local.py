"""Scheduler-local commands that are not about exports: get_info, synchronize, set_stream_priority,
debug_query. Each runs at the head of its stream and returns a `LocalOutcome` for the core to act on.

`SchedulerView` is what these handlers (and the export handlers, `exports.py`) may read of the core.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Protocol

from l4m.scheduler.batcher import parse_strategy
from l4m.scheduler.errors import PermissionDenied
from l4m.scheduler.outbound import LocalOutcome
from l4m.v1 import l4m_pb2

if TYPE_CHECKING:
    from l4m.scheduler.batcher import Batcher, Command
    from l4m.scheduler.config import SchedulerConfig
    from l4m.scheduler.executors import Executor
    from l4m.scheduler.exports import ExportTable
    from l4m.scheduler.instances import Instance, InstanceRegistry
    from l4m.scheduler.metrics import SchedulerMetrics


class SchedulerView(Protocol):
    """The parts of the core that local commands read (the `Scheduler` is one)."""

    config: SchedulerConfig
    executors: list[Executor]
    exports: ExportTable
    instances: InstanceRegistry
    batcher: Batcher
    metrics: SchedulerMetrics

    def get_info(self, omit_tokenizer_json: bool = False, model_name: str = "") -> l4m_pb2.GetInfoResponse: ...


def run_get_info(view: SchedulerView, command: Command, item: l4m_pb2.GetInfoCommand) -> LocalOutcome:
    """About the model the session serves."""
    model = command.stream.instance.model
    return LocalOutcome(reply={"info": view.get_info(item.omit_tokenizer_json, model.name if model else "")})


def run_synchronize(view: SchedulerView, command: Command, item: l4m_pb2.SynchronizeCommand) -> LocalOutcome:
    return LocalOutcome(waits_for_replies=True)


def run_set_stream_priority(view: SchedulerView, command: Command,
                            item: l4m_pb2.SetStreamPriorityCommand) -> LocalOutcome:
    return LocalOutcome(priority=item.priority)


def permit_debug_query(instance: Instance, item: l4m_pb2.DebugQueryCommand) -> None:
    """"batching:<strategy>" is a cluster-wide knob: admin instances only."""
    if item.query.startswith("batching:") and not instance.is_admin:
        raise PermissionDenied(f"{item.query!r} changes batching for every instance: it needs an admin instance")


def run_debug_query(view: SchedulerView, command: Command, item: l4m_pb2.DebugQueryCommand) -> LocalOutcome:
    query = item.query
    strategy = None
    if query == "ping":
        answer = "pong"
    elif query == "stats":
        answer = json.dumps(stats(view), sort_keys=True)
    elif query == "batching":
        answer = view.batcher.forward_strategy.name
    else:  # "batching:<strategy>" (validation let nothing else through; `permit_debug_query` ran)
        strategy = parse_strategy(query.removeprefix("batching:"))
        answer = strategy.name
    return LocalOutcome(reply={"debug_query": l4m_pb2.DebugQueryResult(response=answer)}, forward_strategy=strategy)


def stats(view: SchedulerView) -> dict[str, Any]:
    """The debug_query "stats" answer: the metrics' counters and the scheduler's state now."""
    return {
        **view.metrics.counts(),
        "batching": view.batcher.forward_strategy.name,
        "queued": view.batcher.num_queued,
        "instances_active": view.instances.num_active(),
        "instances_registered": len(view.instances),
        "exports": len(view.exports),
        "executors": [
            {
                "address": e.link.address,
                "connected": e.is_connected,
                # "framed" or "grpc" (a link to a process), "" for an in-process one
                "transport": getattr(e.link, "transport_in_use", ""),
                "kv_pages_free": e.resources.kv_pages.num_free if e.resources else 0,
                "kv_pages_total": e.resources.kv_pages.capacity if e.resources else 0,
                "embed_slots_free": e.resources.embed_slots.num_free if e.resources else 0,
                "embed_slots_total": e.resources.embed_slots.capacity if e.resources else 0,
                "batches_in_flight": len(e.inflight),
            }
            for e in view.executors
        ],
    }

