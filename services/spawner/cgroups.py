"""cgroup v1 groups for process sandboxes: memory, pids, CPU bandwidth and CPU accounting.

Each instance gets `/sys/fs/cgroup/<controller>/l4m/<spawner id>/<instance id>` in every controller
that is mounted and writable here. The sandbox's first process writes its own pid into each group's
`cgroup.procs` before it execs anything (see process_command.py), so every descendant is counted.
Counters read back after an exit say which limit was hit: `memory.oom_control` (oom_kill),
`memory.failcnt`, `pids.events` (max), `cpuacct.usage`.

Machines without writable v1 controllers (cgroup v2 only, or an unprivileged spawner) get no
groups: `CgroupManager.available` is empty and the process backend falls back to rlimits. Where `cpu`
and `cpuacct` are mounted together (one `cpu,cpuacct` hierarchy), both name the same directory.

Warm sandboxes (see process_sandbox.py) wait for a launch in `/sys/fs/cgroup/cpu/l4m-idle/<spawner id>`
instead of their own cpu group; `l4m-idle` has `cpu.idle` = 1, so CFS gives its whole subtree CPU only
when nothing else at the top of the hierarchy wants it. It has to sit at the top: a group's idleness
only counts against its siblings, and a per-instance group under `l4m/` would compete as `l4m` does,
at full weight.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from l4m.spawner.sandbox import Limits

log = logging.getLogger(__name__)

CONTROLLERS = ("memory", "pids", "cpu", "cpuacct")
CFS_PERIOD_US = 100_000
IDLE_CPU_GROUP = "l4m-idle"  # under the cpu hierarchy's root; cpu.idle = 1


@dataclass(frozen=True)
class InstanceCgroup:
    """One instance's groups, one directory per available controller."""

    dirs: dict[str, Path]

    def procs_files(self, defer_cpu: bool = False) -> list[Path]:
        """One `cgroup.procs` per distinct directory; with `defer_cpu`, none in the cpu group's (nor
        cpuacct's when it is the same directory): what a warm sandbox joins as it starts."""
        cpu = self.dirs.get("cpu") if defer_cpu else None
        distinct = dict.fromkeys(directory for directory in self.dirs.values() if directory != cpu)
        return [directory / "cgroup.procs" for directory in distinct]

    def join_cpu(self, pids: set[int]) -> None:
        """Moves `pids` (every thread of each) into the cpu group; a warm sandbox's hand-off. Raises
        OSError when the kernel refuses one (ESRCH: it exited)."""
        procs = self.dirs["cpu"] / "cgroup.procs"
        for pid in sorted(pids):
            procs.write_text(str(pid))

    def memory_oom_kills(self) -> int | None:
        text = self._read("memory", "memory.oom_control")
        if text is None:
            return None
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return None

    def memory_limit_hits(self) -> int | None:
        text = self._read("memory", "memory.failcnt")
        return int(text) if text is not None else None

    def pids_refused(self) -> int | None:
        text = self._read("pids", "pids.events")
        if text is None:
            return None
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "max":
                return int(value)
        return None

    def cpu_time_s(self) -> float | None:
        text = self._read("cpuacct", "cpuacct.usage")
        return int(text) / 1e9 if text is not None else None

    def pids(self, defer_cpu: bool = False) -> set[int]:
        found: set[int] = set()
        for procs in self.procs_files(defer_cpu):
            with contextlib.suppress(OSError):
                found.update(int(line) for line in procs.read_text().split())
        return found

    def kill_all(self, timeout_s: float = 5.0) -> None:
        """SIGKILLs every task in the groups until none is left (a sandbox's pid-1 death normally did
        it already); a task forked meanwhile is caught by the next round."""
        deadline = time.monotonic() + timeout_s
        while pids := self.pids():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                log.warning(
                    "tasks %s outlived SIGKILL in %s", sorted(pids), sorted(map(str, self.dirs.values()))
                )
                return
            time.sleep(0.01)

    def remove(self) -> None:
        self.kill_all()
        for directory in dict.fromkeys(self.dirs.values()):
            for _ in range(100):
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY while the last tasks are being reaped
                    time.sleep(0.01)

    def _read(self, controller: str, name: str) -> str | None:
        directory = self.dirs.get(controller)
        if directory is None:
            return None
        try:
            return (directory / name).read_text().strip()
        except OSError:
            return None


class CgroupManager:
    """Creates and removes instance groups under `<root>/<controller>/l4m/<spawner id>`."""

    def __init__(self, spawner_id: str, root: Path = Path("/sys/fs/cgroup")) -> None:
        self.spawner_id = spawner_id
        self.root = root
        self.available: dict[str, Path] = {}
        for controller in CONTROLLERS:
            parent = root / controller / "l4m" / spawner_id
            if self._usable(root / controller, parent):
                # Co-mounted controllers (cpu,cpuacct) share one directory: keep one name for it.
                shared = next((p for p in self.available.values() if p.samefile(parent)), None)
                self.available[controller] = shared or parent
        self.idle_cpu_group = self._make_idle_cpu_group() if "cpu" in self.available else None

    @staticmethod
    def _usable(mount: Path, parent: Path) -> bool:
        # A v1 hierarchy has cgroup.procs and no cgroup.controllers (that file marks v2).
        if not (mount / "cgroup.procs").exists() or (mount / "cgroup.controllers").exists():
            return False
        try:
            parent.mkdir(parents=True, exist_ok=True)
            probe = parent / f"probe-{os.getpid()}"
            probe.mkdir(exist_ok=True)
            probe.rmdir()
        except OSError:
            return False
        return True

    def _make_idle_cpu_group(self) -> Path | None:
        top = self.root / "cpu" / IDLE_CPU_GROUP
        try:
            top.mkdir(exist_ok=True)
            (top / "cpu.idle").write_text("1")
            group = top / self.spawner_id
            group.mkdir(exist_ok=True)
        except OSError as exc:  # cpu.idle came with Linux 5.15
            log.warning("no idle cpu group (%s): warm sandboxes rely on SCHED_IDLE alone", exc)
            return None
        return group

    def create(self, instance_id: str, limits: Limits) -> InstanceCgroup:
        dirs: dict[str, Path] = {}
        try:
            for controller, parent in self.available.items():
                directory = parent / instance_id
                if directory not in dirs.values():
                    directory.mkdir()
                dirs[controller] = directory
            group = InstanceCgroup(dirs)
            self.apply_limits(group, limits)
            return group
        except OSError:
            InstanceCgroup(dirs).remove()
            raise

    def apply_limits(self, group: InstanceCgroup, limits: Limits) -> None:
        """Sets the group's limits: at creation, and again when a warm sandbox takes on a launch (which
        is why every value is written, unthrottled CPU included). Lowering the memory limit under what
        the group uses already fails with OSError (EBUSY)."""
        if "memory" in group.dirs:
            memory = group.dirs["memory"]
            (memory / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
            # No swap either (memsw is limit + swap; only present with swap accounting on).
            with contextlib.suppress(OSError):
                (memory / "memory.memsw.limit_in_bytes").write_text(str(limits.memory_bytes))
            # The exit reason reads the count of refused charges: only the launch's own may count.
            with contextlib.suppress(OSError):
                (memory / "memory.failcnt").write_text("0")
        if "pids" in group.dirs:
            (group.dirs["pids"] / "pids.max").write_text(str(limits.max_processes))
        if "cpu" in group.dirs:
            cpu = group.dirs["cpu"]
            (cpu / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
            quota_us = int(limits.cpu_cores * CFS_PERIOD_US) if limits.cpu_cores > 0 else -1
            (cpu / "cpu.cfs_quota_us").write_text(str(quota_us))

    def remove_parents(self) -> None:
        """Removes this spawner id's (empty) parent groups; for a spawner that stops for good."""
        for parent in dict.fromkeys(self.available.values()):
            with contextlib.suppress(OSError):
                parent.rmdir()
        if self.idle_cpu_group is not None:
            with contextlib.suppress(OSError):
                self.idle_cpu_group.rmdir()

    def cleanup_orphans(self) -> int:
        """Kills and removes every instance group this spawner id left behind; returns how many."""
        names: set[str] = set()
        for parent in dict.fromkeys(self.available.values()):
            names.update(child.name for child in parent.iterdir() if child.is_dir())
        for name in names:
            InstanceCgroup({c: p / name for c, p in self.available.items() if (p / name).is_dir()}).remove()
        return len(names)
