"""The warm pool's bookkeeping, behind a fake sandbox: fill, hand out once, refill, retry, close."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import pytest

from l4m.spawner.warm_pool import WarmPool

T = TypeVar("T")
WAIT_S = 10.0  # a safety net for awaits that must finish; no assertion depends on it


@dataclass
class FakeSandbox:
    number: int
    is_alive: bool = True


@dataclass
class FakeBackend:
    """Starts numbered fake sandboxes; can fail the next starts, or hold them until released."""

    num_failures_left: int = 0
    hold: asyncio.Event | None = None
    started: list[FakeSandbox] = field(default_factory=list)
    destroyed: list[int] = field(default_factory=list)
    cancelled_starts: int = 0
    num_cleanups_begun: int = 0
    num_in_flight: int = 0
    max_in_flight: int = 0
    _numbers: itertools.count[int] = field(default_factory=itertools.count)

    async def start(self) -> FakeSandbox:
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        try:
            await asyncio.sleep(0)
            if self.hold is not None:
                await self.hold.wait()
            if self.num_failures_left:
                self.num_failures_left -= 1
                raise RuntimeError("bwrap: setting up the sandbox failed")
            sandbox = FakeSandbox(next(self._numbers))
            self.started.append(sandbox)
            return sandbox
        except asyncio.CancelledError:
            # Cleaning up takes a while (killing, reaping...), longer for each start cancelled.
            self.num_cleanups_begun += 1
            for _ in range(20 * self.num_cleanups_begun):
                await asyncio.sleep(0)
            self.cancelled_starts += 1
            raise
        finally:
            self.num_in_flight -= 1

    async def destroy(self, sandbox: FakeSandbox) -> None:
        self.destroyed.append(sandbox.number)


def make_pool(backend: FakeBackend, size: int = 2, **kwargs: float) -> WarmPool[FakeSandbox]:
    return WarmPool(size, backend.start, backend.destroy, lambda sandbox: sandbox.is_alive, **kwargs)


def run(test: Callable[[], Awaitable[T]]) -> T:
    async def bounded() -> T:
        async with asyncio.timeout(WAIT_S):
            return await test()

    return asyncio.run(bounded())


async def until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.001)


def test_fills_hands_each_sandbox_out_once_and_refills() -> None:
    async def go() -> None:
        backend = FakeBackend()
        pool = make_pool(backend)
        pool.open()
        await pool.wait_full()
        assert pool.stats().num_ready == 2
        first, second = pool.take(), pool.take()
        assert first is not None and second is not None and first is not second
        await pool.wait_full()
        refilled = [pool.take(), pool.take()]
        assert {s.number for s in refilled if s is not None} == {2, 3}  # new ones, never 0 or 1 again
        stats = pool.stats()
        assert (stats.num_taken, stats.num_started) == (4, 4)
        await pool.close()

    run(go)


def test_an_empty_pool_answers_none_and_refills() -> None:
    async def go() -> None:
        backend = FakeBackend(hold=asyncio.Event())
        pool = make_pool(backend, size=1)
        pool.open()
        await until(lambda: pool.stats().num_starting == 1)
        assert pool.take() is None  # the launch starts cold
        backend.hold.set()
        await pool.wait_full()
        assert pool.take() is not None
        await pool.close()

    run(go)


def test_more_launches_than_the_pool_holds() -> None:
    async def go() -> None:
        backend = FakeBackend()
        pool = make_pool(backend, size=3)
        pool.open()
        await pool.wait_full()
        taken = [pool.take() for _ in range(5)]
        assert sum(s is not None for s in taken) == 3
        assert taken[3:] == [None, None]
        await pool.close()

    run(go)


def test_no_start_begins_until_every_hand_over_has_ended() -> None:
    async def go() -> None:
        backend = FakeBackend()
        pool = make_pool(backend, size=2)
        pool.open()
        await pool.wait_full()
        with pool.taking() as first:
            assert first is not None
            with pool.taking() as second:
                assert second is not None and second is not first
            for _ in range(50):  # the refill task runs many times meanwhile
                await asyncio.sleep(0)
            assert len(backend.started) == 2  # the first hand-over still holds the refill back
            assert pool.stats().num_starting == 0
        await pool.wait_full()
        assert len(backend.started) == 4
        await pool.close()

    run(go)


def test_a_failed_hand_over_lets_the_refill_go_on() -> None:
    async def go() -> None:
        backend = FakeBackend()
        pool = make_pool(backend, size=1)
        pool.open()
        await pool.wait_full()
        with pytest.raises(RuntimeError, match="hand-over failed"), pool.taking() as taken:
            assert taken is not None
            raise RuntimeError("hand-over failed")
        await pool.wait_full()
        assert len(backend.started) == 2
        await pool.close()

    run(go)


def test_taking_from_an_empty_pool_holds_nothing_back() -> None:
    async def go() -> None:
        backend = FakeBackend(hold=asyncio.Event())
        pool = make_pool(backend, size=2, max_concurrent_starts=1)
        pool.open()
        await until(lambda: backend.num_in_flight == 1)
        with pool.taking() as taken:
            assert taken is None  # the launch starts cold, and the pool goes on filling meanwhile
            backend.hold.set()
            await pool.wait_full()
            assert len(backend.started) == 2
        await pool.close()

    run(go)


def test_close_cancels_a_refill_held_back_by_a_hand_over() -> None:
    async def go() -> None:
        backend = FakeBackend()
        pool = make_pool(backend, size=2)
        pool.open()
        await pool.wait_full()
        with pool.taking() as taken:
            assert taken is not None
            await asyncio.sleep(0.01)
            await pool.close()  # returns although the hand-over has not ended
        assert len(backend.started) == 2
        assert pool.stats().num_ready == 0

    run(go)


def test_dead_sandboxes_are_skipped_destroyed_and_replaced() -> None:
    async def go() -> None:
        backend = FakeBackend()
        pool = make_pool(backend, size=2)
        pool.open()
        await pool.wait_full()
        backend.started[0].is_alive = False
        taken = pool.take()
        assert taken is backend.started[1]
        await until(lambda: 0 in backend.destroyed)
        assert pool.stats().num_found_dead == 1
        await pool.wait_full()
        assert pool.stats().num_started == 4
        await pool.close()

    run(go)


def test_the_sweep_finds_sandboxes_that_died_while_waiting() -> None:
    async def go() -> None:
        backend = FakeBackend()
        pool = make_pool(backend, size=2, sweep_interval_s=0.01)
        pool.open()
        await pool.wait_full()
        backend.started[1].is_alive = False
        await until(lambda: pool.stats().num_started == 3 and pool.stats().num_ready == 2)
        assert backend.destroyed == [1]
        assert all(s.is_alive for s in (pool.take(), pool.take()) if s is not None)
        await pool.close()

    run(go)


def test_failed_starts_are_retried_after_a_growing_delay() -> None:
    async def go() -> None:
        backend = FakeBackend(num_failures_left=3)
        pool = make_pool(backend, size=1, retry_delay_s=0.001, max_retry_delay_s=0.004)
        pool.open()
        await pool.wait_full()
        stats = pool.stats()
        assert (stats.num_start_failures, stats.num_started, stats.num_ready) == (3, 1, 1)
        await pool.close()

    run(go)


def test_at_most_max_concurrent_starts_run_at_once() -> None:
    async def go() -> None:
        backend = FakeBackend(hold=asyncio.Event())
        pool = WarmPool(5, backend.start, backend.destroy, lambda s: s.is_alive, max_concurrent_starts=2)
        pool.open()
        await until(lambda: backend.num_in_flight == 2)
        backend.hold.set()
        await pool.wait_full()
        assert backend.max_in_flight == 2
        await pool.close()

    run(go)


def test_close_destroys_the_waiting_sandboxes_and_cancels_starts() -> None:
    async def go() -> None:
        backend = FakeBackend()
        pool = make_pool(backend, size=2)
        pool.open()
        await pool.wait_full()
        handed_out = pool.take()
        assert handed_out is not None
        backend.hold = asyncio.Event()  # the refill now hangs in start
        await until(lambda: backend.num_in_flight == 1)
        await pool.close()
        assert sorted(backend.destroyed) == [s.number for s in backend.started if s is not handed_out]
        assert handed_out.number not in backend.destroyed  # a launch's sandbox is the launch's to end
        assert backend.cancelled_starts == 1
        assert pool.stats().num_ready == 0
        await pool.close()  # idempotent
        with pytest.raises(RuntimeError, match="closed"):
            pool.open()

    run(go)


def test_close_waits_for_every_start_in_flight_to_clean_up() -> None:
    async def go() -> None:
        backend = FakeBackend(hold=asyncio.Event())
        pool = make_pool(backend, size=3, max_concurrent_starts=3)
        pool.open()
        await until(lambda: backend.num_in_flight == 3)
        await pool.close()
        assert backend.cancelled_starts == 3  # none abandoned half-way when close returned

    run(go)


def test_size_zero_never_starts_anything() -> None:
    async def go() -> None:
        backend = FakeBackend()
        pool = make_pool(backend, size=0)
        pool.open()
        await asyncio.sleep(0.01)
        assert pool.take() is None
        assert backend.started == []
        await pool.close()

    run(go)


def test_a_negative_size_is_refused() -> None:
    with pytest.raises(ValueError, match="0 or more"):
        make_pool(FakeBackend(), size=-1)


@dataclass
class FakeHost:
    """A quiet gate the test opens: each round of the refill waits on it, and reports 0.25 s waited."""

    quiet: asyncio.Event = field(default_factory=asyncio.Event)
    num_waits: int = 0

    async def wait(self) -> float:
        self.num_waits += 1
        await self.quiet.wait()
        return 0.25


def test_a_refill_waits_for_a_quiet_host_and_counts_the_wait() -> None:
    async def go() -> None:
        backend, host = FakeBackend(), FakeHost()
        pool = WarmPool(2, backend.start, backend.destroy, lambda s: s.is_alive, wait_quiet=host.wait)
        pool.open()
        for _ in range(50):
            await asyncio.sleep(0)
        assert host.num_waits == 1 and backend.started == []  # nothing starts while the host is busy
        host.quiet.set()
        await pool.wait_full()
        assert pool.stats().quiet_wait_s == 0.25  # one round of 2 starts (max_concurrent_starts)
        host.quiet.clear()
        assert pool.take() is not None
        for _ in range(50):
            await asyncio.sleep(0)
        assert len(backend.started) == 2 and host.num_waits == 2  # the refill waits again
        assert pool.take() is not None and pool.take() is None  # launches go on meanwhile (cold once empty)
        host.quiet.set()
        await pool.wait_full()
        assert len(backend.started) == 4 and pool.stats().quiet_wait_s == 0.5
        await pool.close()

    run(go)


def test_close_cancels_a_refill_waiting_for_a_quiet_host() -> None:
    async def go() -> None:
        backend, host = FakeBackend(), FakeHost()
        pool = WarmPool(1, backend.start, backend.destroy, lambda s: s.is_alive, wait_quiet=host.wait)
        pool.open()
        await until(lambda: host.num_waits == 1)
        await pool.close()
        assert backend.started == [] and pool.stats().num_starting == 0

    run(go)
