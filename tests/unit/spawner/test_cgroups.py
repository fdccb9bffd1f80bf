"""Instance groups on fake hierarchies (plain directories): v1 with separate and co-mounted
controllers and the idle cpu group warm sandboxes wait in; v2 alone, beside v1 (hybrid), and mixed
(some controllers on each). A fake v2 directory holds the files the kernel would create in it.
Removing groups needs the real cgroupfs (a plain directory holding limit files cannot be rmdir'ed):
the integration tests cover it, on whichever version the machine has."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from l4m.spawner.cgroups import IDLE_CPU_GROUP, CgroupManager
from l4m.spawner.process_command import warm_cgroup_joins
from l4m.spawner.sandbox import Limits

MiB = 1024 * 1024


def fake_hierarchy(root: Path, mounts: dict[str, str]) -> Path:
    """`mounts`: controller name -> the directory it is mounted at (shared: co-mounted)."""
    for controller, mount in mounts.items():
        (root / mount).mkdir(exist_ok=True)
        (root / mount / "cgroup.procs").touch()
        if controller != mount:
            (root / controller).symlink_to(mount)
    return root


def test_separate_controllers_get_a_group_each_and_an_idle_cpu_group(tmp_path: Path) -> None:
    root = fake_hierarchy(tmp_path, {c: c for c in ("memory", "pids", "cpu", "cpuacct")})
    manager = CgroupManager("s1", root)
    assert set(manager.available) == {"memory", "pids", "cpu", "cpuacct"}
    assert manager.idle_cpu_group == root / "cpu" / IDLE_CPU_GROUP / "s1"
    assert (root / "cpu" / IDLE_CPU_GROUP / "cpu.idle").read_text() == "1"
    group = manager.create("warm-1", Limits())
    assert len(set(group.dirs.values())) == 4
    assert group.dirs["cpu"] / "cgroup.procs" not in group.procs_files(defer_cpu=True)
    assert group.dirs["cpuacct"] / "cgroup.procs" in group.procs_files(defer_cpu=True)


def test_co_mounted_cpu_and_cpuacct_share_one_group(tmp_path: Path) -> None:
    root = fake_hierarchy(tmp_path, {"memory": "memory", "cpu": "cpu,cpuacct", "cpuacct": "cpu,cpuacct"})
    manager = CgroupManager("s1", root)
    assert manager.available["cpu"] == manager.available["cpuacct"]
    group = manager.create("i-1", Limits(cpu_cores=0.5))  # one mkdir for both, not a second that fails
    assert group.dirs["cpu"] == group.dirs["cpuacct"]
    assert (group.dirs["cpu"] / "cpu.cfs_quota_us").read_text() == "50000"
    assert group.procs_files() == [group.dirs["memory"] / "cgroup.procs", group.dirs["cpu"] / "cgroup.procs"]
    assert group.procs_files(defer_cpu=True) == [group.dirs["memory"] / "cgroup.procs"]


def test_without_cpu_idle_there_is_no_idle_group(tmp_path: Path) -> None:
    root = fake_hierarchy(tmp_path, {"cpu": "cpu"})
    (root / "cpu" / IDLE_CPU_GROUP).write_text("not a directory: as if the kernel had no cpu.idle")
    manager = CgroupManager("s1", root)
    assert "cpu" in manager.available and manager.idle_cpu_group is None


def test_no_cpu_controller_no_idle_group(tmp_path: Path) -> None:
    manager = CgroupManager("s1", fake_hierarchy(tmp_path, {"memory": "memory"}))
    assert manager.idle_cpu_group is None


def fake_v2(mount: Path, offered: str, spawner_id: str = "s1") -> Path:
    """A v2 root offering `offered`, with the groups the manager makes down to `l4m/<spawner id>`."""
    for group in (mount, mount / "l4m", mount / "l4m" / spawner_id):
        group.mkdir(parents=True, exist_ok=True)
        (group / "cgroup.controllers").write_text(offered)
        (group / "cgroup.subtree_control").write_text("")
        (group / "cgroup.procs").write_text("")
    return mount


def test_v2_only_one_group_holds_every_controller(tmp_path: Path) -> None:
    root = fake_v2(tmp_path, "cpuset cpu io memory hugetlb pids rdma misc")
    manager = CgroupManager("s1", root)
    parent = root / "l4m" / "s1"
    assert manager.available == dict.fromkeys(("memory", "pids", "cpu", "cpuacct"), parent)
    assert all(manager.is_v2(c) for c in manager.available)
    assert manager.idle_cpu_group is None  # v2 warm sandboxes idle in their own group
    for group in (root, root / "l4m", parent):  # enabled down the path, v1's controllers only
        assert (group / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"

    limits = Limits(memory_bytes=256 * MiB, max_processes=32, cpu_cores=0.5)
    group = manager.create("warm-1", limits, idle=True)
    directory = parent / "warm-1"
    assert set(group.dirs.values()) == {directory} and group.unified == directory
    files = {
        name: (directory / name).read_text() for name in ("memory.max", "memory.swap.max", "memory.oom.group")
    }
    assert files == {"memory.max": str(256 * MiB), "memory.swap.max": "0", "memory.oom.group": "1"}
    assert (directory / "pids.max").read_text() == "32"
    assert (directory / "cpu.max").read_text() == "50000 100000"
    assert (directory / "cpu.idle").read_text() == "1"
    # A warm sandbox joins its one group at once: there is no cpu group of its own to defer.
    assert group.procs_files(defer_cpu=True) == [directory / "cgroup.procs"]
    assert warm_cgroup_joins(group, manager.idle_cpu_group) == [directory / "cgroup.procs"]

    manager.apply_limits(group, Limits(memory_bytes=128 * MiB, cpu_cores=0))  # the hand-over
    assert (directory / "cpu.idle").read_text() == "0"
    assert (directory / "cpu.max").read_text() == "max 100000"
    assert (directory / "memory.max").read_text() == str(128 * MiB)


def test_v2_counters_and_the_launch_only_counts_its_own_refused_charges(tmp_path: Path) -> None:
    manager = CgroupManager("s1", fake_v2(tmp_path, "memory pids cpu"))
    group = manager.create("warm-1", Limits(), idle=True)
    directory = group.unified
    assert directory is not None
    (directory / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 0\noom_kill 0\n")
    manager.apply_limits(group, Limits())  # the hand-over: 4 refusals were the warm start's
    (directory / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 1\noom_kill 1\n")
    (directory / "pids.events").write_text("max 3\n")
    (directory / "cpu.stat").write_text("usage_usec 1500000\nuser_usec 1000000\nsystem_usec 500000\n")
    assert group.memory_limit_hits() == 5
    assert group.memory_oom_kills() == 1
    assert group.pids_refused() == 3
    assert group.cpu_time_s() == 1.5


def test_v2_refuses_a_memory_limit_under_what_the_group_uses(tmp_path: Path) -> None:
    manager = CgroupManager("s1", fake_v2(tmp_path, "memory pids cpu"))
    group = manager.create("warm-1", Limits(memory_bytes=512 * MiB), idle=True)
    assert group.unified is not None
    (group.unified / "memory.current").write_text(str(300 * MiB))
    with pytest.raises(OSError) as raised:  # v2 would OOM-kill the sandbox; v1 refuses (EBUSY)
        manager.apply_limits(group, Limits(memory_bytes=256 * MiB))
    assert raised.value.errno == errno.EBUSY
    assert (group.unified / "memory.max").read_text() == str(512 * MiB)


def test_hybrid_host_drives_v1_and_leaves_an_empty_unified_hierarchy_alone(tmp_path: Path) -> None:
    root = fake_hierarchy(tmp_path, {c: c for c in ("memory", "pids", "cpu", "cpuacct")})
    fake_v2(root / "unified", "")  # systemd's hybrid layout: every controller is on v1
    manager = CgroupManager("s1", root)
    assert manager.unified_parent is None
    assert not any(manager.is_v2(c) for c in manager.available)
    assert (root / "unified" / "cgroup.subtree_control").read_text() == ""


def test_mixed_host_drives_each_controller_where_it_is(tmp_path: Path) -> None:
    root = fake_hierarchy(tmp_path, {"memory": "memory"})
    fake_v2(root / "unified", "pids cpu")
    manager = CgroupManager("s1", root)
    v2_parent = root / "unified" / "l4m" / "s1"
    assert manager.available == {
        "memory": root / "memory" / "l4m" / "s1",
        "pids": v2_parent,
        "cpu": v2_parent,
        "cpuacct": v2_parent,
    }
    assert (root / "unified" / "cgroup.subtree_control").read_text() == "+pids +cpu"
    group = manager.create("warm-1", Limits(memory_bytes=64 * MiB), idle=True)
    assert (group.dirs["memory"] / "memory.limit_in_bytes").read_text() == str(64 * MiB)
    assert not (group.dirs["pids"] / "memory.max").exists()
    # The warm sandbox joins both at once (the v2 group is also its cpu group, set idle).
    assert group.procs_files(defer_cpu=True) == [
        group.dirs["memory"] / "cgroup.procs",
        v2_parent / "warm-1" / "cgroup.procs",
    ]
    assert (v2_parent / "warm-1" / "cpu.idle").read_text() == "1"


def test_v2_without_the_wanted_controllers_or_unwritable_gives_no_groups(tmp_path: Path) -> None:
    assert CgroupManager("s1", fake_v2(tmp_path / "a", "io hugetlb")).available == {}
    read_only = fake_v2(tmp_path / "b", "memory pids cpu")
    (read_only / "l4m" / "cgroup.subtree_control").unlink()  # as if the kernel refused us the file
    (read_only / "l4m" / "cgroup.subtree_control").mkdir()
    assert CgroupManager("s1", read_only).available == {}


def test_v2_namespace_root_holding_processes_moves_them_into_a_leaf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = fake_v2(tmp_path, "memory pids cpu")
    (root / "cgroup.type").write_text("domain")  # a cgroup namespace's root, not the real one
    (root / "cgroup.procs").write_text("101\n102\n")
    write_text = Path.write_text

    def kernel(path: Path, data: str) -> int:
        """The two rules at play: no controllers for the children of a group that holds processes
        (EBUSY), and a pid written to a group's cgroup.procs leaves the one it was in."""
        if path == root / "cgroup.subtree_control" and (root / "cgroup.procs").read_text().split():
            raise OSError(errno.EBUSY, "Device or resource busy")
        if path.name == "cgroup.procs" and path.parent != root:
            held = (root / "cgroup.procs").read_text().split()
            write_text(root / "cgroup.procs", "".join(f"{pid}\n" for pid in held if pid != data))
            data = (path.read_text() if path.exists() else "") + f"{data}\n"
        return write_text(path, data)

    monkeypatch.setattr(Path, "write_text", kernel)
    manager = CgroupManager("s1", root)
    assert manager.available["memory"] == root / "l4m" / "s1"
    assert (root / "cgroup.procs").read_text() == ""
    assert (root / "l4m-init" / "cgroup.procs").read_text().split() == ["101", "102"]
    assert (root / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"


def test_v2_real_root_holding_processes_is_never_evacuated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = fake_v2(tmp_path, "memory pids cpu")  # no cgroup.type: the real root (where EBUSY cannot happen)
    (root / "cgroup.procs").write_text("1\n")
    write_text = Path.write_text

    def busy(path: Path, data: str) -> int:
        if path == root / "cgroup.subtree_control":
            raise OSError(errno.EBUSY, "Device or resource busy")
        return write_text(path, data)

    monkeypatch.setattr(Path, "write_text", busy)
    assert CgroupManager("s1", root).available == {}
    assert not (root / "l4m-init").exists()
    assert (root / "cgroup.procs").read_text() == "1\n"
