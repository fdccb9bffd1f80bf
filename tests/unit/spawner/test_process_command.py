"""The bubblewrap command line: what is bound, how, as which uid, under which rlimits."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from l4m.spawner.cgroups import InstanceCgroup
from l4m.spawner.process_command import (
    WARM_UP_CPU_S,
    ZYGOTE_PATH,
    ProcessSandboxConfig,
    build_command,
    build_warm_command,
    warm_cgroup_joins,
    warm_launch,
    warm_refusal,
)
from l4m.spawner.sandbox import Limits, MiB, SandboxSpec

CONFIG = ProcessSandboxConfig(
    python_prefix=Path("/work/app/.venv"),
    python_base_prefix=Path("/root/.pyenv/versions/3.11.7"),
    sdk_path=Path("/work/app/clients/python"),
)
SECCOMP_FD = 7


def command(
    socket_dir: Path | None = Path("/srv/sock"), has_memory_cgroup: bool = True, config: ProcessSandboxConfig = CONFIG
) -> list[str]:
    spec = SandboxSpec("i-1", Path("/store/programs/abc"), ("--n", "3"), {"TOKEN": "t"}, socket_dir, Limits())
    procs = [Path("/sys/fs/cgroup/pids/l4m/x/i-1/cgroup.procs")]
    return build_command(config, spec, 100_007, procs, has_memory_cgroup, SECCOMP_FD)


def binds(argv: list[str]) -> list[tuple[str, str, str]]:
    return [(argv[i], argv[i + 1], argv[i + 2]) for i, arg in enumerate(argv) if arg.endswith("bind")]


def test_everything_is_bound_read_only_and_the_host_root_is_not() -> None:
    argv = command()
    kinds = {kind for kind, _, _ in binds(argv)}
    assert kinds == {"--ro-bind"}
    destinations = {dest for _, _, dest in binds(argv)}
    assert "/" not in destinations
    assert {
        "/usr",
        "/root/.pyenv/versions/3.11.7",
        "/opt/l4m/venv",
        "/opt/l4m/python",
        "/run/l4m",
    } <= destinations
    assert ("--ro-bind", "/store/programs/abc", "/opt/l4m/program/main.py") in binds(argv)


def test_namespaces_and_capabilities() -> None:
    argv = command()
    for flag in (
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
    ):
        assert flag in argv
    assert argv[argv.index("--cap-drop") + 1] == "ALL"
    setpriv = argv[argv.index("setpriv") :]
    for flag in (
        "--reuid=100007",
        "--regid=100007",
        "--clear-groups",
        "--no-new-privs",
        "--bounding-set=-all",
    ):
        assert flag in setpriv
    assert setpriv[-4:] == ["/opt/l4m/venv/bin/python3", "/opt/l4m/program/main.py", "--n", "3"]


def test_cold_and_warm_sandboxes_run_under_the_seccomp_filter() -> None:
    for argv in (command(), warm_command()):
        bwrap = argv[argv.index("bwrap") : argv.index("setpriv")]
        assert bwrap[bwrap.index("--seccomp") + 1] == str(SECCOMP_FD)


def test_mount_point_parents_are_created_traversable() -> None:
    argv = command()
    created = [argv[i + 3] for i, arg in enumerate(argv) if arg == "--perms" and argv[i + 2] == "--dir"]
    assert {"/root", "/root/.pyenv", "/opt", "/opt/l4m"} <= set(created)


def test_the_shell_joins_the_cgroups_before_anything_runs() -> None:
    argv = command()
    assert argv[:2] == ["/bin/sh", "-c"]
    assert "/sys/fs/cgroup/pids/l4m/x/i-1/cgroup.procs" in argv[2]
    assert argv[4:8] == ["chrt", "--batch", "0", "prlimit"]  # the CPU policy, then the limits


def test_rlimit_as_only_without_a_memory_cgroup() -> None:
    assert not any(arg.startswith("--as=") for arg in command(has_memory_cgroup=True))
    assert f"--as={Limits().memory_bytes}:{Limits().memory_bytes}" in command(has_memory_cgroup=False)


def test_environment_is_set_explicitly() -> None:
    argv = command(socket_dir=None)
    env = {argv[i + 1]: argv[i + 2] for i, arg in enumerate(argv) if arg == "--setenv"}
    assert env["PYTHONPATH"] == "/opt/l4m/python"
    assert env["TOKEN"] == "t"
    assert "/run/l4m" not in {dest for _, _, dest in binds(argv)}


# -- warm sandboxes ---------------------------------------------------------------------------------

WARM_CONFIG = dataclasses.replace(
    CONFIG,
    warm_pool_size=2,
    warm_socket_dir=Path("/srv/sock"),
    warm_max_limits=Limits(cpu_time_s=600, memory_bytes=2048 * MiB, max_processes=128, max_open_files=512),
    warm_modules=("l4m.controller", "numpy"),
)


def warm_command(has_memory_cgroup: bool = True) -> list[str]:
    procs = [Path("/sys/fs/cgroup/pids/l4m/x/warm-1/cgroup.procs")]
    return build_warm_command(
        WARM_CONFIG, Path("/state/warm/warm-1"), 100_008, procs, has_memory_cgroup, SECCOMP_FD
    )


def test_a_warm_sandbox_runs_the_zygote_with_an_empty_program_directory() -> None:
    argv = warm_command()
    assert {kind for kind, _, _ in binds(argv)} == {"--ro-bind"}
    assert ("--ro-bind", str(ZYGOTE_PATH), "/opt/l4m/zygote/zygote.py") in binds(argv)
    assert ("--ro-bind", "/state/warm/warm-1", "/opt/l4m/program") in binds(argv)
    assert ("--ro-bind", "/srv/sock", "/run/l4m") in binds(argv)
    setpriv = argv[argv.index("setpriv") :]
    assert "--reuid=100008" in setpriv and "--no-new-privs" in setpriv
    assert setpriv[-3:] == ["/opt/l4m/zygote/zygote.py", "l4m.controller", "numpy"]


def test_a_warm_sandbox_holds_no_instance_secret_until_its_launch() -> None:
    env = setenvs(warm_command())
    assert env["PYTHONPATH"] == "/opt/l4m/python"
    assert not {"L4M_INSTANCE_ID", "L4M_INSTANCE_TOKEN", "TRACEPARENT"} & set(env)


def test_a_warm_sandbox_starts_at_the_pool_ceilings() -> None:
    argv = warm_command(has_memory_cgroup=False)
    ceiling = WARM_CONFIG.warm_max_limits
    cpu = 600 + WARM_UP_CPU_S
    assert f"--cpu={cpu}:{cpu + 1}" in argv
    assert "--nofile=512:512" in argv and "--nproc=128:128" in argv
    assert f"--as={ceiling.memory_bytes}:{ceiling.memory_bytes}" in argv


def test_the_launch_lowers_to_exactly_the_cold_rlimits() -> None:
    for has_memory_cgroup in (True, False):
        spec = SandboxSpec(
            "i-2", Path("/store/programs/abc"), ("x",), {"L4M_INSTANCE_TOKEN": "t"}, None, Limits()
        )
        cold = build_command(CONFIG, spec, 100_007, [], has_memory_cgroup, SECCOMP_FD)
        cold_flags = {arg for arg in cold[cold.index("prlimit") : cold.index("bwrap")] if arg.startswith("--")} - {"--"}
        launch = warm_launch(spec, has_memory_cgroup)
        flags = {f"--cpu={launch['cpu_time_s']}:{launch['cpu_time_s'] + 1}"}
        flags |= {f"--{name[7:].lower()}={soft}:{hard}" for name, (soft, hard) in launch["rlimits"].items()}
        assert flags == cold_flags
        assert launch["program"] == "/opt/l4m/program/main.py"
        assert launch["env"] == {"L4M_INSTANCE_ID": "i-2", "L4M_INSTANCE_TOKEN": "t"}
        assert (launch["args"], launch["runner"]) == (["x"], "")


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"socket_dir": Path("/elsewhere")}, "socket directory"),
        ({"limits": Limits(tmp_bytes=8 * MiB)}, "/tmp size"),
        ({"limits": Limits(memory_bytes=4096 * MiB)}, "memory_bytes is above"),
        ({"limits": Limits(cpu_time_s=601)}, "cpu_time_s is above"),
        ({"limits": Limits(max_processes=129)}, "max_processes is above"),
        ({"limits": Limits(max_open_files=513)}, "max_open_files is above"),
        ({"env": {"PYTHONHASHSEED": "0"}}, "PYTHONHASHSEED"),
        ({"env": {"OMP_NUM_THREADS": "4"}}, "OMP_NUM_THREADS"),
    ],
)
def test_launches_a_warm_sandbox_cannot_serve_like_a_cold_start(change: dict, reason: str) -> None:
    spec = dataclasses.replace(SandboxSpec("i-3", Path("/p"), socket_dir=Path("/srv/sock")), **change)
    assert reason in warm_refusal(WARM_CONFIG, spec)


def test_launches_within_the_ceilings_are_served_warm() -> None:
    limits = Limits(wall_time_s=9999, cpu_time_s=600, memory_bytes=64 * MiB, max_processes=8, cpu_cores=0)
    spec = SandboxSpec(
        "i-4", Path("/p"), (), {"TRACEPARENT": "00-x", "L4M_INSTANCE_TOKEN": "t"}, Path("/srv/sock"), limits
    )
    assert warm_refusal(WARM_CONFIG, spec) == ""


# -- CPU priority of warm sandboxes ------------------------------------------------------------------

GROUPS = Path("/sys/fs/cgroup")
IDLE_GROUP = GROUPS / "cpu" / "l4m-idle" / "x"


def instance_cgroup(*controllers: str, co_mounted: bool = False) -> InstanceCgroup:
    dirs = {c: GROUPS / c / "l4m" / "x" / "warm-1" for c in controllers}
    if co_mounted:
        dirs["cpuacct"] = dirs["cpu"] = GROUPS / "cpu,cpuacct" / "l4m" / "x" / "warm-1"
    return InstanceCgroup(dirs)


def exec_target(argv: list[str]) -> list[str]:
    """What the joining shell execs: the arguments after its script and $0."""
    assert argv[:2] == ["/bin/sh", "-c"] and argv[3] == "l4m-sandbox"
    return argv[4:]


def test_a_warm_chain_runs_under_sched_idle_from_after_its_cgroup_joins_on() -> None:
    argv = warm_command()
    assert exec_target(argv)[:4] == ["chrt", "--idle", "0", "prlimit"]
    assert argv.count("chrt") == 1


@pytest.mark.parametrize(("policy", "flag"), [(None, "--batch"), ("batch", "--batch"), ("normal", "--other")])
def test_a_cold_chain_runs_under_the_launch_cpu_policy(policy: str | None, flag: str) -> None:
    config = CONFIG if policy is None else dataclasses.replace(CONFIG, cpu_policy=policy)
    argv = command(config=config)
    assert exec_target(argv)[:4] == ["chrt", flag, "0", "prlimit"]
    assert argv.count("chrt") == 1 and "--idle" not in argv


def test_an_unknown_cpu_policy_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"unknown CPU policy 'fifo' \(expected one of normal, batch\)"):
        dataclasses.replace(CONFIG, cpu_policy="fifo")


def test_a_warm_sandbox_defers_its_cpu_group_and_joins_the_idle_one_last() -> None:
    cgroup = instance_cgroup("memory", "pids", "cpu", "cpuacct")
    joins = warm_cgroup_joins(cgroup, IDLE_GROUP)
    assert cgroup.dirs["cpu"] / "cgroup.procs" not in joins
    assert joins == [
        cgroup.dirs["memory"] / "cgroup.procs",
        cgroup.dirs["pids"] / "cgroup.procs",
        cgroup.dirs["cpuacct"] / "cgroup.procs",
        IDLE_GROUP / "cgroup.procs",
    ]
    script = build_warm_command(WARM_CONFIG, Path("/state/warm/warm-1"), 100_008, joins, True, SECCOMP_FD)[2]
    assert str(cgroup.dirs["cpu"]) not in script
    assert script.index("/memory/") < script.index("/cpuacct/") < script.index("/l4m-idle/")
    # A cold start joins its cpu group at once.
    assert cgroup.dirs["cpu"] / "cgroup.procs" in cgroup.procs_files()


def test_with_cpu_and_cpuacct_co_mounted_accounting_is_deferred_too() -> None:
    cgroup = instance_cgroup("memory", "pids", co_mounted=True)
    joins = warm_cgroup_joins(cgroup, IDLE_GROUP)
    assert joins == [
        cgroup.dirs["memory"] / "cgroup.procs",
        cgroup.dirs["pids"] / "cgroup.procs",
        IDLE_GROUP / "cgroup.procs",
    ]
    assert cgroup.procs_files().count(cgroup.dirs["cpu"] / "cgroup.procs") == 1


def test_without_an_idle_group_or_a_cpu_controller_a_warm_sandbox_joins_no_cpu_group() -> None:
    with_cpu = instance_cgroup("memory", "cpu")
    assert warm_cgroup_joins(with_cpu, None) == [with_cpu.dirs["memory"] / "cgroup.procs"]
    without_cpu = instance_cgroup("memory", "pids")
    # No cpu group to move it into at its launch: it must never enter the idle one.
    assert IDLE_GROUP / "cgroup.procs" not in warm_cgroup_joins(without_cpu, IDLE_GROUP)
    assert warm_cgroup_joins(None, IDLE_GROUP) == []


def setenvs(argv: list[str]) -> dict[str, str]:
    return {argv[i + 1]: argv[i + 2] for i, arg in enumerate(argv) if arg == "--setenv"}
