"""The bubblewrap command line: what is bound, how, as which uid, under which rlimits."""

from __future__ import annotations

from pathlib import Path

from l4m.spawner.process_sandbox import ProcessSandboxConfig, UidPool, build_command
from l4m.spawner.sandbox import Limits, SandboxSpec

CONFIG = ProcessSandboxConfig(
    python_prefix=Path("/work/app/.venv"),
    python_base_prefix=Path("/root/.pyenv/versions/3.11.7"),
    sdk_path=Path("/work/app/clients/python"),
)


def command(socket_dir: Path | None = Path("/srv/sock"), has_memory_cgroup: bool = True) -> list[str]:
    spec = SandboxSpec("i-1", Path("/store/programs/abc"), ("--n", "3"), {"TOKEN": "t"}, socket_dir, Limits())
    procs = [Path("/sys/fs/cgroup/pids/l4m/x/i-1/cgroup.procs")]
    return build_command(CONFIG, spec, 100_007, procs, has_memory_cgroup)


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


def test_mount_point_parents_are_created_traversable() -> None:
    argv = command()
    created = [argv[i + 3] for i, arg in enumerate(argv) if arg == "--perms" and argv[i + 2] == "--dir"]
    assert {"/root", "/root/.pyenv", "/opt", "/opt/l4m"} <= set(created)


def test_the_shell_joins_the_cgroups_before_anything_runs() -> None:
    argv = command()
    assert argv[:2] == ["/bin/sh", "-c"]
    assert "/sys/fs/cgroup/pids/l4m/x/i-1/cgroup.procs" in argv[2]
    assert argv[4] == "prlimit"


def test_rlimit_as_only_without_a_memory_cgroup() -> None:
    assert not any(arg.startswith("--as=") for arg in command(has_memory_cgroup=True))
    assert f"--as={Limits().memory_bytes}:{Limits().memory_bytes}" in command(has_memory_cgroup=False)


def test_environment_is_set_explicitly() -> None:
    argv = command(socket_dir=None)
    env = {argv[i + 1]: argv[i + 2] for i, arg in enumerate(argv) if arg == "--setenv"}
    assert env["PYTHONPATH"] == "/opt/l4m/python"
    assert env["TOKEN"] == "t"
    assert "/run/l4m" not in {dest for _, _, dest in binds(argv)}


def test_uids_are_unique_while_held_and_reused_after() -> None:
    pool = UidPool(100_000, 2)
    first, second = pool.acquire(), pool.acquire()
    assert {first, second} == {100_000, 100_001}
    pool.release(first)
    assert pool.acquire() == first
