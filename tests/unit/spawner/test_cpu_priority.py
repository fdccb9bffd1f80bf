"""Promoting a warm sandbox's threads, finding its processes, and the clock that tells a start waiting
for an idle CPU from a stuck one."""

from __future__ import annotations

import itertools
import os
import subprocess
import time

import pytest

from l4m.spawner import cpu_priority
from l4m.spawner.cpu_priority import StartClock, sandbox_tree, set_launch_priority
from l4m.spawner.sandbox import SandboxError


def test_a_start_that_waits_for_a_cpu_does_not_advance_the_clock() -> None:
    clock = StartClock(now_s=100.0)
    # One task runnable all along, waiting 9.9 of every 10 s (it is idle and the machine is busy).
    for step in range(1, 31):
        progress = clock.advance(100.0 + 10 * step, {7: int(9.9e9 * step)})
    assert progress == pytest.approx(3.0)


def test_a_start_that_sleeps_advances_the_clock_at_wall_speed() -> None:
    clock = StartClock(now_s=0.0)
    assert clock.advance(5.0, {7: 1_000}) == pytest.approx(5.0, abs=1e-3)
    assert clock.advance(12.0, {7: 1_000}) == pytest.approx(12.0, abs=1e-3)


def test_a_task_first_seen_counts_all_its_delay_and_one_that_ended_counts_none() -> None:
    clock = StartClock(now_s=0.0)
    assert clock.advance(2.0, {7: int(1.5e9)}) == pytest.approx(0.5)
    # Task 8 appeared (1 s waiting), task 7 is gone: 2 s of wall time, 1 s of it waiting.
    assert clock.advance(4.0, {8: int(1e9)}) == pytest.approx(1.5)
    # Two tasks waiting at once can count more than the wall time: never below zero.
    assert clock.advance(5.0, {8: int(2e9), 9: int(3e9)}) == pytest.approx(1.5)


def test_the_tree_of_this_process_holds_it() -> None:
    tree = sandbox_tree(os.getpid())
    assert os.getpid() in tree
    assert os.getppid() not in tree
    assert cpu_priority.parent_pids()[os.getpid()] == os.getppid()


def test_the_tree_follows_every_generation(monkeypatch: pytest.MonkeyPatch) -> None:
    # bwrap (10) -> its init (11) -> the zygote (12) and a child of it (13); 20 is someone else's.
    parents = {10: 1, 11: 10, 12: 11, 13: 12, 20: 1}
    monkeypatch.setattr(cpu_priority, "parent_pids", lambda: parents)
    monkeypatch.setattr(cpu_priority, "has_children_files", lambda pid: False)  # the scan, on any kernel
    assert sandbox_tree(10) == {10, 11, 12, 13}
    assert sandbox_tree(12) == {12, 13}


def test_the_walk_of_the_children_files_finds_what_the_scan_finds() -> None:
    if not cpu_priority.has_children_files(os.getpid()):
        pytest.skip("this kernel has no /proc children files (CONFIG_PROC_CHILDREN): sandbox_tree scans")
    # A child, and a grandchild that outlives its parent's wait: both in the tree.
    child = subprocess.Popen(["/bin/sh", "-c", "sleep 30 & wait"])
    try:
        deadline = time.monotonic() + 10.0
        while len(cpu_priority.tree_from_parents(child.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        walked, scanned = sandbox_tree(child.pid), cpu_priority.tree_from_parents(child.pid)
        assert walked == scanned and len(walked) == 2 and child.pid in walked
        assert os.getpid() in sandbox_tree(os.getpid()) and child.pid in sandbox_tree(os.getpid())
    finally:
        for pid in cpu_priority.descendants(child.pid):
            os.kill(pid, 9)
        child.kill()
        child.wait()


def test_the_tree_of_a_process_that_ended_is_empty() -> None:
    assert sandbox_tree(2**22 + 1) == set()  # above pid_max's ceiling: no such process


class FakeScheduler:
    def __init__(self, monkeypatch: pytest.MonkeyPatch, threads: dict[int, list[set[int]]]) -> None:
        """`threads`: pid -> the thread ids each successive listing finds."""
        self.policies: list[tuple[int, int, int]] = []  # (tid, policy, static priority)
        self.nices: list[tuple[int, int]] = []  # (tid, nice)
        listings = {
            pid: itertools.chain(rounds, itertools.repeat(rounds[-1])) for pid, rounds in threads.items()
        }
        monkeypatch.setattr(cpu_priority, "thread_ids", lambda pid: next(listings[pid]))
        monkeypatch.setattr(os, "sched_setscheduler", self.set_policy)
        monkeypatch.setattr(os, "setpriority", self.set_nice)

    def set_policy(self, tid: int, policy: int, param: os.sched_param) -> None:
        if tid == 404:
            raise ProcessLookupError(tid)
        self.policies.append((tid, policy, param.sched_priority))

    def set_nice(self, which: int, tid: int, nice: int) -> None:
        assert which == os.PRIO_PROCESS  # on Linux: that one thread
        self.nices.append((tid, nice))


@pytest.mark.parametrize("policy", [os.SCHED_BATCH, os.SCHED_OTHER])
def test_every_thread_is_set_once_including_one_started_meanwhile(
    monkeypatch: pytest.MonkeyPatch, policy: int
) -> None:
    # Thread 6 appears in the second listing; 404 exits before its turn.
    fake = FakeScheduler(monkeypatch, {5: [{5}, {5, 6}], 9: [{9, 404}]})
    assert set_launch_priority(lambda: {5, 9}, policy, nice=3) == {5, 9}
    assert sorted(fake.policies) == [(tid, policy, 0) for tid in (5, 6, 9)]
    assert sorted(fake.nices) == [(5, 3), (6, 3), (9, 3)]


def test_a_sandbox_that_keeps_starting_threads_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    new_threads = itertools.count(100)
    monkeypatch.setattr(cpu_priority, "thread_ids", lambda pid: {next(new_threads)})
    monkeypatch.setattr(os, "sched_setscheduler", lambda *args: None)
    monkeypatch.setattr(os, "setpriority", lambda *args: None)
    with pytest.raises(SandboxError, match="kept starting threads"):
        set_launch_priority(lambda: {5}, os.SCHED_BATCH, nice=0)


def test_a_refused_change_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_priority, "thread_ids", lambda pid: {pid})

    def refuse(*args: object) -> None:
        raise PermissionError("not root")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    with pytest.raises(PermissionError):
        set_launch_priority(lambda: {5}, os.SCHED_BATCH, nice=0)
