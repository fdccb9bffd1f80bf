"""Whether this host has a CPU core to spare, from `/proc/stat`: the warm pool's refill may wait for one.

A warm sandbox's start is ~150 ms of CPU (Python importing the SDK). The spawner runs those starts at idle
priority, yet on a host whose cores the executor keeps busy they still take every gap it leaves, and the
executor pays to take the core back: on the 2-core benchmark host, holding the refill until a burst of
launches had decoded made the whole stack 7-19 % faster at 64 streams (docs/benchmarks.md, round 5). So
a refill may first wait until the host's CPUs were, over one sampling interval, at least
`min_idle_cores` cores' worth idle, for at most `max_wait_s` (the bound: under load that never ends, the
pool still refills).

`/proc/stat` counts the whole host's CPUs (in a container too, whatever its CPU quota): where the spawner
shares a host with busy neighbours the wait runs to its bound more often; where the executor computes on a
GPU the host's cores are mostly idle and the wait ends after one interval.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

PROC_STAT = Path("/proc/stat")
SAMPLE_INTERVAL_S = 0.5
MIN_IDLE_CORES = 0.75  # one core's worth idle, less some noise


def read_cpu_times(path: Path = PROC_STAT) -> tuple[int, int]:
    """(idle, total) clock ticks of all CPUs since boot; idle counts iowait too."""
    with open(path) as f:
        fields = f.readline().split()
    if not fields or fields[0] != "cpu" or len(fields) < 5:
        raise ValueError(f"{path}: no aggregate cpu line")
    ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal (guest is in user)
    return ticks[3] + ticks[4], sum(ticks)


async def wait_for_idle_core(
    max_wait_s: float,
    *,
    interval_s: float = SAMPLE_INTERVAL_S,
    min_idle_cores: float = MIN_IDLE_CORES,
    num_cpus: int | None = None,
    read: Callable[[], tuple[int, int]] = read_cpu_times,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> float:
    """Returns once one interval found `min_idle_cores` cores' worth of the host's CPU time idle, or once
    `max_wait_s` have passed (at once when it is 0 or less); returns the seconds it waited."""
    if max_wait_s <= 0:
        return 0.0
    cpus = num_cpus or os.cpu_count() or 1
    start = clock()
    before = read()
    while True:
        await sleep(interval_s)
        after = read()
        idle, total = after[0] - before[0], after[1] - before[1]
        waited = clock() - start
        if (total > 0 and idle / total * cpus >= min_idle_cores) or waited >= max_wait_s:
            return waited
        before = after
