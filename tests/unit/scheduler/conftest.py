"""Harness for scheduler unit tests: the core with in-process simulated executors, no sockets.

`async def` tests run on one event loop made when this file is imported (an asyncio loop opens a
socketpair for its self-pipe, which the unit-test socket guard forbids inside a test)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable

import pytest

from l4m.scheduler.config import SchedulerConfig
from l4m.scheduler.core import Scheduler
from l4m.scheduler.instances import Instance
from l4m.scheduler.simulated import SimulatedExecutor, SimulatedExecutorConfig, SimulatedLink
from l4m.scheduler.tracing import SchedulerTracer
from l4m.v1 import l4m_pb2

_LOOP = asyncio.new_event_loop()


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if inspect.iscoroutinefunction(pyfuncitem.obj):
        arguments = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
        _LOOP.run_until_complete(asyncio.wait_for(pyfuncitem.obj(**arguments), timeout=30))
        return True
    return None


class ListSink:
    """Collects an instance's events."""

    def __init__(self) -> None:
        self.events: list[l4m_pb2.SessionResponse] = []
        self.ended = False
        self.trap: l4m_pb2.Trap | None = None

    def send(self, response: l4m_pb2.SessionResponse) -> None:
        self.events.append(response)

    def end(self, trap: l4m_pb2.Trap | None) -> None:
        self.ended = True
        self.trap = trap

    def of(self, event: str) -> list[l4m_pb2.SessionResponse]:
        return [e for e in self.events if e.WhichOneof("event") == event]


# The adaptive strategy without its launch hold: these tests register their instances up front and then
# send from one at a time, and `settle` does not wait out timers. The launch hold has tests of its own
# (test_scheduler_batcher.py with a fake clock, test_scheduler_core.py with the default strategy).
TEST_BATCHING = "adaptive:250:0"


class Harness:
    """A started `Scheduler` over `num_executors` simulated executors."""

    def __init__(self, batching: str = TEST_BATCHING, num_executors: int = 1, tracer: SchedulerTracer | None = None,
                 config: dict[str, object] | None = None, clock: Callable[[], float] = time.monotonic,
                 executor_configs: list[dict[str, object]] | None = None, **sim: object) -> None:
        """`executor_configs`: per executor, overrides of the simulated config (a model name, a vocabulary)."""
        per_executor = executor_configs or [{}] * num_executors
        self.links = [
            SimulatedLink(SimulatedExecutor(SimulatedExecutorConfig(  # type: ignore[arg-type]
                **{"num_kv_pages": 64, "num_embed_slots": 64, **sim, **own})), address=f"sim{i}")
            for i, own in enumerate(per_executor)
        ]
        scheduler_config = SchedulerConfig(batching=batching, **(config or {}))  # type: ignore[arg-type]
        self.scheduler = Scheduler(scheduler_config, self.links, tracer=tracer, clock=clock)  # type: ignore[arg-type]
        self.scheduler.start()
        self.sinks: dict[str, ListSink] = {}
        self._launch_ms = 1000

    def open(self, name: str | None = None, launched_at_unix_ms: int | None = None, max_tokens: int = 0, *,
             user: str = "tester", is_admin: bool = False, parent: str = "",
             tokens_per_minute: int = 0, model: str = "") -> tuple[Instance, ListSink]:
        """Registers and opens an instance; every instance of one harness is the same user unless told."""
        name = name or f"i{len(self.sinks)}"
        self._launch_ms += 1
        instance = self.scheduler.register_instance(
            name, f"token-of-{name}-0123456789", max_tokens, launched_at_unix_ms or self._launch_ms,
            user=user, is_admin=is_admin, parent_instance_id=parent, user_max_tokens_per_minute=tokens_per_minute,
        )
        sink = ListSink()
        self.scheduler.open_session(instance, sink, model=self.scheduler.served_model(model))
        self.sinks[name] = sink
        return instance, sink

    def send(self, instance: Instance, *requests: l4m_pb2.SessionRequest) -> None:
        for request in requests:
            self.scheduler.submit(instance, request)

    async def settle(self) -> None:
        for _ in range(30):
            await asyncio.sleep(0)

    def free_pages(self, executor: int = 0) -> int:
        return self.scheduler.executors[executor].resources.kv_pages.num_free  # type: ignore[union-attr]

    def free_slots(self, executor: int = 0) -> int:
        return self.scheduler.executors[executor].resources.embed_slots.num_free  # type: ignore[union-attr]

    def sim(self, executor: int = 0) -> SimulatedExecutor:
        return self.links[executor].executor


@pytest.fixture
def harness_factory():  # type: ignore[no-untyped-def]
    return Harness
