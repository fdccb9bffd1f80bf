"""Memory of idle controllers and warm sandboxes (issue #21): unique (USS), proportional (PSS) and
resident (RSS) memory per sandbox, and the total for many idle controllers.

    flock -x /tmp/l4m-bench.lock taskset -c 0,1 .venv/bin/python bench/memory.py              # 8 per phase
    flock -x /tmp/l4m-bench.lock taskset -c 0,1 .venv/bin/python bench/memory.py --imports    # breakdown
    flock -x /tmp/l4m-bench.lock taskset -c 0,1 .venv/bin/python bench/memory.py --phases many \\
        --count 1000 --deadline-s 600 --min-available-gib 6

The cluster is laid out as `l4m up` lays it out: a scheduler (on a simulated executor: no model) serving
L4M sessions as frames on `scheduler.frames.sock` in the sandbox socket directory and the spawner
(`create_server`, in this process, as bench/spawner.py runs it) telling controllers to use it, runtime
calls (user messages, the receive) as frames on the spawner's runtime.frames.sock. Each launch runs `IDLE_CONTROLLER` through the SDK's
runner (`python -m l4m.controller`): it opens its session, loads the model (GetInfo), prints one line
and waits on `ctx.receive()`, an agent waiting on a tool. Once every controller has printed its line
and `--settle-s` has passed, the benchmark reads /proc/PID/smaps_rollup of every process of every
sandbox: the chain's first process (bubblewrap, as root), bubblewrap's pid-1 process in the sandbox's
pid namespace and the python process. USS = Private_Clean + Private_Dirty (what the process alone
holds: freed when it ends), PSS = Pss (shared pages split between their users), RSS = Rss.

Phases (`--phases`, comma-separated):
- `cold`: `--launches` controllers at once, with no warm pool: each sandbox starts python cold.
- `warm`: a warm pool of `--launches` sandboxes is filled and measured before any launch (an idle warm
  sandbox: the zygote, having imported the SDK, waits on stdin); then `--launches` controllers take the
  whole pool, the pool is closed (its refills destroyed), and the launched ones are measured.
- `many`: `--count` cold launches, `--concurrency` at a time, until `--deadline-s` or until the host's
  MemAvailable falls under `--min-available-gib` (the run stops launching then, and says so; launches
  in flight still land). Reports the sandboxes' summed USS/PSS/RSS; what the memory cgroup over the
  spawner's instances charges them (anonymous and kernel memory: what their limits count); the growth
  of /proc/meminfo's kernel fields and the fall of MemAvailable (both host-wide: whatever else runs
  moves them too); the growth of this process (the spawner) and of the scheduler; and 1,000 times the
  charge per controller, the extrapolation when 1,000 do not fit.

`--imports` instead prints where a plain process's memory goes: USS, RSS and anonymous memory after
each import of the runner's chain (`IMPORT_STEPS`), in a fresh interpreter with the sandbox's thread
variables. A single process counts its shared libraries' pages as unique, which they stop being once a
second sandbox maps the same files: the anonymous column is the part no other process can share.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import spawner as spawner_bench  # noqa: E402 (bench/spawner.py)
from spawner import Cluster, Spawner, running_spawner, scheduler_cluster  # noqa: E402

from l4m.spawner.cpu_priority import parent_pids  # noqa: E402
from l4m.spawner.sandbox import SANDBOX_THREAD_ENV  # noqa: E402
from l4m.spawner.supervisor import ExitEvent  # noqa: E402
from l4m.v1 import spawner_pb2  # noqa: E402

IDLE_LINE = b"idle: waiting on ctx.receive"
IDLE_CONTROLLER = b"""
async def main(ctx):
    # The runner opened the session and loaded the model (GetInfo) before calling main.
    print("idle: waiting on ctx.receive", ctx.model.name, flush=True)
    await ctx.receive()
"""
FRAMED_SOCKET_NAME = "scheduler.frames.sock"  # as l4m.cluster names it
LAUNCH_LIMITS = spawner_pb2.Limits(wall_time_ms=3_600_000, cpu_time_ms=600_000)
TARGET_USS_MIB = 15.0
IDLE_TIMEOUT_S = 120.0
MiB = 1024 * 1024
KiB = 1024
# The runner's imports, in the order a controller meets them, then a context's modules (its first use),
# then what a warm sandbox adds, then grpc (which only a program that opens a gRPC channel imports).
IMPORT_STEPS = (
    "asyncio", "google.protobuf.message", "l4m.v1.l4m_pb2", "l4m.v1.spawner_pb2", "l4m.session", "l4m.framed",
    "l4m.runtime", "l4m.model", "l4m.instance", "l4m.controller", "uvloop", "l4m.context",
    "numpy", "l4m.wire.brle", "l4m.constraint", "l4m.search", "l4m.drafter", "tokenizers", "llguidance", "grpc",
)  # fmt: skip


@dataclass
class Memory:
    """Summed over some processes, in bytes."""

    uss: int = 0
    pss: int = 0
    rss: int = 0
    anonymous: int = 0
    num_processes: int = 0

    def add(self, other: Memory) -> None:
        self.uss += other.uss
        self.pss += other.pss
        self.rss += other.rss
        self.anonymous += other.anonymous
        self.num_processes += other.num_processes


def process_memory(pid: int) -> Memory | None:
    """One process's memory from /proc/PID/smaps_rollup; None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    fields = {}
    for line in text.splitlines()[1:]:
        name, value, *_ = line.split()
        fields[name.rstrip(":")] = int(value) * KiB
    if "Rss" not in fields:  # a kernel thread, or a process exiting
        return None
    uss = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
    return Memory(uss, fields.get("Pss", 0), fields["Rss"], fields.get("Anonymous", 0), 1)


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


@dataclass
class SandboxMemory:
    total: Memory = field(default_factory=Memory)
    by_process: dict[str, Memory] = field(default_factory=dict)  # by command name: bwrap, python3...


def sandbox_memory(pids: list[int]) -> SandboxMemory:
    """The processes of one sandbox, summed and by command name."""
    found = SandboxMemory()
    for pid in pids:
        memory = process_memory(pid)
        if memory is None:
            continue
        found.total.add(memory)
        found.by_process.setdefault(process_name(pid), Memory()).add(memory)
    return found


def sandbox_roots(excluded: set[int]) -> list[int]:
    """This process's children other than `excluded` (the cluster's services): the spawner in this
    process starts each sandbox's chain as a child."""
    me = os.getpid()
    return sorted(pid for pid, parent in parent_pids().items() if parent == me and pid not in excluded)


def sandbox_trees(excluded: set[int]) -> list[list[int]]:
    """Each sandbox's processes (its chain's first process, exec'd into bubblewrap by now, and every
    descendant), from one scan of the process table."""
    children: dict[int, list[int]] = {}
    for pid, parent in parent_pids().items():
        children.setdefault(parent, []).append(pid)
    trees = []
    for root in sorted(set(children.get(os.getpid(), ())) - excluded):
        tree, frontier = [], [root]
        while frontier:
            pid = frontier.pop()
            tree.append(pid)
            frontier.extend(children.get(pid, ()))
        trees.append(sorted(tree))
    return trees


def service_pid(pids: set[int], module: str) -> int:
    """The one of `pids` running `python -m MODULE`."""
    for pid in pids:
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if module.encode() in argv:
                return pid
    raise RuntimeError(f"no {module} among {sorted(pids)}")


def meminfo() -> dict[str, int]:
    """/proc/meminfo, in bytes."""
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, value, *_ = line.split()
        fields[name.rstrip(":")] = int(value) * KiB
    return fields


def mem_available() -> int:
    return meminfo()["MemAvailable"]


# What the kernel holds for a sandbox beyond its processes' pages: page tables, thread stacks, slab
# (namespaces, mounts, cgroups, sockets...), tmpfs (/tmp) and per-CPU data (cgroups' counters).
KERNEL_FIELDS = ("PageTables", "KernelStack", "SUnreclaim", "SReclaimable", "Shmem", "Percpu")
CGROUP_MEMORY = Path("/sys/fs/cgroup/memory")


def cgroup_memory(spawner_id: str) -> dict[str, int]:
    """What the memory cgroup over this spawner's instances (cgroups.py: `l4m/<spawner id>`, hierarchical)
    charges: `usage` (what its limits count), `kmem` (kernel memory: page tables, stacks, slab), `rss`
    (anonymous), `cache` (page cache and tmpfs the sandboxes touched first); {} without cgroup v1 memory."""
    group = CGROUP_MEMORY / "l4m" / spawner_id
    try:
        stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
        return {
            "usage": int((group / "memory.usage_in_bytes").read_text()),
            "kmem": int((group / "memory.kmem.usage_in_bytes").read_text()),
            "rss": int(stat["total_rss"]),
            "cache": int(stat["total_cache"]),
        }
    except (OSError, KeyError, ValueError):
        return {}


@dataclass(frozen=True)
class Row:
    what: str
    num_sandboxes: int
    uss_mib_median: float
    uss_mib_max: float
    pss_mib_median: float
    rss_mib_median: float
    anonymous_mib_median: float
    python_uss_mib_median: float  # the python process alone
    bwrap_uss_mib_median: float  # both bubblewrap processes
    processes_per_sandbox: float


def summarize(what: str, sandboxes: list[SandboxMemory]) -> Row:
    def median(values: list[int]) -> float:
        return statistics.median(values) / MiB if values else float("nan")

    totals = [sandbox.total for sandbox in sandboxes]
    python = [m.uss for s in sandboxes for name, m in s.by_process.items() if name.startswith("python")]
    bwrap = [s.by_process["bwrap"].uss for s in sandboxes if "bwrap" in s.by_process]
    return Row(
        what,
        len(sandboxes),
        median([m.uss for m in totals]),
        max((m.uss for m in totals), default=0) / MiB,
        median([m.pss for m in totals]),
        median([m.rss for m in totals]),
        median([m.anonymous for m in totals]),
        median(python),
        median(bwrap),
        statistics.mean(m.num_processes for m in totals) if totals else 0.0,
    )


def print_rows(rows: list[Row]) -> None:
    header = (f"{'what':<34} {'n':>5} {'USS MiB':>8} {'max':>6} {'PSS':>6} {'RSS':>6} {'anon':>6} "
              f"{'python USS':>10} {'bwrap USS':>9} {'procs':>5}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r.what:<34} {r.num_sandboxes:>5} {r.uss_mib_median:>8.1f} {r.uss_mib_max:>6.1f} "
              f"{r.pss_mib_median:>6.1f} {r.rss_mib_median:>6.1f} {r.anonymous_mib_median:>6.1f} "
              f"{r.python_uss_mib_median:>10.1f} {r.bwrap_uss_mib_median:>9.1f} {r.processes_per_sandbox:>5.1f}")  # fmt: skip
    print("(medians per sandbox; USS/PSS/RSS summed over the sandbox's processes: bwrap, its pid 1, python)")


# -- launching -------------------------------------------------------------------------------------


async def launch_idle(spawner: Spawner) -> tuple[str, int] | None:
    """Launches `IDLE_CONTROLLER` detached and waits for its line: (instance id, first pid), or None if
    it ended or said something else first."""
    launched = await spawner.stub.Launch(
        spawner_pb2.LaunchRequest(program=spawner.program_sha256, limits=LAUNCH_LIMITS, detached=True),
        timeout=IDLE_TIMEOUT_S,
    )
    supervisor = spawner.server.manager.get(launched.instance_id).supervisor
    first = b""
    async with asyncio.timeout(IDLE_TIMEOUT_S):
        async for event in supervisor.subscribe():
            first = b"" if isinstance(event, ExitEvent) else event.data
            break
    if not first.startswith(IDLE_LINE):
        print(f"  {launched.instance_id} did not go idle: {first[:300]!r}", file=sys.stderr)
        return None
    return launched.instance_id, supervisor.is_warm


async def launch_many(
    spawner: Spawner, count: int, concurrency: int, deadline_s: float, min_available: int
) -> tuple[int, int, str]:
    """Up to `count` idle controllers, `concurrency` launches in flight; stops early at the deadline or
    when MemAvailable falls under `min_available`. Returns (idle, warm among them, why it stopped)."""
    deadline = time.monotonic() + deadline_s
    semaphore = asyncio.Semaphore(concurrency)
    num_idle = num_warm = num_started = 0
    stopped = ""

    async def one() -> None:
        nonlocal num_idle, num_warm
        try:
            result = await launch_idle(spawner)
        except Exception as error:  # noqa: BLE001 - counted as not idle, the run goes on
            print(f"  launch failed: {type(error).__name__}: {error}"[:400], file=sys.stderr)
            result = None
        finally:
            semaphore.release()
        if result is not None:
            num_idle += 1
            num_warm += result[1]

    tasks = []
    while num_started < count:
        await semaphore.acquire()
        if time.monotonic() > deadline:
            stopped = f"the {deadline_s:.0f} s deadline"
        elif mem_available() < min_available:
            stopped = f"MemAvailable under {min_available / MiB / 1024:.1f} GiB"
        if stopped:
            semaphore.release()
            break
        num_started += 1
        tasks.append(asyncio.create_task(one()))
        if num_started % 100 == 0:
            print(f"  {num_started} launched, {num_idle} idle, MemAvailable {mem_available() / MiB / 1024:.1f} GiB",
                  file=sys.stderr)  # fmt: skip
    await asyncio.gather(*tasks)
    return num_idle, num_warm, stopped or "the count"


def measure_all(cluster_pids: set[int]) -> list[SandboxMemory]:
    return [sandbox_memory(tree) for tree in sandbox_trees(cluster_pids)]


# -- phases ----------------------------------------------------------------------------------------


async def phase_cold(
    cluster: Cluster, root: Path, cluster_pids: set[int], num: int, settle_s: float, overrides: dict
) -> list[Row]:
    async with running_spawner("process", cluster, root / "cold", 0, IDLE_CONTROLLER, **overrides) as spawner:
        num_idle, _, _ = await launch_many(spawner, num, num, IDLE_TIMEOUT_S, 0)
        await asyncio.sleep(settle_s)
        sandboxes = measure_all(cluster_pids)
        return [summarize(f"cold launch, idle ({num_idle} ok)", sandboxes)]


async def phase_warm(
    cluster: Cluster, root: Path, cluster_pids: set[int], num: int, settle_s: float, overrides: dict
) -> list[Row]:
    async with running_spawner(
        "process-warm", cluster, root / "warm", num, IDLE_CONTROLLER, **overrides
    ) as spawner:
        await asyncio.sleep(settle_s)
        rows = [summarize("warm sandbox, before its launch", measure_all(cluster_pids))]
        num_idle, num_warm, _ = await launch_many(spawner, num, num, IDLE_TIMEOUT_S, 0)
        await spawner.server.manager.sandbox.close()  # destroys the refills: what is left was launched
        await asyncio.sleep(settle_s)
        rows.append(summarize(f"warm launch, idle ({num_warm}/{num_idle} warm)", measure_all(cluster_pids)))
        return rows


@dataclass(frozen=True)
class Many:
    num_asked: int
    num_idle: int
    num_warm: int
    stopped_at: str
    launch_wall_s: float
    sandboxes_uss_mib: float
    sandboxes_pss_mib: float
    sandboxes_rss_mib: float
    per_controller_uss_mib: float
    per_controller_pss_mib: float
    mem_available_drop_mib: float  # MemAvailable before the launches minus after (whole host)
    per_controller_available_drop_mib: float
    spawner_rss_growth_mib: float  # this process, which runs the spawner
    scheduler_rss_growth_mib: float
    # 1000 x (the cgroup's charge per controller, else its USS + kernel growth, + the spawner's and the
    # scheduler's growth per controller); MemAvailable moves with everything else the host runs.
    extrapolated_1000_gib: float
    kernel_mib_per_controller: dict[str, float]  # growth of KERNEL_FIELDS in /proc/meminfo, per controller
    cgroup_mib_per_controller: dict[str, float]  # `cgroup_memory` of the spawner's instances, per controller


def rss(pid: int) -> int:
    memory = process_memory(pid)
    return memory.rss if memory else 0


async def phase_many(cluster: Cluster, root: Path, cluster_pids: set[int], scheduler_pid: int, args: argparse.Namespace,
                     overrides: dict) -> Many:  # fmt: skip
    pool = args.pool_size if args.many_warm else 0
    backend = "process-warm" if args.many_warm else "process"
    async with running_spawner(
        backend, cluster, root / "many", pool, IDLE_CONTROLLER, **overrides
    ) as spawner:
        await spawner.server.manager.sandbox.close()  # the pool's idle sandboxes are not controllers
        await asyncio.sleep(args.settle_s)
        info_before, spawner_before, scheduler_before = meminfo(), rss(os.getpid()), rss(scheduler_pid)
        started = time.monotonic()
        num_idle, num_warm, stopped = await launch_many(
            spawner, args.count, args.concurrency, args.deadline_s, int(args.min_available_gib * 1024 * MiB)
        )
        wall_s = time.monotonic() - started
        await asyncio.sleep(args.settle_s)
        sandboxes = measure_all(cluster_pids)
        total = Memory()
        for sandbox in sandboxes:
            total.add(sandbox.total)
        info_after = meminfo()
        drop = info_before["MemAvailable"] - info_after["MemAvailable"]
        n = max(1, len(sandboxes))
        kernel = {
            name: (info_after.get(name, 0) - info_before.get(name, 0)) / MiB / n for name in KERNEL_FIELDS
        }
        charged = cgroup_memory(spawner.server.manager.sandbox.config.spawner_id)
        cgroup = {name: value / MiB / n for name, value in charged.items()}
        spawner_growth, scheduler_growth = (
            rss(os.getpid()) - spawner_before,
            rss(scheduler_pid) - scheduler_before,
        )
        sandbox_mib = cgroup.get("usage", total.uss / MiB / n + sum(kernel.values()))
        extrapolated_gib = 1000 * (sandbox_mib + (spawner_growth + scheduler_growth) / MiB / n) / 1024
        result = Many(
            args.count, num_idle, num_warm, stopped, wall_s, total.uss / MiB, total.pss / MiB, total.rss / MiB,
            total.uss / MiB / n, total.pss / MiB / n, drop / MiB, drop / MiB / n,
            spawner_growth / MiB, scheduler_growth / MiB, extrapolated_gib, kernel, cgroup,
        )  # fmt: skip
        print(f"  {len(sandboxes)} sandboxes alive; stopping them", file=sys.stderr)
        return result


def print_many(many: Many) -> None:
    print(f"many: {many.num_idle}/{many.num_asked} idle controllers ({many.num_warm} warm) in {many.launch_wall_s:.0f} s, "
          f"stopped at {many.stopped_at}")  # fmt: skip
    print(f"  sandboxes' USS {many.sandboxes_uss_mib:.0f} MiB ({many.per_controller_uss_mib:.1f} per controller), "
          f"PSS {many.sandboxes_pss_mib:.0f} MiB ({many.per_controller_pss_mib:.1f} per controller), "
          f"RSS {many.sandboxes_rss_mib:.0f} MiB")  # fmt: skip
    print(f"  host MemAvailable fell {many.mem_available_drop_mib:.0f} MiB ({many.per_controller_available_drop_mib:.1f} "
          "per controller: noisy, the host's other work moves it too)")  # fmt: skip
    kernel = ", ".join(f"{name} {mib:.2f}" for name, mib in many.kernel_mib_per_controller.items())
    print(f"  kernel memory per controller (MiB, /proc/meminfo growth): {kernel}")
    charged = ", ".join(f"{name} {mib:.1f}" for name, mib in many.cgroup_mib_per_controller.items())
    print(f"  the instances' memory cgroup per controller (MiB): {charged or 'no cgroup v1 memory'}")
    print(f"  spawner (this process) RSS +{many.spawner_rss_growth_mib:.0f} MiB, scheduler RSS "
          f"+{many.scheduler_rss_growth_mib:.0f} MiB")  # fmt: skip
    print(
        f"  1000 idle controllers at this rate: {many.extrapolated_1000_gib:.1f} GiB "
        "(cgroup charge + spawner and scheduler growth, per controller, x1000)"
    )


# -- the import breakdown --------------------------------------------------------------------------

_IMPORT_PROBE = r"""
import importlib, json, os, sys
def memory():
    fields = {}
    for line in open("/proc/self/smaps_rollup").read().splitlines()[1:]:
        name, value, *_ = line.split()
        fields[name.rstrip(":")] = int(value)
    return (fields["Private_Clean"] + fields["Private_Dirty"], fields["Rss"], fields["Anonymous"])
steps = [("(interpreter)", *memory())]
for name in sys.argv[1:]:
    importlib.import_module(name)
    steps.append((name, *memory()))
print(json.dumps(steps))
"""


def import_breakdown(modules: tuple[str, ...] = IMPORT_STEPS) -> list[tuple[str, float, float, float]]:
    """(module, USS MiB, RSS MiB, anonymous MiB) after each import, cumulative, in a fresh interpreter."""
    env = {**os.environ, **SANDBOX_THREAD_ENV, "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([sys.executable, "-c", _IMPORT_PROBE, *modules], env=env, capture_output=True,
                          text=True, check=True, timeout=120)  # fmt: skip
    return [
        (name, uss / 1024, rss_kib / 1024, anon / 1024)
        for name, uss, rss_kib, anon in json.loads(done.stdout)
    ]


def print_breakdown(steps: list[tuple[str, float, float, float]]) -> None:
    print(f"{'after importing':<26} {'USS MiB':>8} {'+':>6} {'anon MiB':>9} {'+':>6} {'RSS MiB':>8}")
    previous = steps[0]
    for step in steps:
        print(f"{step[0]:<26} {step[1]:>8.1f} {step[1] - previous[1]:>+6.1f} {step[3]:>9.1f} "
              f"{step[3] - previous[3]:>+6.1f} {step[2]:>8.1f}")  # fmt: skip
        previous = step


# -- main ------------------------------------------------------------------------------------------


def _raise_open_files() -> None:
    """Each sandbox costs this process (the spawner) and the scheduler a few descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--phases", default="cold,warm", help="cold, warm, many (comma-separated)")
    parser.add_argument(
        "--launches", type=int, default=8, help="controllers (and warm sandboxes) measured per phase"
    )
    parser.add_argument("--count", type=int, default=1000, help="idle controllers for the many phase")
    parser.add_argument("--concurrency", type=int, default=16, help="launches in flight in the many phase")
    parser.add_argument(
        "--deadline-s", type=float, default=600.0, help="the many phase stops launching after this"
    )
    parser.add_argument(
        "--min-available-gib",
        type=float,
        default=6.0,
        help="the many phase stops launching when the host's MemAvailable falls under this",
    )
    parser.add_argument(
        "--many-warm", action="store_true", help="the many phase launches through a warm pool"
    )
    parser.add_argument("--pool-size", type=int, default=4, help="warm pool for --many-warm")
    parser.add_argument("--settle-s", type=float, default=2.0, help="wait before measuring")
    parser.add_argument(
        "--pool-fill-timeout-s",
        type=float,
        default=600.0,
        help="how long a warm pool may take to fill (its starts run on idle CPU: a busy host delays them)",
    )
    parser.add_argument("--imports", action="store_true", help="instead: the import breakdown")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    if args.imports:
        steps = import_breakdown()
        print_breakdown(steps)
        if args.json:
            args.json.write_text(json.dumps(steps, indent=1))
        return 0
    _raise_open_files()
    spawner_bench.POOL_FILL_TIMEOUT_S = args.pool_fill_timeout_s
    load_before = os.getloadavg()
    phases = args.phases.split(",")
    if unknown := set(phases) - {"cold", "warm", "many"}:
        parser.error(f"unknown phase(s) {sorted(unknown)}")
    most = max(args.launches, args.count if "many" in phases else 0) + 64
    # The spawner's and the scheduler's admission limits, opened for one user's `most` idle controllers.
    overrides = dict(
        scheduler_framed_socket_name=FRAMED_SOCKET_NAME, max_instances=most, max_instances_per_user=most,
        max_memory_bytes_per_user=most * 512 * MiB, max_wall_time_s_per_user=most * 3600.0,
    )  # fmt: skip
    rows: list[Row] = []
    many: Many | None = None
    with tempfile.TemporaryDirectory(prefix="l4m-bench-memory-") as directory:
        root = Path(directory)
        scheduler_args = (
            "--listen-framed",
            str(root / "sockets" / FRAMED_SOCKET_NAME),
            "--max-instances",
            str(most),
        )
        async with scheduler_cluster(root, scheduler_args) as cluster:
            cluster_pids = set(sandbox_roots(set()))  # the executor and the scheduler, so far
            scheduler_pid = service_pid(cluster_pids, "l4m.scheduler")
            for phase in phases:
                if phase == "cold":
                    rows += await phase_cold(
                        cluster, root, cluster_pids, args.launches, args.settle_s, overrides
                    )
                elif phase == "warm":
                    rows += await phase_warm(
                        cluster, root, cluster_pids, args.launches, args.settle_s, overrides
                    )
                else:
                    many = await phase_many(cluster, root, cluster_pids, scheduler_pid, args, overrides)
    if rows:
        print_rows(rows)
        for row in rows:
            if row.what.startswith(("cold launch", "warm launch")):
                verdict = "meets" if row.uss_mib_median <= TARGET_USS_MIB else "misses"
                print(f"{row.what}: {row.uss_mib_median:.1f} MiB unique per idle controller {verdict} the "
                      f"{TARGET_USS_MIB:.0f} MiB goal")  # fmt: skip
    if many is not None:
        print_many(many)
    load = f"{load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after"
    print(f"host load average (1 min): {load} ({os.cpu_count()} CPUs)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        results = {"rows": [asdict(r) for r in rows], "many": asdict(many) if many else None, "load": load}
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(asyncio.run(main()))
