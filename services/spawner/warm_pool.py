"""A warm pool: sandboxes started ahead of demand, each handed to exactly one launch.

The pool keeps the books only; what a warm sandbox is, how it starts, whether it is still alive and
how it is destroyed belong to the backend, which passes three callables (`ProcessSandbox` does).
Invariants:
- `take` removes what it returns: an item is handed out at most once and never comes back;
- one background task refills the pool until `size` items are ready, starting at most
  `max_concurrent_starts` at once (starts are CPU-bound: more than the cores only slows each);
- no start begins while an item taken with `taking` is being handed over: a burst of launches is
  served first, and the refill that follows does not compete with it (for the spawner's own CPU, and
  for the kernel's cgroup lock that both a hand-over and a start take). Hand-overs are bounded in
  time, and once the pool is empty launches start cold and hold nothing, so the refill always comes;
- a start that fails is retried after a delay that doubles up to `max_retry_delay_s`, so a broken
  set-up costs a log line now and then, not a loop of failing starts. A slow start is not a failure:
  the pool sets no deadline, and the backend's own (see process_sandbox.py) does not count time a
  start spent waiting for a CPU, since its starts run at idle priority and a busy machine may keep
  them waiting for as long as it stays busy;
- with `wait_quiet` (the spawner's `--warm-pool-quiet-wait-s`), each round of starts first awaits it:
  `host_load.wait_for_idle_core`, which returns once the host has a core to spare or its bound passed,
  so a refill does not take CPU from the executor while it decodes (the time waited is counted);
- an item that died while waiting is destroyed (found when taken, or by a sweep every
  `sweep_interval_s`) and replaced;
- `close` stops the refilling (cancelling a start in flight, which must clean up after itself) and
  destroys every item not handed out.
Everything runs on the event loop that called `open`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class WarmPoolStats:
    size: int
    num_ready: int
    num_starting: int
    num_taken: int  # handed to launches
    num_started: int  # became ready, ever
    num_start_failures: int
    num_found_dead: int  # died while waiting in the pool
    quiet_wait_s: float = 0.0  # seconds refills spent waiting for the host to have a core to spare


class WarmPool(Generic[T]):
    def __init__(
        self,
        size: int,
        start_one: Callable[[], Awaitable[T]],
        destroy_one: Callable[[T], Awaitable[None]],
        is_alive: Callable[[T], bool],
        *,
        max_concurrent_starts: int = 2,
        retry_delay_s: float = 0.5,
        max_retry_delay_s: float = 30.0,
        sweep_interval_s: float = 5.0,
        wait_quiet: Callable[[], Awaitable[float]] | None = None,
    ) -> None:
        if size < 0:
            raise ValueError(f"a warm pool's size must be 0 or more, not {size}")
        self.size = size
        self._start_one = start_one
        self._destroy_one = destroy_one
        self._is_alive = is_alive
        self._max_concurrent_starts = max(1, max_concurrent_starts)
        self._retry_delay_s = retry_delay_s
        self._max_retry_delay_s = max_retry_delay_s
        self._sweep_interval_s = sweep_interval_s
        self._wait_quiet = wait_quiet  # awaited before each round of starts; returns the seconds waited
        self._quiet_wait_s = 0.0
        self._ready: collections.deque[T] = collections.deque()
        self._wanted = asyncio.Event()  # set when the pool may be short of `size`
        self._grew = asyncio.Event()  # set when an item became ready
        self._num_handing_over = 0  # items taken with `taking` whose hand-over has not ended
        self._no_hand_over = asyncio.Event()  # set while _num_handing_over is 0
        self._no_hand_over.set()
        self._refill_task: asyncio.Task[None] | None = None
        self._destroying: set[asyncio.Task[None]] = set()
        self._is_closed = False
        self._num_starting = 0
        self._num_taken = 0
        self._num_started = 0
        self._num_start_failures = 0
        self._num_found_dead = 0

    def stats(self) -> WarmPoolStats:
        return WarmPoolStats(
            self.size,
            len(self._ready),
            self._num_starting,
            self._num_taken,
            self._num_started,
            self._num_start_failures,
            self._num_found_dead,
            self._quiet_wait_s,
        )

    def open(self) -> None:
        """Starts filling the pool in the background, on the running loop; idempotent."""
        if self._is_closed:
            raise RuntimeError("the warm pool is closed")
        if self._refill_task is None and self.size > 0:
            self._refill_task = asyncio.create_task(self._refill(), name="warm-pool-refill")

    def take(self) -> T | None:
        """A ready item, now the caller's alone, or None when none is ready (start one cold)."""
        item = None
        while self._ready and item is None:
            candidate = self._ready.popleft()
            if self._is_alive(candidate):
                item = candidate
                self._num_taken += 1
            else:
                self._discard_dead(candidate)
        self._wanted.set()
        return item

    @contextlib.contextmanager
    def taking(self) -> Iterator[T | None]:
        """`take`, holding refills back until the block ends: the caller hands the item over inside
        it. Yields None when none is ready (nothing is held back then)."""
        item = self.take()
        if item is None:
            yield None
            return
        self._num_handing_over += 1
        self._no_hand_over.clear()
        try:
            yield item
        finally:
            self._num_handing_over -= 1
            if not self._num_handing_over:
                self._no_hand_over.set()

    async def wait_full(self) -> None:
        """Returns once `size` items are ready (bound it with a timeout: a broken set-up never fills)."""
        while len(self._ready) < self.size:
            self._grew.clear()
            await self._grew.wait()

    async def close(self) -> None:
        """Stops refilling and destroys every item not handed out. Idempotent."""
        self._is_closed = True
        if self._refill_task is not None:
            self._refill_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refill_task
            self._refill_task = None
        items = list(self._ready)
        self._ready.clear()
        await asyncio.gather(*(self._destroy(item) for item in items), *self._destroying)

    # -- internals -------------------------------------------------------------------------------

    async def _refill(self) -> None:
        delay_s = self._retry_delay_s
        while not self._is_closed:
            self._sweep()
            num_missing = self.size - len(self._ready)
            if num_missing <= 0:
                self._wanted.clear()
                await self._wait_wanted()
                continue
            if self._num_handing_over:
                await self._no_hand_over.wait()
                continue
            if self._wait_quiet is not None:
                self._quiet_wait_s += await self._wait_quiet()
                if self._num_handing_over:  # a burst began meanwhile: serve it first
                    continue
                num_missing = self.size - len(self._ready)  # launches may have taken more meanwhile
            num_starts = min(num_missing, self._max_concurrent_starts)
            # return_exceptions: when cancelled, gather still waits for every start to clean up.
            starts = (self._start_into_pool() for _ in range(num_starts))
            results = await asyncio.gather(*starts, return_exceptions=True)
            errors = [result for result in results if isinstance(result, Exception)]
            if not errors:
                delay_s = self._retry_delay_s
                continue
            self._num_start_failures += len(errors)
            log.warning("could not start a warm sandbox (next try in %.1f s): %s", delay_s, errors[0])
            await asyncio.sleep(delay_s)
            delay_s = min(2 * delay_s, self._max_retry_delay_s)

    async def _wait_wanted(self) -> None:
        # Not asyncio.wait_for: on 3.11 it swallows a cancel that arrives as the event is set.
        waiter = asyncio.ensure_future(self._wanted.wait())
        try:
            await asyncio.wait((waiter,), timeout=self._sweep_interval_s)
        finally:
            waiter.cancel()

    async def _start_into_pool(self) -> Exception | None:
        # The item joins the pool as soon as it is ready, so a `close` that cancels the other starts
        # still finds it (and destroys it).
        self._num_starting += 1
        try:
            item = await self._start_one()
        except Exception as exc:  # noqa: BLE001 - counted and retried; launches start cold meanwhile
            return exc
        finally:
            self._num_starting -= 1
        self._ready.append(item)
        self._num_started += 1
        self._grew.set()
        return None

    def _sweep(self) -> None:
        for item in [item for item in self._ready if not self._is_alive(item)]:
            self._ready.remove(item)
            self._discard_dead(item)

    def _discard_dead(self, item: T) -> None:
        self._num_found_dead += 1
        task = asyncio.ensure_future(self._destroy(item))
        self._destroying.add(task)
        task.add_done_callback(self._destroying.discard)

    async def _destroy(self, item: T) -> None:
        try:
            await self._destroy_one(item)
        except Exception as exc:  # noqa: BLE001 - one stuck item must not stop the others' clean-up
            log.warning("could not destroy a warm sandbox: %s", exc)
