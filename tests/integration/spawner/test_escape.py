"""The sandbox escape suite, on both backends (real bubblewrap, a real Docker engine), and on
bubblewrap again with a warm pool, whose sandboxes were started before the launch they serve.

Each hostile controller either is refused (files, network) or is stopped with the exit reason that
names the limit it hit (processes, memory, CPU, output, wall time). A well-behaved controller runs
next to every hostile one and again after it, and must succeed both times: one instance's abuse
must not hurt the host or its neighbours. The Unix socket directory, the one way out, must work.
With a warm pool, each hostile controller must have been served by a warm sandbox (asserted).
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from l4m.spawner.programs import ProgramStore
from l4m.spawner.sandbox import ExitInfo, ExitReason, Limits, Sandbox, SandboxSpec
from l4m.spawner.supervisor import ExitEvent, InstanceSupervisor
from tests.integration.spawner.harness import run_with, serves_warm

MiB = 1024 * 1024
# Time limits are stretched where the machine is emulated (scripts/cgroup-v2-vm.sh without KVM sets it):
# an import that takes 0.3 s of CPU here takes seconds there.
SLOWDOWN = float(os.environ.get("L4M_TEST_SLOWDOWN", "1"))
HOSTILE_LIMITS = Limits(
    wall_time_s=60.0 * SLOWDOWN,
    cpu_time_s=2.0 * SLOWDOWN,
    memory_bytes=256 * MiB,
    max_processes=64,
    max_open_files=64,
    max_output_bytes=1 * MiB,
)
WELL_BEHAVED = """
import grpc, l4m
print("bystander ok", flush=True)
"""


@dataclass(frozen=True)
class Run:
    exit: ExitInfo
    stdout: str
    stderr: str
    is_warm: bool


@pytest.fixture
def store(tmp_path: Path) -> ProgramStore:
    return ProgramStore(tmp_path / "store")


async def run_program(
    sandbox: Sandbox,
    store: ProgramStore,
    source: str,
    *,
    limits: Limits = HOSTILE_LIMITS,
    args: tuple[str, ...] = (),
    socket_dir: Path | None = None,
) -> Run:
    program = store.put(source.encode()).program
    socket_dir = socket_dir or default_socket_dir(sandbox)
    spec = SandboxSpec(f"t-{uuid.uuid4().hex[:12]}", program.path, args, {}, socket_dir, limits)
    supervisor = InstanceSupervisor(sandbox, spec)
    await supervisor.start()
    streams: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
    async for event in supervisor.subscribe():
        if not isinstance(event, ExitEvent):
            streams[event.stream.value].append(event.data)
    info = await supervisor.wait()
    return Run(
        info,
        b"".join(streams["stdout"]).decode(errors="replace"),
        b"".join(streams["stderr"]).decode(errors="replace"),
        supervisor.is_warm,
    )


def default_socket_dir(sandbox: Sandbox) -> Path | None:
    """The warm pool's socket directory for a warm sandbox (a launch naming another starts cold)."""
    return sandbox.config.warm_socket_dir if serves_warm(sandbox) else None


def assert_bystander_ok(run: Run) -> None:
    assert run.exit.reason is ExitReason.EXITED, f"{run.exit}\n{run.stderr}"
    assert "bystander ok" in run.stdout


async def run_next_to_bystanders(sandbox: Sandbox, store: ProgramStore, source: str, **kwargs: object) -> Run:
    """Runs `source` with a well-behaved controller beside it, then another after it."""
    hostile, bystander = await asyncio.gather(
        run_program(sandbox, store, source, **kwargs), run_program(sandbox, store, WELL_BEHAVED)
    )
    assert hostile.is_warm == serves_warm(sandbox), "the hostile controller did not take the expected path"
    assert_bystander_ok(bystander)
    assert_bystander_ok(await run_program(sandbox, store, WELL_BEHAVED))
    return hostile


def test_reading_host_and_spawner_files_is_refused(
    sandbox: Sandbox, store: ProgramStore, tmp_path: Path
) -> None:
    secret_dir = tmp_path / "spawner-private"
    secret_dir.mkdir(mode=0o700)
    secret = secret_dir / "secret.txt"
    secret.write_text("TOP-SECRET-7f3a")
    secret.chmod(0o644)  # even a world-readable file is out of reach: it is not in the sandbox
    stored = store.put(b"print('another program')\n").program
    source = """
import os, sys
for path in sys.argv[1:]:
    try:
        if os.path.isdir(path):
            print("READ", path, os.listdir(path))
        else:
            with open(path, "rb") as f:
                print("READ", path, f.read(64))
    except OSError as e:
        print("REFUSED", path, type(e).__name__)
for path in ("/opt/l4m/program/main.py", "/usr/lib/l4m-was-here", "/etc/l4m-was-here"):
    try:
        open(path, "a").close()
        print("WROTE", path)
    except OSError as e:
        print("REFUSED-WRITE", path, type(e).__name__)
"""
    spawner_environ = f"/proc/{os.getpid()}/environ"  # the spawner's pid does not exist in the sandbox
    targets = (
        "/etc/shadow",
        str(secret),
        str(store.root),
        str(stored.path),
        "/proc/1/root/etc/shadow",
        spawner_environ,
    )
    run = run_with(sandbox, run_next_to_bystanders(sandbox, store, source, args=targets))
    assert run.exit.reason is ExitReason.EXITED, f"{run.exit}\n{run.stderr}"
    assert "TOP-SECRET" not in run.stdout + run.stderr
    assert "READ" not in run.stdout.replace("REFUSED", ""), run.stdout
    assert "WROTE" not in run.stdout, run.stdout
    assert run.stdout.count("REFUSED ") == len(targets), run.stdout
    assert run.stdout.count("REFUSED-WRITE ") == 3, run.stdout


def test_network_is_unreachable(sandbox: Sandbox, store: ProgramStore) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract_name = f"\0l4m-escape-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    abstract.bind(abstract_name)
    abstract.listen()
    abstract.setblocking(False)
    port = listener.getsockname()[1]
    source = """
import socket, sys
port, abstract = int(sys.argv[1]), sys.argv[2]
for host, p in (("127.0.0.1", port), ("10.0.0.1", 80), ("8.8.8.8", 53), ("1.1.1.1", 443)):
    try:
        socket.create_connection((host, p), timeout=3).close()
        print("CONNECTED", host)
    except OSError as e:
        print("REFUSED", host, type(e).__name__)
try:
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("8.8.8.8", 53))
    print("SENT udp")
except OSError as e:
    print("REFUSED udp", type(e).__name__)
try:
    s = socket.socket(socket.AF_UNIX)
    s.connect("\\0" + abstract)
    print("CONNECTED abstract")
except OSError as e:
    print("REFUSED abstract", type(e).__name__)
"""
    try:
        run = run_with(
            sandbox, run_next_to_bystanders(sandbox, store, source, args=(str(port), abstract_name[1:]))
        )
        for sock in (listener, abstract):
            with pytest.raises(BlockingIOError):
                sock.accept()  # nothing ever connected
    finally:
        listener.close()
        abstract.close()
    assert run.exit.reason is ExitReason.EXITED, f"{run.exit}\n{run.stderr}"
    assert "CONNECTED" not in run.stdout and "SENT" not in run.stdout, run.stdout
    assert run.stdout.count("REFUSED") == 6, run.stdout


def test_fork_bomb_hits_the_process_limit(sandbox: Sandbox, store: ProgramStore) -> None:
    source = """
import os, time
for _ in range(10_000):
    if os.fork() == 0:
        time.sleep(600)
        os._exit(0)
print("forked 10000")
"""
    run = run_with(sandbox, run_next_to_bystanders(sandbox, store, source))
    assert run.exit.reason is ExitReason.PROCESS_LIMIT, f"{run.exit}\n{run.stderr[-2000:]}"
    assert "forked 10000" not in run.stdout


def test_allocating_4_gb_hits_the_memory_limit(sandbox: Sandbox, store: ProgramStore) -> None:
    source = """
block = bytearray(4 * 1024**3)
block[:: 4096] = b"x" * len(block[:: 4096])
print("allocated 4 GB")
"""
    run = run_with(sandbox, run_next_to_bystanders(sandbox, store, source))
    assert run.exit.reason is ExitReason.MEMORY_LIMIT, f"{run.exit}\n{run.stderr[-2000:]}"
    assert "allocated" not in run.stdout


def test_spinning_forever_hits_the_cpu_limit(sandbox: Sandbox, store: ProgramStore) -> None:
    run = run_with(sandbox, run_next_to_bystanders(sandbox, store, "while True:\n    pass\n"))
    assert run.exit.reason is ExitReason.CPU_TIME_LIMIT, f"{run.exit}\n{run.stderr[-2000:]}"


def test_printing_1_gb_hits_the_output_limit(sandbox: Sandbox, store: ProgramStore) -> None:
    source = """
import sys
line = b"x" * 1023 + b"\\n"
for _ in range(1024 * 1024):
    sys.stdout.buffer.write(line)
print("printed 1 GB")
"""
    run = run_with(sandbox, run_next_to_bystanders(sandbox, store, source))
    assert run.exit.reason is ExitReason.OUTPUT_LIMIT, f"{run.exit}\n{run.stderr[-2000:]}"
    assert len(run.stdout) + len(run.stderr) <= HOSTILE_LIMITS.max_output_bytes
    assert "printed 1 GB" not in run.stdout


def test_sleeping_forever_hits_the_wall_time_limit(sandbox: Sandbox, store: ProgramStore) -> None:
    limits = Limits(wall_time_s=1.5)
    run = run_with(sandbox, run_program(sandbox, store, "import time\ntime.sleep(3600)\n", limits=limits))
    assert run.exit.reason is ExitReason.WALL_TIME_LIMIT, run.exit
    assert run.is_warm == serves_warm(sandbox)


def test_terminate_stops_a_running_instance(sandbox: Sandbox, store: ProgramStore) -> None:
    async def go() -> tuple[ExitInfo, bool]:
        program = store.put(b"import time\nprint('ready', flush=True)\ntime.sleep(3600)\n").program
        spec = SandboxSpec(f"t-{uuid.uuid4().hex[:12]}", program.path, socket_dir=default_socket_dir(sandbox))
        supervisor = InstanceSupervisor(sandbox, spec)
        await supervisor.start()
        async for event in supervisor.subscribe():
            assert not isinstance(event, ExitEvent), event
            if b"ready" in event.data:
                break
        return await supervisor.terminate(), supervisor.is_warm

    info, is_warm = run_with(sandbox, go())
    assert info.reason is ExitReason.TERMINATED, info
    assert is_warm == serves_warm(sandbox)


def _accessible_socket_dir(sandbox: Sandbox, tmp_path: Path) -> Path:
    # The sandbox uid must be able to enter the directory and connect to (= write) the socket.
    warm_socket_dir = default_socket_dir(sandbox)
    if warm_socket_dir is not None:
        return warm_socket_dir
    socket_dir = tmp_path / "sockets"
    socket_dir.mkdir()
    socket_dir.chmod(0o755)
    return socket_dir


def test_the_socket_dir_is_reachable(sandbox: Sandbox, store: ProgramStore, tmp_path: Path) -> None:
    socket_dir = _accessible_socket_dir(sandbox, tmp_path)
    name = f"echo-{uuid.uuid4().hex[:8]}.sock"
    source = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect("/run/l4m/" + sys.argv[1])
s.sendall(b"ping from the sandbox")
print("ECHO", s.recv(100).decode())
"""

    async def go() -> Run:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(await reader.read(100))
            await writer.drain()
            writer.close()

        server = await asyncio.start_unix_server(echo, path=str(socket_dir / name))
        (socket_dir / name).chmod(0o666)
        try:
            async with server:
                return await run_program(sandbox, store, source, args=(name,), socket_dir=socket_dir)
        finally:
            (socket_dir / name).unlink(missing_ok=True)

    run = run_with(sandbox, go())
    assert run.exit.reason is ExitReason.EXITED, f"{run.exit}\n{run.stderr}"
    assert "ECHO ping from the sandbox" in run.stdout
    assert run.is_warm == serves_warm(sandbox)


def test_grpc_over_the_socket_dir(sandbox: Sandbox, store: ProgramStore, tmp_path: Path) -> None:
    socket_dir = _accessible_socket_dir(sandbox, tmp_path)
    name = f"l4m-{uuid.uuid4().hex[:8]}.sock"
    source = """
import grpc, sys
from grpc_health.v1 import health_pb2, health_pb2_grpc
with grpc.insecure_channel("unix:///run/l4m/" + sys.argv[1]) as channel:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
print("HEALTH", health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
"""

    async def go() -> Run:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        server.add_insecure_port(f"unix://{socket_dir / name}")
        await server.start()
        (socket_dir / name).chmod(0o666)
        try:
            return await run_program(sandbox, store, source, args=(name,), socket_dir=socket_dir)
        finally:
            await server.stop(None)
            (socket_dir / name).unlink(missing_ok=True)

    run = run_with(sandbox, go())
    assert run.exit.reason is ExitReason.EXITED, f"{run.exit}\n{run.stderr}"
    assert "HEALTH SERVING" in run.stdout
    assert run.is_warm == serves_warm(sandbox)


# -- the kernel's attack surface (issue #16): namespaces, mounts, ptrace, keyrings, BPF ----------------

KERNEL_PROBES = """
import ctypes, errno, os, platform, signal, subprocess, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NR = {"x86_64": {"keyctl": 250, "bpf": 321, "perf_event_open": 298, "ptrace": 101},
      "aarch64": {"keyctl": 219, "bpf": 280, "perf_event_open": 241, "ptrace": 117}}[platform.machine()]
CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
PTRACE_ATTACH, PTRACE_DETACH = 16, 17


def report(name, ret):
    code = ctypes.get_errno()
    if ret == -1:
        print("DENIED", name, errno.errorcode.get(code, code), flush=True)
    else:
        print("ALLOWED", name, ret, flush=True)


def run(name, argv):
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except FileNotFoundError:
        print("MISSING", name, flush=True)
        return
    print("ALLOWED" if done.returncode == 0 else "DENIED", name, repr(done.stderr.strip()[-200:]), flush=True)


os.makedirs("/tmp/mnt", exist_ok=True)
report("unshare-user", libc.unshare(CLONE_NEWUSER))
report("unshare-user-mount", libc.unshare(CLONE_NEWUSER | CLONE_NEWNS))
report("unshare-mount", libc.unshare(CLONE_NEWNS))
report("mount-tmpfs", libc.mount(b"none", b"/tmp/mnt", b"tmpfs", 0, None))
run("unshare-Urm", ["unshare", "-Urm", "sh", "-c", "mount -t tmpfs none /tmp/mnt && id -u"])
run("mount-command", ["mount", "-t", "tmpfs", "none", "/tmp/mnt"])
# KEYCTL_JOIN_SESSION_KEYRING with a NULL name: a new anonymous session keyring.
report("keyctl", libc.syscall(NR["keyctl"], 1, None, 0, 0, 0))
attr = ctypes.create_string_buffer(128)  # BPF_MAP_CREATE of an all-zero (invalid) map: EINVAL if reached
report("bpf", libc.syscall(NR["bpf"], 0, attr, 128))
report("perf_event_open", libc.syscall(NR["perf_event_open"], ctypes.create_string_buffer(128), 0, -1, -1, 0))
child = os.fork()
if child == 0:
    time.sleep(60)
    os._exit(0)
report("ptrace-child", libc.syscall(NR["ptrace"], PTRACE_ATTACH, child, None, None))
report("ptrace-parent", libc.syscall(NR["ptrace"], PTRACE_ATTACH, os.getppid(), None, None))
os.kill(child, signal.SIGKILL)
os.waitpid(child, 0)
# Asked of the kernel, not read from /proc/self/status: the process backend mounts no /proc.
PR_GET_SECCOMP, PR_GET_NO_NEW_PRIVS = 21, 39
print("NoNewPrivs", libc.prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0))
print("Seccomp", libc.prctl(PR_GET_SECCOMP, 0, 0, 0, 0))
header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
data = (ctypes.c_uint32 * 6)()  # two (effective, permitted, inheritable) words
assert libc.capget(header, data) == 0, ctypes.get_errno()
print("CapEff", f"{(data[3] << 32) | data[0]:016x}")
print("done", flush=True)
"""
# Every probe a controller may not have on either backend.
KERNEL_PROBES_DENIED = (
    "unshare-user",
    "unshare-user-mount",
    "unshare-mount",
    "mount-tmpfs",
    "unshare-Urm",
    "mount-command",
    "keyctl",
    "bpf",
    "perf_event_open",
    # Even the controller's own child: the sandbox's processes share a uid (Docker's default profile
    # alone would allow both inside the container; l4m's filter, stacked on it, does not).
    "ptrace-child",
    "ptrace-parent",
)


def probe_results(stdout: str) -> dict[str, str]:
    """{probe: DENIED | ALLOWED | MISSING} from KERNEL_PROBES' output."""
    return {
        fields[1]: fields[0]
        for fields in (line.split() for line in stdout.splitlines())
        if len(fields) >= 2 and fields[0] in ("DENIED", "ALLOWED", "MISSING")
    }


def test_namespaces_mounts_ptrace_keyrings_and_bpf_are_denied(sandbox: Sandbox, store: ProgramStore) -> None:
    run = run_with(sandbox, run_next_to_bystanders(sandbox, store, KERNEL_PROBES))
    assert run.exit.reason is ExitReason.EXITED, f"{run.exit}\n{run.stderr}"
    assert "done" in run.stdout, run.stdout
    results = probe_results(run.stdout)
    for probe in KERNEL_PROBES_DENIED:
        assert results.get(probe) == "DENIED", f"{probe}: {results.get(probe)}\n{run.stdout}"
    for line in ("NoNewPrivs 1", "Seccomp 2", "CapEff 0000000000000000"):
        assert line in run.stdout.splitlines(), f"{line!r} missing:\n{run.stdout}"


# A controller's CPU policy (sandbox.CPU_POLICIES): set by the spawner, SCHED_BATCH by default, on every
# thread; the controller may lower its own priority (nice) but not change its policy.
CPU_POLICY_PROBE = """
import ctypes, errno, os, platform, struct, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NR_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}[platform.machine()]
print("policy", os.sched_getscheduler(0), flush=True)
seen = []
thread = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0)))
thread.start()
thread.join()
print("thread-policy", seen[0], flush=True)
try:
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    print("setscheduler ALLOWED", flush=True)
except OSError as exc:
    print("setscheduler", errno.errorcode[exc.errno], flush=True)
# struct sched_attr as of its first version (48 bytes): size, policy SCHED_OTHER, flags, nice, priority,
# runtime, deadline, period.
attr = ctypes.create_string_buffer(struct.pack("=IIQiIQQQ", 48, 0, 0, 0, 0, 0, 0, 0), 48)
ret = libc.syscall(NR_SCHED_SETATTR, 0, attr, 0)
print("setattr", "ALLOWED" if ret == 0 else errno.errorcode[ctypes.get_errno()], flush=True)
before = os.getpriority(os.PRIO_PROCESS, 0)
print("nice-raised", os.nice(1) == before + 1, flush=True)
print("policy-after", os.sched_getscheduler(0), flush=True)
"""


def test_a_controller_runs_under_sched_batch_and_cannot_change_its_policy(
    sandbox: Sandbox, store: ProgramStore
) -> None:
    run = run_with(sandbox, run_program(sandbox, store, CPU_POLICY_PROBE))
    assert run.exit.reason is ExitReason.EXITED, f"{run.exit}\n{run.stderr}"
    assert run.is_warm == serves_warm(sandbox)
    batch = str(os.SCHED_BATCH)
    assert run.stdout.splitlines() == [
        f"policy {batch}",
        f"thread-policy {batch}",
        "setscheduler EPERM",
        "setattr EPERM",
        "nice-raised True",
        f"policy-after {batch}",
    ], run.stdout


NORMAL_CONTROLLER = """
import asyncio, concurrent.futures, os, subprocess, sys, threading
import grpc, l4m

results = []
threads = [threading.Thread(target=results.append, args=(n,)) for n in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
with concurrent.futures.ThreadPoolExecutor(4) as pool:
    squares = sorted(pool.map(lambda n: n * n, range(8)))
print("threads", len(results), sum(squares), flush=True)


async def main():
    process = await asyncio.create_subprocess_exec("/bin/echo", "from", "exec", stdout=asyncio.subprocess.PIPE)
    out, _ = await process.communicate()
    await asyncio.gather(*(asyncio.sleep(0.01) for _ in range(10)))
    return out.decode().strip()


print("asyncio", asyncio.run(main()), flush=True)
print("subprocess", subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True).stdout.strip())
child = os.fork()
if child == 0:
    os._exit(7)
print("fork", os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]), flush=True)
"""


def test_a_normal_controller_still_runs_threads_asyncio_and_subprocesses(
    sandbox: Sandbox, store: ProgramStore
) -> None:
    run = run_with(
        sandbox, run_program(sandbox, store, NORMAL_CONTROLLER, socket_dir=default_socket_dir(sandbox))
    )
    assert run.exit.reason is ExitReason.EXITED, f"{run.exit}\n{run.stderr}"
    assert run.stdout.splitlines() == ["threads 8 140", "asyncio from exec", "subprocess 42", "fork 7"], (
        run.stdout
    )
    assert run.is_warm == serves_warm(sandbox)


def test_only_the_data_plane_sockets_are_visible(
    sandbox: Sandbox, store: ProgramStore, tmp_path: Path
) -> None:
    """The sandbox's /run/l4m holds the scheduler's L4M socket and the runtime socket, nothing else; the
    control plane (<state>/internal: the registry socket, the cluster secret) is not in the sandbox at
    all, by its host path or by any path relative to the socket directory."""
    socket_dir = _accessible_socket_dir(sandbox, tmp_path)
    internal = tmp_path / "internal"
    internal.mkdir(mode=0o700)
    (internal / "cluster.secret").write_text("CLUSTER-SECRET-5e1d")
    source = """
import os, socket, sys
print("LISTING", sorted(os.listdir("/run/l4m")))
for path in sys.argv[1:]:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        print("CONNECTED", path)
    except OSError as e:
        print("REFUSED", path, type(e).__name__)
    finally:
        s.close()
try:
    print("READ", open(os.path.join(os.path.dirname(sys.argv[1]), "cluster.secret")).read())
except OSError as e:
    print("REFUSED secret", type(e).__name__)
"""
    names = ("scheduler.sock", "runtime.sock")
    registry = internal / "registry.sock"
    targets = (
        str(registry),
        "/run/l4m/../internal/registry.sock",
        str(socket_dir.parent / "internal/registry.sock"),
    )

    async def go() -> Run:
        servers = [await asyncio.start_unix_server(lambda r, w: w.close(), path=str(registry))]
        for name in names:
            servers.append(
                await asyncio.start_unix_server(lambda r, w: w.close(), path=str(socket_dir / name))
            )
            (socket_dir / name).chmod(0o666)
        registry.chmod(0o666)  # even a socket anyone may connect to is out of reach: it is not there
        try:
            return await run_program(sandbox, store, source, args=targets, socket_dir=socket_dir)
        finally:
            for server in servers:
                server.close()
            for name in names:
                (socket_dir / name).unlink(missing_ok=True)

    run = run_with(sandbox, go())
    assert run.exit.reason is ExitReason.EXITED, f"{run.exit}\n{run.stderr}"
    assert "LISTING ['runtime.sock', 'scheduler.sock']" in run.stdout, run.stdout
    assert "CONNECTED" not in run.stdout and "SECRET" not in run.stdout, run.stdout
    assert run.stdout.count("REFUSED") == len(targets) + 1, run.stdout
    assert run.is_warm == serves_warm(sandbox)


MOUNT_PROBE = """
import os, sys
for path in ("/proc/self/mountinfo", "/proc/mounts", "/proc/1/mountinfo", "/proc/self/environ", "/proc/kallsyms"):
    try:
        print("READ", path, open(path).read())
    except OSError as e:
        print("REFUSED", path, type(e).__name__)
print("PROC", sorted(os.listdir("/proc")) if os.path.exists("/proc") else "absent")
"""


@pytest.mark.parametrize("backend", ["process_sandbox", "warm_process_sandbox"])
def test_the_process_sandbox_shows_no_mount_table_and_so_no_host_paths(
    request: pytest.FixtureRequest, backend: str, store: ProgramStore, tmp_path: Path
) -> None:
    """Issue #17: /proc/self/mountinfo named each bind's host path (the state directory, the program
    store, the repository). The process backend mounts no /proc at all, so neither the mount table nor
    the kernel's other /proc files (kallsyms, the bwrap init's environ) are there to read."""
    sandbox: Sandbox = request.getfixturevalue(backend)
    run = run_with(sandbox, run_next_to_bystanders(sandbox, store, MOUNT_PROBE,
                                                   socket_dir=default_socket_dir(sandbox)))
    assert run.exit.reason is ExitReason.EXITED, f"{run.exit}\n{run.stderr}"
    assert "READ" not in run.stdout and run.stdout.count("REFUSED") == 5, run.stdout
    assert "PROC absent" in run.stdout, run.stdout
    for host_path in (str(store.root), str(tmp_path)):
        assert host_path not in run.stdout + run.stderr
