"""The process sandbox's warm pool with real bubblewrap.

A warm sandbox was started before its launch, so these tests check what could leak through that:
one launch's program, files or uid reaching another; a launch running under the pool's ceilings
instead of its own limits; a sandbox serving twice. Then the pool's life: it refills, more launches
than it holds start cold, a launch it cannot serve starts cold, the token and environment arrive
through the spawner's API, and a spawner that stops (or crashes) leaves no sandbox process behind.
The escape suite (test_escape.py) runs every hostile controller on a warm sandbox as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from l4m.spawner.config import SpawnerConfig
from l4m.spawner.process_command import ProcessSandboxConfig
from l4m.spawner.process_sandbox import ProcessSandbox
from l4m.spawner.programs import ProgramStore
from l4m.spawner.sandbox import ExitInfo, ExitReason, Limits, MiB, SandboxSpec
from l4m.spawner.supervisor import ExitEvent, InstanceSupervisor
from l4m.v1 import spawner_pb2
from tests.integration.harness import ServiceProcess
from tests.integration.spawner.harness import (
    attach,
    exit_of,
    open_full,
    run_with,
    running_spawner,
    upload,
)

CGROUP_ROOT = Path("/sys/fs/cgroup")
DEFAULT_LIMITS = Limits()
WAIT_S = 120.0  # for conditions that must come true; no assertion depends on how fast


@dataclass(frozen=True)
class Run:
    exit: ExitInfo
    stdout: str
    stderr: str
    is_warm: bool

    def value(self, key: str) -> str:
        for line in self.stdout.splitlines():
            if line.startswith(f"{key} "):
                return line[len(key) + 1 :]
        raise AssertionError(f"no {key!r} line in:\n{self.stdout}\n{self.stderr}")


@pytest.fixture
def store(tmp_path: Path) -> ProgramStore:
    return ProgramStore(tmp_path / "store")


def start(
    sandbox: ProcessSandbox,
    store: ProgramStore,
    source: str,
    limits: Limits = DEFAULT_LIMITS,
    args: tuple[str, ...] = (),
) -> InstanceSupervisor:
    program = store.put(source.encode()).program
    spec = SandboxSpec(
        f"w-{uuid.uuid4().hex[:12]}", program.path, args, {}, sandbox.config.warm_socket_dir, limits
    )
    return InstanceSupervisor(sandbox, spec)


async def run_program(
    sandbox: ProcessSandbox, store: ProgramStore, source: str, limits: Limits = DEFAULT_LIMITS
) -> Run:
    supervisor = start(sandbox, store, source, limits)
    await supervisor.start()
    return await collect(supervisor)


async def collect(supervisor: InstanceSupervisor) -> Run:
    streams: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
    async for event in supervisor.subscribe():
        if not isinstance(event, ExitEvent):
            streams[event.stream.value].append(event.data)
    return Run(
        await supervisor.wait(),
        b"".join(streams["stdout"]).decode(errors="replace"),
        b"".join(streams["stderr"]).decode(errors="replace"),
        supervisor.is_warm,
    )


FIRST = """
import os, time
open("/tmp/first-was-here", "w").write("FIRST-SECRET")
print("uid", os.getuid(), flush=True)
time.sleep(600)
"""
SECOND = """
import os, sys
# SECOND-MARKER
print("uid", os.getuid())
print("programs", sorted(os.listdir("/opt/l4m/program")))
source = open(sys.argv[0]).read()
print("own-source", "SECOND-MARKER" in source, "FIRST-" + "SECRET" in source)
print("tmp", sorted(os.listdir("/tmp")))
# No /proc in the sandbox: find the processes it can see by signalling each pid (0: no signal sent).
def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # there, but not ours
    return True
print("processes", [str(pid) for pid in range(1, 4096) if alive(pid)])
"""


def test_concurrent_warm_launches_see_neither_each_others_programs_nor_files(
    warm_process_sandbox: ProcessSandbox, store: ProgramStore
) -> None:
    async def go() -> tuple[Run, Run]:
        first = start(warm_process_sandbox, store, FIRST)
        await first.start()
        async for event in first.subscribe():
            assert not isinstance(event, ExitEvent), event
            if event.data.startswith(b"uid"):
                break
        second = await run_program(warm_process_sandbox, store, SECOND)
        await first.terminate()
        return await collect(first), second

    first, second = run_with(warm_process_sandbox, go())
    assert first.is_warm and second.is_warm
    assert first.exit.reason is ExitReason.TERMINATED, first.exit
    assert second.exit.reason is ExitReason.EXITED, f"{second.exit}\n{second.stderr}"
    assert first.value("uid") != second.value("uid")
    assert second.value("programs") == "['main.py']"
    assert second.value("own-source") == "True False"
    assert "first-was-here" not in second.value("tmp")
    assert second.value("processes") in ("['1']", "['1', '2']")  # bwrap's init and itself only


def test_a_warm_sandbox_serves_one_launch_and_is_replaced(
    warm_process_sandbox: ProcessSandbox, store: ProgramStore
) -> None:
    source = """
import os, sys
print("found", sorted(name for name in os.listdir("/tmp") if name.startswith("was-here")))
open(f"/tmp/was-here-{sys.argv[1] if len(sys.argv) > 1 else 'x'}", "w").close()
"""

    async def go() -> tuple[list[Run], object, object]:
        before = warm_process_sandbox.warm_pool_stats()
        runs = []
        for number in range(4):
            await asyncio.wait_for(warm_process_sandbox.wait_warm_pool_full(), WAIT_S)
            supervisor = start(warm_process_sandbox, store, source, args=(str(number),))
            await supervisor.start()
            runs.append(await collect(supervisor))
        await asyncio.wait_for(warm_process_sandbox.wait_warm_pool_full(), WAIT_S)
        return runs, before, warm_process_sandbox.warm_pool_stats()

    runs, before, after = run_with(warm_process_sandbox, go())
    for run in runs:
        assert run.exit.reason is ExitReason.EXITED, f"{run.exit}\n{run.stderr}"
        assert run.is_warm
        assert run.value("found") == "[]"  # no file from an earlier launch: no sandbox served twice
    assert (before.num_taken, before.num_started, before.num_ready) == (0, 2, 2)
    # Four taken, each replaced by a fresh sandbox: 2 + 4 started, 2 ready.
    assert (after.num_taken, after.num_started, after.num_ready) == (4, 6, 2)


def test_more_concurrent_launches_than_the_pool_holds_start_cold(
    warm_process_sandbox: ProcessSandbox, store: ProgramStore
) -> None:
    async def go() -> list[Run]:
        return list(
            await asyncio.gather(
                *(run_program(warm_process_sandbox, store, "print('ok')\n") for _ in range(5))
            )
        )

    runs = run_with(warm_process_sandbox, go())
    assert [run.exit.reason for run in runs] == [ExitReason.EXITED] * 5, runs
    assert all(run.stdout == "ok\n" for run in runs)
    assert sum(run.is_warm for run in runs) == 2


LIMITS_PROBE = """
import resource
for name in ("NOFILE", "NPROC", "CPU", "FSIZE", "CORE"):
    print(name, *resource.getrlimit(getattr(resource, "RLIMIT_" + name)))
"""


def test_a_warm_launch_runs_under_its_own_rlimits(
    warm_process_sandbox: ProcessSandbox, process_sandbox: ProcessSandbox, store: ProgramStore
) -> None:
    limits = Limits(cpu_time_s=7, max_processes=33, max_open_files=77)
    warm = run_with(warm_process_sandbox, run_program(warm_process_sandbox, store, LIMITS_PROBE, limits))
    cold = asyncio.run(run_program(process_sandbox, store, LIMITS_PROBE, limits))
    assert warm.is_warm and not cold.is_warm
    for name in ("NOFILE", "NPROC", "FSIZE", "CORE"):
        assert warm.value(name) == cold.value(name), name
    assert cold.value("NOFILE") == "77 77" and cold.value("NPROC") == "33 33"
    # RLIMIT_CPU counts from the process's start: the warm one adds what its imports used (< 1 s).
    soft, hard = map(int, warm.value("CPU").split())
    assert cold.value("CPU") == "7 8"
    assert soft in (7, 8, 9) and hard == soft + 1


MEMORY_HOG = """
block = bytearray(200 * 1024 * 1024)
block[::4096] = b"x" * len(block[::4096])
print("allocated 200 MiB")
"""
THREAD_HOG = """
import threading, time
threads = [threading.Thread(target=time.sleep, args=(30,)) for _ in range(20)]
for thread in threads:
    thread.start()
print("started 20 threads")
"""


def test_a_warm_launch_hits_its_own_memory_and_process_limits_below_the_pools(
    warm_process_sandbox: ProcessSandbox, store: ProgramStore
) -> None:
    ceiling = warm_process_sandbox.config.warm_max_limits
    memory_limits = Limits(memory_bytes=96 * MiB)
    process_limits = Limits(max_processes=8)
    assert ceiling.memory_bytes > 200 * MiB and ceiling.max_processes > 20  # the ceilings would allow both

    async def go() -> tuple[Run, Run]:
        memory = await run_program(warm_process_sandbox, store, MEMORY_HOG, memory_limits)
        await asyncio.wait_for(warm_process_sandbox.wait_warm_pool_full(), WAIT_S)
        processes = await run_program(warm_process_sandbox, store, THREAD_HOG, process_limits)
        return memory, processes

    memory, processes = run_with(warm_process_sandbox, go())
    assert memory.is_warm and processes.is_warm
    assert memory.exit.reason is ExitReason.MEMORY_LIMIT, f"{memory.exit}\n{memory.stderr[-2000:]}"
    assert "allocated" not in memory.stdout
    assert processes.exit.reason is ExitReason.PROCESS_LIMIT, f"{processes.exit}\n{processes.stderr[-2000:]}"
    assert "started 20 threads" not in processes.stdout


def test_a_launch_above_the_pools_ceilings_starts_cold(
    warm_process_sandbox: ProcessSandbox, store: ProgramStore
) -> None:
    ceiling = warm_process_sandbox.config.warm_max_limits
    limits = Limits(memory_bytes=ceiling.memory_bytes + MiB)

    async def go() -> tuple[Run, object]:
        run = await run_program(warm_process_sandbox, store, "print('ok')\n", limits)
        return run, warm_process_sandbox.warm_pool_stats()

    run, stats = run_with(warm_process_sandbox, go())
    assert run.exit.reason is ExitReason.EXITED and run.stdout == "ok\n", run
    assert not run.is_warm
    assert (stats.num_taken, stats.num_ready) == (0, 2)  # the pool was left as it was


# -- CPU priority ----------------------------------------------------------------------------------

PRIORITY_PROBE = """
import os, threading, time
print("policy", os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0), flush=True)
thread = threading.Thread(target=lambda: print("thread-policy", os.sched_getscheduler(0), flush=True))
thread.start()
thread.join()
print("sees-cgroupfs", os.path.exists("/sys/fs/cgroup"), flush=True)
time.sleep(600)
"""


def group_pids(group: Path) -> set[int]:
    with contextlib.suppress(FileNotFoundError):
        return {int(line) for line in (group / "cgroup.procs").read_text().split()}
    return set()


def thread_schedules(pids: set[int]) -> set[tuple[int, int]]:
    """(policy, nice) of every thread of `pids`."""
    schedules = set()
    for pid in pids:
        for tid in map(int, os.listdir(f"/proc/{pid}/task")):
            schedules.add((os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)))
    return schedules


def test_a_warm_sandbox_waits_at_idle_priority_and_its_launch_runs_at_the_launch_policy_in_its_cpu_group(
    warm_process_sandbox: ProcessSandbox, store: ProgramStore
) -> None:
    spawner_id = warm_process_sandbox.config.spawner_id
    parents = warm_process_sandbox.cgroup_parents
    if not {"pids", "cpu"} <= set(parents):
        pytest.fail("this test finds warm sandboxes through the pids cgroup and needs the cpu one")
    pids_groups, cpu_groups = parents["pids"], parents["cpu"]
    # v1: a warm sandbox waits in the spawner's idle cpu group; v2: in its own group, set idle.
    on_v2 = (cpu_groups / "cgroup.controllers").exists()
    idle_group = CGROUP_ROOT / "cpu" / "l4m-idle" / spawner_id
    # What a cold start runs under: the launch's policy (SCHED_BATCH by default), the spawner's nice value.
    launch = (os.SCHED_BATCH, os.getpriority(os.PRIO_PROCESS, 0))

    def is_idle(name: str) -> bool:
        if on_v2:
            return (cpu_groups / name / "cpu.idle").read_text().strip() == "1"
        return bool(group_pids(pids_groups / name)) and group_pids(pids_groups / name) <= group_pids(idle_group)

    async def go() -> Run:
        waiting = {group.name: group_pids(group) for group in warm_cgroups(spawner_id)}
        for name, pids in waiting.items():
            # bwrap, bwrap's init and the zygote: all idle, in an idle cpu group (v1: none in its own).
            assert len(pids) >= 3, (name, pids)
            assert thread_schedules(pids) == {(os.SCHED_IDLE, launch[1])}, name
            assert is_idle(name), name
            assert on_v2 or group_pids(cpu_groups / name) == set(), name
        supervisor = start(warm_process_sandbox, store, PRIORITY_PROBE)
        await supervisor.start()
        try:
            async for event in supervisor.subscribe():
                assert not isinstance(event, ExitEvent), event
                if b"sees-cgroupfs" in event.data:
                    break
            launched = [name for name in waiting if not is_idle(name) and group_pids(cpu_groups / name)]
            assert len(launched) == 1, launched
            pids = group_pids(pids_groups / launched[0])
            assert group_pids(cpu_groups / launched[0]) == pids
            assert on_v2 or not pids & group_pids(idle_group)
            # Every thread of the launch, the program's own included, runs as a cold start would.
            assert thread_schedules(pids) == {launch}
        finally:
            await supervisor.terminate()
        return await collect(supervisor)

    run = run_with(warm_process_sandbox, go())
    assert run.is_warm and run.exit.reason is ExitReason.TERMINATED, f"{run.exit}\n{run.stderr}"
    assert run.value("policy") == f"{os.SCHED_BATCH} {launch[1]}"
    assert run.value("thread-policy") == str(os.SCHED_BATCH)
    assert run.value("sees-cgroupfs") == "False"  # no way to move itself back out of its cpu group


def test_without_cgroups_the_launch_is_found_by_its_process_tree_and_promoted(
    spawner_id: str, warm_socket_dir: Path, store: ProgramStore
) -> None:
    config = ProcessSandboxConfig(
        spawner_id=f"{spawner_id}-nocg",
        uid_base=127_000,
        use_cgroups=False,
        warm_pool_size=1,
        warm_socket_dir=warm_socket_dir,
    )
    sandbox = ProcessSandbox(config)
    source = "import os\nprint('policy', os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0))\n"
    run = run_with(sandbox, run_program(sandbox, store, source))
    assert run.is_warm and run.exit.reason is ExitReason.EXITED, f"{run.exit}\n{run.stderr}"
    assert run.value("policy") == f"{os.SCHED_BATCH} {os.getpriority(os.PRIO_PROCESS, 0)}"


def test_with_the_normal_cpu_policy_warm_and_cold_launches_run_under_sched_other(
    spawner_id: str, warm_socket_dir: Path, store: ProgramStore
) -> None:
    config = ProcessSandboxConfig(
        spawner_id=f"{spawner_id}-other",
        uid_base=128_000,
        warm_pool_size=1,
        warm_socket_dir=warm_socket_dir,
        cpu_policy="normal",
    )
    sandbox = ProcessSandbox(config)
    source = "import os\nprint('policy', os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0))\n"
    ceiling = config.warm_max_limits

    async def go() -> tuple[Run, Run]:
        warm = await run_program(sandbox, store, source)
        # Above the pool's ceiling: a cold start, whose chain sets the policy itself (chrt --other).
        cold = await run_program(sandbox, store, source, Limits(memory_bytes=ceiling.memory_bytes + MiB))
        return warm, cold

    try:
        warm, cold = run_with(sandbox, go())
    finally:
        sandbox.remove_cgroup_parents()
    expected = f"{os.SCHED_OTHER} {os.getpriority(os.PRIO_PROCESS, 0)}"
    assert warm.is_warm and warm.exit.reason is ExitReason.EXITED, f"{warm.exit}\n{warm.stderr}"
    assert not cold.is_warm and cold.exit.reason is ExitReason.EXITED, f"{cold.exit}\n{cold.stderr}"
    assert (warm.value("policy"), cold.value("policy")) == (expected, expected)


def test_a_launch_whose_promotion_fails_starts_cold(
    warm_process_sandbox: ProcessSandbox, store: ProgramStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object) -> None:
        raise PermissionError("sched_setscheduler refused")

    monkeypatch.setattr("l4m.spawner.process_sandbox.set_launch_priority", refuse)

    async def go() -> tuple[Run, object]:
        run = await run_program(warm_process_sandbox, store, "import os\nprint(os.sched_getscheduler(0))\n")
        return run, warm_process_sandbox.warm_pool_stats()

    run, stats = run_with(warm_process_sandbox, go())
    assert run.exit.reason is ExitReason.EXITED and run.stdout == f"{os.SCHED_BATCH}\n", run
    assert not run.is_warm
    assert stats.num_taken == 1  # taken, refused, destroyed


def test_a_quiet_wait_refill_waits_while_the_cores_are_busy_and_fills_once_they_are_not(
    spawner_id: str, warm_socket_dir: Path, store: ProgramStore
) -> None:
    """`warm_pool_quiet_wait_s`: with every core busy (one busy loop per CPU) no warm start begins and the
    wait is counted; once they stop, the pool fills, and a launch takes its sandbox."""
    config = ProcessSandboxConfig(
        spawner_id=f"{spawner_id}-quiet", uid_base=129_000, warm_pool_size=1, warm_socket_dir=warm_socket_dir,
        warm_pool_quiet_wait_s=WAIT_S,
    )
    sandbox = ProcessSandbox(config)
    hogs = [subprocess.Popen(["python3", "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]

    async def go() -> tuple[object, object, float, Run]:
        await sandbox.open()
        try:
            await asyncio.sleep(2.0)  # four samples of the host's CPU, every one busy
            busy = sandbox.warm_pool_stats()
            for hog in hogs:
                hog.kill()
            started = time.monotonic()
            await asyncio.wait_for(sandbox.wait_warm_pool_full(), WAIT_S)
            filled_after_s = time.monotonic() - started
            filled = sandbox.warm_pool_stats()
            return busy, filled, filled_after_s, await run_program(sandbox, store, "print('ok')\n")
        finally:
            await sandbox.close()

    try:
        busy, filled, filled_after_s, run = asyncio.run(go())
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        sandbox.remove_cgroup_parents()
    assert (busy.num_started, busy.num_starting) == (0, 0), busy  # waiting, not starting
    assert filled_after_s < WAIT_S / 2  # the quiet host ended the wait, not its bound
    assert filled.quiet_wait_s >= 2.0 and filled.num_started == 1, filled  # the busy seconds were counted
    assert run.is_warm and run.stdout == "ok\n", run


# -- through the spawner ---------------------------------------------------------------------------

RUNTIME_HELLO = """
import os, grpc
from l4m.v1 import spawner_pb2 as pb, spawner_pb2_grpc
md = (("l4m-instance-token", os.environ["L4M_INSTANCE_TOKEN"]),)
rt = spawner_pb2_grpc.RuntimeServiceStub(grpc.insecure_channel(os.environ["L4M_RUNTIME_ADDR"]))
rt.SendToUser(pb.SendToUserRequest(text="hello from " + os.environ["L4M_INSTANCE_ID"]), metadata=md, timeout=30)
print("traceparent", os.environ.get("TRACEPARENT", ""))
"""


def pids_parent(spawner_id: str) -> Path:
    """Where this spawner id's groups with the pids controller are: in v1's pids hierarchy where it is
    mounted (the spawner prefers it), else in the v2 one."""
    if (CGROUP_ROOT / "pids" / "cgroup.procs").exists():
        return CGROUP_ROOT / "pids" / "l4m" / spawner_id
    v2_root = CGROUP_ROOT if (CGROUP_ROOT / "cgroup.controllers").exists() else CGROUP_ROOT / "unified"
    return v2_root / "l4m" / spawner_id


def warm_pids(spawner_id: str) -> set[int]:
    """Host pids of every process in this spawner id's warm sandboxes (from their pids cgroups)."""
    pids: set[int] = set()
    for procs in pids_parent(spawner_id).glob("warm-*/cgroup.procs"):
        with contextlib.suppress(OSError):
            pids.update(int(line) for line in procs.read_text().split())
    return pids


def warm_cgroups(spawner_id: str) -> list[Path]:
    return sorted(pids_parent(spawner_id).glob("warm-*"))


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()


@pytest.fixture
def server_sandbox(spawner_id: str, tmp_path: Path) -> Iterator[ProcessSandbox]:
    config = ProcessSandboxConfig(
        spawner_id=f"{spawner_id}-srv-{uuid.uuid4().hex[:6]}",
        uid_base=125_000,
        warm_pool_size=2,
        warm_socket_dir=tmp_path / "sockets",
    )
    sandbox = ProcessSandbox(config)
    if sandbox.cgroup_parents.get("pids") != pids_parent(config.spawner_id):
        pytest.fail("these tests find warm sandboxes through the pids cgroup, which this machine lacks")
    yield sandbox
    sandbox.remove_cgroup_parents()


def test_a_warm_launch_through_the_spawner_gets_its_token_and_stopping_leaves_nothing(
    server_sandbox: ProcessSandbox, tmp_path: Path
) -> None:
    spawner_id = server_sandbox.config.spawner_id
    config = SpawnerConfig(
        state_dir=tmp_path / "state",
        socket_dir=tmp_path / "sockets",
        spawner_id=spawner_id,
        controller_runner="",
    )
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

    async def go() -> tuple[list[spawner_pb2.AttachResponse], str, bool, set[int]]:
        async with running_spawner(config, server_sandbox) as spawner:
            await open_full(server_sandbox)
            sha = await upload(spawner.stub, RUNTIME_HELLO)
            launched = await spawner.stub.Launch(
                spawner_pb2.LaunchRequest(program=sha), metadata=(("traceparent", traceparent),), timeout=30
            )
            events = await attach(spawner.stub, launched.instance_id)
            is_warm = spawner.server.manager.get(launched.instance_id).supervisor.is_warm
            assert spawner.server.manager.metrics.warm_launches._value.get() == 1
            await asyncio.wait_for(server_sandbox.wait_warm_pool_full(), WAIT_S)
            pids = warm_pids(spawner_id)
        return events, launched.instance_id, is_warm, pids

    events, instance_id, is_warm, pids = asyncio.run(go())
    assert exit_of(events).reason == spawner_pb2.EXIT_REASON_EXITED, events
    assert is_warm
    assert [e.message.text for e in events if e.HasField("message")] == [f"hello from {instance_id}"]
    logged = [e.log.line for e in events if e.HasField("log")]
    assert any(line.startswith("traceparent 00-4bf92f3577b34da6a3ce929d0e0e4736-") for line in logged), logged
    assert len(pids) >= 2  # both warm sandboxes were up before the spawner stopped
    assert not [pid for pid in pids if is_alive(pid)]
    assert warm_cgroups(spawner_id) == []


def spawner_process(spawner_id: str, state_dir: Path, log_path: Path) -> ServiceProcess:
    args = ["--listen", "127.0.0.1:0", "--state-dir", str(state_dir), "--spawner-id", spawner_id, "--insecure-local"]
    return ServiceProcess("l4m.spawner", [*args, "--warm-pool-size", "2"], log_path)


def wait_for_warm_sandboxes(spawner_id: str, process: subprocess.Popen[bytes], log_path: Path) -> set[int]:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and process.poll() is None:
        # Each warm sandbox holds bwrap, bwrap's init and the zygote once started.
        groups = warm_cgroups(spawner_id)
        if len(groups) == 2 and all(len((g / "cgroup.procs").read_text().split()) >= 3 for g in groups):
            return warm_pids(spawner_id)
        time.sleep(0.1)
    raise AssertionError(f"the spawner's warm pool did not fill:\n{log_path.read_text()[-4000:]}")


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGKILL], ids=["stopped", "crashed"])
def test_a_spawner_process_that_ends_leaves_no_warm_sandbox_running(
    spawner_id: str, tmp_path: Path, stop_signal: signal.Signals
) -> None:
    spawner_id = f"{spawner_id}-proc-{uuid.uuid4().hex[:6]}"
    state_dir = tmp_path / "state"
    log_path = tmp_path / "spawner.log"
    spawner = spawner_process(spawner_id, state_dir, log_path)
    process = spawner.process
    try:
        pids = wait_for_warm_sandboxes(spawner_id, process, log_path)
        process.send_signal(stop_signal)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=60)
        spawner.stop()  # closes its log
    deadline = time.monotonic() + WAIT_S  # a crashed spawner's sandboxes die with it, not at once
    while [pid for pid in pids if is_alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if is_alive(pid)], log_path.read_text()[-4000:]
    if stop_signal == signal.SIGTERM:
        assert warm_cgroups(spawner_id) == [], log_path.read_text()[-4000:]
        assert list((state_dir / "warm").iterdir()) == [], log_path.read_text()[-4000:]
        assert not pids_parent(spawner_id).exists()  # its parent group too
        return
    # A crash leaves the warm sandboxes' cgroups and directories: the next start removes them as orphans.
    assert len(warm_cgroups(spawner_id)) == 2
    restarted = ProcessSandbox(ProcessSandboxConfig(spawner_id=spawner_id, warm_dir=state_dir / "warm"))
    assert asyncio.run(restarted.cleanup_orphans()) >= 2
    assert warm_cgroups(spawner_id) == []
    assert list((state_dir / "warm").iterdir()) == []
    restarted.remove_cgroup_parents()
