"""Instance groups on a fake v1 hierarchy (plain directories): separate and co-mounted controllers,
and the idle cpu group warm sandboxes wait in. Removing groups needs the real cgroupfs (a plain
directory holding limit files cannot be rmdir'ed): the integration tests cover it."""

from __future__ import annotations

from pathlib import Path

from l4m.spawner.cgroups import IDLE_CPU_GROUP, CgroupManager
from l4m.spawner.sandbox import Limits


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
