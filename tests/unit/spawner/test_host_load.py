"""`host_load.wait_for_idle_core`: when the warm pool's refill may start, from /proc/stat's idle time."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from l4m.spawner.host_load import read_cpu_times, wait_for_idle_core


class FakeHost:
    """/proc/stat's (idle, total) ticks, advanced by each interval slept: `busy` lists the busy cores of
    each interval in turn (2 CPUs, 100 ticks per core per interval); a clock that sleeping moves."""

    def __init__(self, busy: list[float]) -> None:
        self.busy = busy
        self.idle = self.total = 0
        self.now = 0.0
        self.num_reads = 0

    def read(self) -> tuple[int, int]:
        self.num_reads += 1
        return self.idle, self.total

    async def sleep(self, seconds: float) -> None:
        busy = self.busy.pop(0) if len(self.busy) > 1 else self.busy[0]
        self.idle += int((2 - busy) * 100)
        self.total += 200
        self.now += seconds

    def wait(self, max_wait_s: float) -> float:
        return asyncio.run(wait_for_idle_core(max_wait_s, interval_s=0.5, num_cpus=2, read=self.read,
                                              sleep=self.sleep, clock=lambda: self.now))


def test_it_returns_after_the_first_interval_with_a_core_to_spare() -> None:
    host = FakeHost(busy=[2.0, 1.9, 1.0, 2.0])
    assert host.wait(30.0) == 1.5  # the third interval had one core idle


def test_a_host_that_stays_busy_is_waited_for_at_most_the_bound() -> None:
    host = FakeHost(busy=[1.5])  # a quarter of a core short of one idle core, for ever
    assert host.wait(3.0) == 3.0
    assert host.num_reads == 7  # the bound ends it: 6 intervals of 0.5 s


def test_no_bound_means_no_wait_and_no_reading() -> None:
    host = FakeHost(busy=[2.0])
    assert host.wait(0.0) == 0.0 and host.num_reads == 0


def test_the_real_proc_stat_is_read(tmp_path: Path) -> None:
    idle, total = read_cpu_times()
    assert 0 <= idle <= total and total > 0
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 1 5 80 4 0 0 0 0 0\ncpu0 10 1 5 80 4 0 0 0 0 0\n")
    assert read_cpu_times(stat) == (84, 100)
    stat.write_text("intr 1 2 3\n")
    with pytest.raises(ValueError, match="no aggregate cpu line"):
        read_cpu_times(stat)
