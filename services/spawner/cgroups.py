"""cgroup groups for process sandboxes: memory, pids, CPU bandwidth and CPU accounting, on cgroup v1 or v2.

Each instance gets a group in every controller this spawner can drive, named
`l4m/<spawner id>/<instance id>`. The sandbox's first process writes its own pid into each group's
`cgroup.procs` before it execs anything (see process_command.py), so every descendant is counted.
Counters read back after an exit say which limit was hit: OOM kills, refused memory charges, refused
forks, CPU time.

**cgroup v1** (a hierarchy per controller under `/sys/fs/cgroup/<controller>`): the group is
`/sys/fs/cgroup/<controller>/l4m/<spawner id>/<instance id>` in each; the counters are
`memory.oom_control` (oom_kill), `memory.failcnt`, `pids.events` (max) and `cpuacct.usage`. Where `cpu`
and `cpuacct` are mounted together (one `cpu,cpuacct` hierarchy), both name the same directory.

**cgroup v2** (one unified hierarchy: `/sys/fs/cgroup` itself, or `/sys/fs/cgroup/unified` on a hybrid
host), for every controller v1 does not offer here: one directory `<v2 root>/l4m/<spawner id>/<instance
id>` holds them all. The spawner enables them down that path (`cgroup.subtree_control`). v2 lets no
cgroup but the root hold processes and enable controllers for its children at once; where the v2 root is
a cgroup namespace's root that holds processes (a privileged container), they are first moved into
`<v2 root>/l4m-init`, as container runtimes do. Limits: `memory.max` (with `memory.swap.max` 0 and
`memory.oom.group` 1: an OOM kill takes the whole sandbox), `pids.max`, `cpu.max`; counters:
`memory.events` (oom_kill, max), `pids.events` (max) and `cpu.stat` (usage_usec, present in every v2
group); `cgroup.kill` (Linux 5.14) ends a group at once. A host may mix the two (a controller on v1,
others on v2): each controller is driven where it is.

Machines without writable controllers on either (an unprivileged spawner, a read-only cgroupfs as in a
Kubernetes pod) get no groups: `CgroupManager.available` is empty and the process backend falls back to
rlimits.

Warm sandboxes (see process_sandbox.py) wait for a launch at idle CPU priority. On v1 they wait in
`/sys/fs/cgroup/cpu/l4m-idle/<spawner id>` instead of their own cpu group; `l4m-idle` has `cpu.idle` = 1,
so CFS gives its whole subtree CPU only when nothing else at the top of the hierarchy wants it. It has
to sit at the top: a group's idleness only counts against its siblings, and a per-instance group under
`l4m/` would compete as `l4m` does, at full weight. On v2 a process's memory, pids and cpu group are one
directory, and memory charged in one group stays there when its process moves, so a warm sandbox waits
in its own group with `cpu.idle` = 1, turned off at the hand-over: it yields to the spawner's running
sandboxes, but against the rest of the host it competes within the `l4m` group's share, at SCHED_IDLE.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from l4m.spawner.sandbox import Limits

log = logging.getLogger(__name__)

CONTROLLERS = ("memory", "pids", "cpu", "cpuacct")
V2_CONTROLLERS = ("memory", "pids", "cpu")  # cpuacct's figure, cpu.stat, comes with every v2 group
CFS_PERIOD_US = 100_000
IDLE_CPU_GROUP = "l4m-idle"  # v1: under the cpu hierarchy's root; cpu.idle = 1
V2_INIT_GROUP = "l4m-init"  # v2: where a namespace root's own processes are moved to


def stat_field(text: str | None, key: str) -> int | None:
    """The value of `key` in a cgroup file of "key value" lines."""
    if text is None:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return None


@dataclass(frozen=True)
class InstanceCgroup:
    """One instance's groups, one directory per available controller. `unified` is the cgroup v2
    group, when any controller is driven there (every such controller names it in `dirs`)."""

    dirs: dict[str, Path]
    unified: Path | None = None
    # v2 counters cannot be reset: their values when the launch's limits were written.
    baselines: dict[str, int] = field(default_factory=dict, compare=False)

    def is_v2(self, controller: str) -> bool:
        return self.unified is not None and self.dirs.get(controller) == self.unified

    def procs_files(self, defer_cpu: bool = False) -> list[Path]:
        """One `cgroup.procs` per distinct directory; with `defer_cpu`, none in a v1 cpu group's (nor
        cpuacct's when it is the same directory): what a warm sandbox joins as it starts. A v2 group
        is joined at once: its cpu idleness is a setting of the group (see `CgroupManager.create`)."""
        cpu = self.dirs.get("cpu") if defer_cpu and not self.is_v2("cpu") else None
        distinct = dict.fromkeys(directory for directory in self.dirs.values() if directory != cpu)
        return [directory / "cgroup.procs" for directory in distinct]

    def join_cpu(self, pids: set[int]) -> None:
        """Moves `pids` (every thread of each) into a v1 cpu group; a warm sandbox's hand-off (a v2
        group holds them already). Raises OSError when the kernel refuses one (ESRCH: it exited)."""
        if self.is_v2("cpu"):
            return
        procs = self.dirs["cpu"] / "cgroup.procs"
        for pid in sorted(pids):
            procs.write_text(str(pid))

    def memory_oom_kills(self) -> int | None:
        if self.is_v2("memory"):
            return stat_field(self.read_file("memory", "memory.events"), "oom_kill")
        return stat_field(self.read_file("memory", "memory.oom_control"), "oom_kill")

    def memory_limit_hits(self) -> int | None:
        if self.is_v2("memory"):
            hits = stat_field(self.read_file("memory", "memory.events"), "max")
            return None if hits is None else hits - self.baselines.get("memory.events max", 0)
        text = self.read_file("memory", "memory.failcnt")
        return int(text) if text is not None else None

    def pids_refused(self) -> int | None:
        return stat_field(self.read_file("pids", "pids.events"), "max")

    def cpu_time_s(self) -> float | None:
        if self.is_v2("cpuacct"):
            usage_us = stat_field(self.read_file("cpuacct", "cpu.stat"), "usage_usec")
            return usage_us / 1e6 if usage_us is not None else None
        text = self.read_file("cpuacct", "cpuacct.usage")
        return int(text) / 1e9 if text is not None else None

    def pids(self, defer_cpu: bool = False) -> set[int]:
        found: set[int] = set()
        for procs in self.procs_files(defer_cpu):
            with contextlib.suppress(OSError):
                found.update(int(line) for line in procs.read_text().split())
        return found

    def kill_all(self, timeout_s: float = 5.0) -> None:
        """SIGKILLs every task in the groups until none is left (a sandbox's pid-1 death normally did
        it already); a task forked meanwhile is caught by the next round. A v2 group is first killed
        whole by the kernel (`cgroup.kill`), which no fork can race."""
        if self.unified is not None:
            with contextlib.suppress(OSError):  # before Linux 5.14: the rounds below do it
                (self.unified / "cgroup.kill").write_text("1")
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

    def read_file(self, controller: str, name: str) -> str | None:
        directory = self.dirs.get(controller)
        if directory is None:
            return None
        try:
            return (directory / name).read_text().strip()
        except OSError:
            return None


class CgroupManager:
    """Creates and removes instance groups under `l4m/<spawner id>`: in `<root>/<controller>` for
    each usable v1 controller, and in the v2 hierarchy for the rest that it offers."""

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
        self.unified_parent: Path | None = None
        wanted = [c for c in V2_CONTROLLERS if c not in self.available]
        if wanted and (v2 := self._make_v2_parent(wanted)) is not None:
            self.unified_parent, enabled = v2
            for controller in (*enabled, "cpuacct"):
                self.available.setdefault(controller, self.unified_parent)
        self.idle_cpu_group = (
            self._make_idle_cpu_group() if "cpu" in self.available and not self.is_v2("cpu") else None
        )

    def is_v2(self, controller: str) -> bool:
        return self.unified_parent is not None and self.available.get(controller) == self.unified_parent

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

    def v2_root(self) -> Path | None:
        """The unified hierarchy's root as this process sees it: `root` on a v2-only host, `root/unified`
        on a hybrid one."""
        for mount in (self.root, self.root / "unified"):
            if (mount / "cgroup.controllers").is_file():
                return mount
        return None

    def _make_v2_parent(self, wanted: list[str]) -> tuple[Path, list[str]] | None:
        """`<v2 root>/l4m/<spawner id>` and those of the `wanted` controllers that v2 offers and lets
        this spawner enable for its children, or None where that leaves none."""
        mount = self.v2_root()
        if mount is None:
            return None
        offered = (mount / "cgroup.controllers").read_text().split()
        controllers = [c for c in wanted if c in offered]
        group = mount
        try:
            for name in ("l4m", self.spawner_id, None):
                controllers = self._enable(group, controllers, may_evacuate=group == mount)
                if not controllers or name is None:
                    break
                group = group / name
                group.mkdir(exist_ok=True)
        except OSError as exc:
            log.warning("cgroup v2 at %s is not usable (%s): no groups there", mount, exc)
            return None
        return (group, controllers) if controllers else None

    @staticmethod
    def _enable(group: Path, controllers: list[str], may_evacuate: bool = False) -> list[str]:
        """Enables each of `controllers` for `group`'s children where the kernel lets it; returns those
        enabled. v2 refuses that (EBUSY) while the group holds processes, except at the real root; at a
        namespace's root (a privileged container's) they are moved into a leaf first."""
        control = group / "cgroup.subtree_control"
        enabled = set(control.read_text().split())
        missing = [c for c in controllers if c not in enabled]
        if not missing:
            return controllers
        line = " ".join(f"+{c}" for c in missing)
        try:
            control.write_text(line)
            return controllers
        except OSError as exc:
            if exc.errno == errno.EBUSY and may_evacuate and (group / "cgroup.type").exists():
                CgroupManager._evacuate(group)
                with contextlib.suppress(OSError):
                    control.write_text(line)
                    return controllers
        # One by one, keeping what the kernel allows (not cpu, say, while a realtime task sits below).
        for controller in missing:
            try:
                control.write_text(f"+{controller}")
                enabled.add(controller)
            except OSError as exc:
                log.warning("cannot enable the %s controller in %s: %s", controller, group, exc)
        return [c for c in controllers if c in enabled]

    @staticmethod
    def _evacuate(group: Path) -> None:
        """Moves every process of `group` into its `l4m-init` child."""
        leaf = group / V2_INIT_GROUP
        leaf.mkdir(exist_ok=True)
        moved = 0
        for _ in range(10):  # a process may fork while the others move
            pids = (group / "cgroup.procs").read_text().split()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(OSError):  # it exited meanwhile
                    (leaf / "cgroup.procs").write_text(pid)
                    moved += 1
        log.warning(
            "moved %d processes of %s into %s: v2 lets a group hold processes or give controllers to its children, not both",
            moved,
            group,
            leaf,
        )

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

    def create(self, instance_id: str, limits: Limits, *, idle: bool = False) -> InstanceCgroup:
        """The instance's groups with `limits` written. `idle`: a warm sandbox's, whose v2 group waits
        with `cpu.idle` = 1 until `apply_limits` writes a launch's limits."""
        dirs: dict[str, Path] = {}
        unified = self.unified_parent / instance_id if self.unified_parent is not None else None
        try:
            for controller, parent in self.available.items():
                directory = parent / instance_id
                if directory not in dirs.values():
                    directory.mkdir()
                dirs[controller] = directory
            group = InstanceCgroup(dirs, unified)
            self.apply_limits(group, limits, idle=idle)
            return group
        except OSError:
            InstanceCgroup(dirs, unified).remove()
            raise

    def apply_limits(self, group: InstanceCgroup, limits: Limits, *, idle: bool = False) -> None:
        """Sets the group's limits: at creation, and again when a warm sandbox takes on a launch (which
        is why every value is written, unthrottled CPU and a v2 group's idleness included). Lowering the
        memory limit under what the group uses already fails with OSError (EBUSY on v1; on v2 the
        kernel reclaims, then OOM-kills)."""
        if "memory" in group.dirs:
            memory = group.dirs["memory"]
            if group.is_v2("memory"):
                # v2 would reclaim, then OOM-kill the group, where v1 refuses: refuse as v1 does.
                used = group.read_file("memory", "memory.current")
                if used is not None and int(used) > limits.memory_bytes:
                    raise OSError(errno.EBUSY, f"the group uses {used} bytes, over {limits.memory_bytes}")
                (memory / "memory.max").write_text(str(limits.memory_bytes))
                with contextlib.suppress(OSError):  # only present with swap accounting on
                    (memory / "memory.swap.max").write_text("0")
                with contextlib.suppress(OSError):  # Linux 4.19
                    (memory / "memory.oom.group").write_text("1")
                hits = stat_field(group.read_file("memory", "memory.events"), "max")
                group.baselines["memory.events max"] = hits or 0
            else:
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
            quota_us = int(limits.cpu_cores * CFS_PERIOD_US) if limits.cpu_cores > 0 else -1
            if group.is_v2("cpu"):
                (cpu / "cpu.max").write_text(f"{quota_us if quota_us > 0 else 'max'} {CFS_PERIOD_US}")
                with contextlib.suppress(OSError):  # cpu.idle came with Linux 5.15
                    (cpu / "cpu.idle").write_text("1" if idle else "0")
            else:
                (cpu / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
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
            dirs = {c: p / name for c, p in self.available.items() if (p / name).is_dir()}
            unified = self.unified_parent / name if self.unified_parent is not None else None
            InstanceCgroup(dirs, unified if unified in dirs.values() else None).remove()
        return len(names)
