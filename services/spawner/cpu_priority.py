"""CPU priority of warm sandboxes: idle while they wait in the pool, the launch's policy from then on.

A warm sandbox's start (bubblewrap, then Python importing the SDK) is work done ahead of demand, so it
runs under SCHED_IDLE (and in the idle cpu cgroup, see cgroups.py): on a busy machine it waits for CPU
nobody else wants instead of taking it from the executor serving the launches that emptied the pool.
Everything here reads or writes /proc as root and is used by the process backend only:

- `sandbox_tree` finds a sandbox's processes from its first pid when no cgroup lists them;
- `set_launch_priority` gives every thread of a launch the policy a cold start runs under (the
  spawner's --controller-cpu-policy) and the nice value it inherits from the spawner, before any of the
  launch's code runs;
- `StartClock` tells a start that is waiting for an idle CPU (not broken) from one that is stuck: it
  counts only the time the sandbox's tasks did not spend waiting on a run queue.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from l4m.spawner.sandbox import SandboxError

PROC = Path("/proc")
MAX_PROMOTION_ROUNDS = 10  # a sandbox waiting for its launch starts no thread; a few rounds are plenty


def thread_ids(pid: int) -> set[int]:
    try:
        return {int(name) for name in os.listdir(PROC / str(pid) / "task")}
    except FileNotFoundError:
        return set()


def parent_pids() -> dict[int, int]:
    """pid -> parent pid for every process on the host."""
    parents: dict[int, int] = {}
    for entry in os.scandir(PROC):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = Path(entry.path, "stat").read_text()
            # The command name (field 2) may hold spaces and parentheses: the fields after it are
            # found from the last ')'. The parent pid is the second of them.
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def descendants(root_pid: int) -> list[int]:
    """Every process under `root_pid` (not itself), from /proc/<pid>/task/<tid>/children: no scan of the
    host's whole process table, so cheap enough to poll. Empty on kernels built without
    CONFIG_PROC_CHILDREN, which lack those files: `sandbox_tree` works everywhere. (Raw reads of string
    paths: with Path objects and text reads a walk cost ~3x the CPU.)"""
    found, frontier = [], [root_pid]
    while frontier:
        tasks_dir = f"/proc/{frontier.pop()}/task"
        try:
            tasks = os.listdir(tasks_dir)
        except OSError:
            continue
        for tid in tasks:
            try:
                fd = os.open(f"{tasks_dir}/{tid}/children", os.O_RDONLY)
            except OSError:
                continue
            try:
                data = os.read(fd, 1 << 16)
            except OSError:
                continue
            finally:
                os.close(fd)
            if data:
                children = [int(child) for child in data.split()]
                found += children
                frontier += children
    return found


def has_children_files(pid: int) -> bool:
    """Whether this kernel lists each task's children in /proc (CONFIG_PROC_CHILDREN)."""
    return (PROC / str(pid) / "task" / str(pid) / "children").exists()


def sandbox_tree(root_pid: int) -> set[int]:
    """`root_pid` and every process descending from it; empty once it has ended. A walk of the /proc
    children files where the kernel has them: a scan of the whole process table (`tree_from_parents`)
    reads every process's stat, tens of milliseconds beside a warm pool of 64, and a hand-over without
    cgroups lists its sandbox at least twice."""
    if not has_children_files(root_pid):
        return tree_from_parents(root_pid)
    found = {root_pid, *descendants(root_pid)}
    return found if (PROC / str(root_pid)).exists() else set()


def tree_from_parents(root_pid: int) -> set[int]:
    """`sandbox_tree` from every process's parent pid: a scan of the whole process table, which works
    without CONFIG_PROC_CHILDREN (see `descendants`)."""
    parents = parent_pids()
    if root_pid not in parents:
        return set()
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    found, frontier = set(), [root_pid]
    while frontier:
        pid = frontier.pop()
        if pid not in found:
            found.add(pid)
            frontier.extend(children.get(pid, ()))
    return found


def set_launch_priority(list_pids: Callable[[], set[int]], policy: int, nice: int) -> set[int]:
    """Sets every thread of every process `list_pids` names to `policy` (SCHED_OTHER or SCHED_BATCH) at
    `nice`, listing again until a round finds no new thread (one started meanwhile inherits its
    creator's policy, maybe still idle). Returns the last list. Raises OSError when the kernel refuses a change, SandboxError when
    the sandbox keeps starting threads."""
    done: set[int] = set()
    for _ in range(MAX_PROMOTION_ROUNDS):
        pids = list_pids()
        new = {tid for pid in pids for tid in thread_ids(pid)} - done
        if not new:
            return pids
        for tid in sorted(new):
            # A thread that exited meanwhile runs at no priority at all: nothing to change.
            with contextlib.suppress(ProcessLookupError):
                os.sched_setscheduler(tid, policy, os.sched_param(0))
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        done |= new
    raise SandboxError("the warm sandbox kept starting threads while it was being handed a launch")


def thread_schedstat_ns(pids: Iterable[int], field: int) -> dict[int, int]:
    """tid -> one field of each live thread's /proc schedstat, in nanoseconds: 0, the time it ran; 1, the
    time it spent runnable but waiting for a CPU. Empty on kernels without CONFIG_SCHED_INFO."""
    values: dict[int, int] = {}
    for pid in pids:
        for tid in thread_ids(pid):
            with contextlib.suppress(OSError, IndexError, ValueError):  # a thread that just ended
                values[tid] = int((PROC / str(pid) / "task" / str(tid) / "schedstat").read_text().split()[field])
    return values


def run_delays_ns(pids: Iterable[int]) -> dict[int, int]:
    """tid -> nanoseconds it has spent runnable but waiting for a CPU."""
    return thread_schedstat_ns(pids, 1)


class StartClock:
    """The time a starting sandbox has spent not waiting for a CPU: wall time between `advance` calls,
    less what its tasks' run-queue delays grew by meanwhile. An idle-priority start on a busy machine
    barely advances it however long it waits; a start that hangs (sleeping, not runnable) advances it
    at wall-clock speed. A task first seen counts all of its delay (it began after the clock did); one
    that ended since the last call counts none of its last stretch, which can only make the clock
    run ahead of the truth, never behind it."""

    def __init__(self, now_s: float) -> None:
        self._last_s = now_s
        self._last_delays_ns: dict[int, int] = {}
        self.progress_s = 0.0

    def advance(self, now_s: float, delays_ns: dict[int, int]) -> float:
        waited_ns = sum(max(0, ns - self._last_delays_ns.get(tid, 0)) for tid, ns in delays_ns.items())
        self.progress_s += max(0.0, (now_s - self._last_s) - waited_ns / 1e9)
        self._last_s, self._last_delays_ns = now_s, delays_ns
        return self.progress_s
