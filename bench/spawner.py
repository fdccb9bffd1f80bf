"""Launch-to-first-command latency: from a user's `Launch` call to the moment the scheduler has answered
the controller's first L4M command.

    flock -x /tmp/l4m-bench.lock .venv/bin/python bench/spawner.py          # every backend
    flock -x /tmp/l4m-bench.lock .venv/bin/python bench/spawner.py --backends process,process-warm --launches 50

The benchmark starts a real scheduler (`python -m l4m.scheduler`, listening on `scheduler.sock` in the
sandbox socket directory, its registry on `internal/registry.sock` behind a cluster secret, as `l4m up`
lays them out) on a simulated executor (`python -m l4m.scheduler.simulated`: no model, so
the command's answer costs the executor nothing), and for each backend a real spawner in this process
(`create_server`, the function `python -m l4m.spawner` serves with), launching through its
SpawnerService over gRPC as a user would. Each launch runs `CONTROLLER`, an `async def main(ctx)`
program, through the SDK's runner (`python -m l4m.controller`): the spawner registers the instance's
token with the scheduler, starts the sandbox; the runner imports the SDK, opens its L4M session with
the token and sends GetInfo (`Model.load`); once the scheduler has answered, `main` prints one line.
The latency is `Launch` called → that line read by the spawner (the instance's first output, checked
to be that line).

Backends: `process` (bubblewrap, every launch cold), `process-warm` (bubblewrap with a warm pool of
`--pool-size` sandboxes that have imported the SDK already), `docker`. For each: `--launches`
launches one after another (p50/p99), then `--concurrent` launches at once (the same latencies under
load, and the wall time for all of them). `process-warm` runs the sequential launches twice:
"refilled" waits (untimed) for a full pool before each launch, the latency while launches come slower
than the pool refills; "back-to-back" does not wait, so launches that find the pool empty start cold.
The `warm` column counts launches served by a warm sandbox. `--concurrent` takes a list (`16,64`), each
burst repeated `--repeats` times; a burst waits for a full pool first, and the second table gives the
spawner's CPU per launch (this process's CPU time, every thread, the benchmark's own gRPC client
included) in three windows: `hand-over`, from the burst's start to the last `Launch` answered;
`run+exit`, from then until every instance has exited and been reported; `refill`, from then until the
pool is full again (`refill s` counts from the burst's start). `load` is the 1-minute load average.

    flock -x /tmp/l4m-bench.lock taskset -c 0,1 .venv/bin/python bench/spawner.py --backends process-warm \
        --launches 0 --concurrent 16,64 --pool-size 64 --repeats 2

Runs as root (the process sandbox switches
uids); the docker backend needs a running engine (`scripts/ci/docker-engine.sh` starts one,
`scripts/ci/base-image.sh` builds the base image) and builds the controller image on first use.
Target: process sandbox p50 ≤ 150 ms.

`--refill` measures the warm pool's refill instead (warm sandboxes start at idle CPU priority, see
docs/operations.md): `--rounds` times, a burst of `--pool-size` launches takes the whole pool and the
time until it is full again is printed, first on a quiet machine, then with `--hogs` busy loops
(`while True: pass`, nice 0, each in its own session like a separate service), with the share of a
core each hog kept meanwhile. A refill waits for idle CPU, so with a hog per core it takes as long as
the hogs leave none (up to `--max-wait-s`).

    flock -x /tmp/l4m-bench.lock .venv/bin/python bench/spawner.py --refill --hogs 2 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc

from l4m.spawner.config import SpawnerConfig
from l4m.spawner.sandbox import ExitReason
from l4m.spawner.server import SpawnerServer, create_server
from l4m.spawner.supervisor import ExitEvent, InstanceSupervisor
from l4m.v1 import spawner_pb2, spawner_pb2_grpc
from l4m.wire.credentials import write_secret_file

MARKER = b"first command answered"
CONTROLLER = b"""
async def main(ctx):
    # The runner's Model.load sent GetInfo, this instance's first L4M command, and the scheduler
    # answered it before main was called: this line ends the timed interval.
    print("first command answered by", ctx.model.name, flush=True)
"""
HOG = "while True: pass"
HOG_SETTLE_S = 1.0
TARGET_PROCESS_P50_MS = 150.0
# A pool fills at idle CPU priority: on a machine busy with other work, a pool of 64 takes minutes.
POOL_FILL_TIMEOUT_S = 900.0
SERVICE_START_TIMEOUT_S = 60.0
RPC_DEADLINE_S = 120.0
_LISTENING_RE = re.compile(rb"listening on [\w.]+:(\d+)")


@dataclass(frozen=True)
class Launch:
    latency_ms: float | None  # None: it did not exit cleanly, or its first output was not MARKER
    is_warm: bool


@dataclass(frozen=True)
class BurstCost:
    """What a burst of launches cost the spawner (see the module docstring's windows)."""

    handover_s: float  # burst start -> the last Launch answered
    refill_s: float  # burst start -> the pool full again (0 without a pool)
    handover_cpu_ms: float  # per launch, each window's CPU divided by the burst's launches
    run_exit_cpu_ms: float
    refill_cpu_ms: float
    load_average: float  # 1-minute, at the burst's start


@dataclass(frozen=True)
class Row:
    backend: str
    mode: str
    num_launches: int
    num_ok: int
    num_warm: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    wall_s: float
    burst: BurstCost | None = None  # the `N at once` rows


@dataclass(frozen=True)
class Cluster:
    socket_dir: Path
    registry_address: str  # the spawner's --scheduler: the scheduler's --registry-listen
    secret_file: Path  # the cluster secret the registry requires


async def start_service(
    module: str, args: list[str], log_path: Path
) -> tuple[asyncio.subprocess.Process, int]:
    """`python -m MODULE ARGS`, its output in `log_path`; returns once it prints its port."""
    log = open(log_path, "wb")  # noqa: SIM115 - the child holds it; closed when this process ends
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", module, *args, stdout=log, stderr=asyncio.subprocess.STDOUT
    )
    deadline = time.monotonic() + SERVICE_START_TIMEOUT_S
    while time.monotonic() < deadline and process.returncode is None:
        match = _LISTENING_RE.search(log_path.read_bytes())
        if match:
            return process, int(match.group(1))
        await asyncio.sleep(0.05)
    process.kill()
    raise RuntimeError(f"{module} did not start:\n{log_path.read_bytes()[-4000:].decode(errors='replace')}")


@contextlib.asynccontextmanager
async def scheduler_cluster(root: Path, scheduler_args: tuple[str, ...] = ()) -> AsyncIterator[Cluster]:
    """A simulated executor and a scheduler whose Unix socket lies in the sandbox socket directory. Not
    anonymous: every session must present a token the spawner registered, as in production.
    `scheduler_args`: more of the scheduler's flags (bench/memory.py adds `--listen-framed`)."""
    socket_dir = root / "sockets"
    socket_dir.mkdir(mode=0o755)
    internal_dir = root / "internal"  # the control plane: never in the sandboxes' socket directory
    secret_file = internal_dir / "cluster.secret"
    write_secret_file(secret_file)
    processes = []
    try:
        executor, executor_port = await start_service(
            "l4m.scheduler.simulated", ["--listen", "127.0.0.1:0"], root / "executor.log"
        )
        processes.append(executor)
        scheduler_socket = socket_dir / "scheduler.sock"
        registry_address = f"unix:{internal_dir / 'registry.sock'}"
        scheduler, _ = await start_service(
            "l4m.scheduler",
            ["--executor", f"127.0.0.1:{executor_port}", "--listen", "127.0.0.1:0",
             "--listen-unix", str(scheduler_socket), "--registry-listen", registry_address,
             "--cluster-secret-file", str(secret_file), "--log-level", "WARNING", *scheduler_args],
            root / "scheduler.log",
        )  # fmt: skip
        processes.append(scheduler)
        yield Cluster(socket_dir, registry_address, secret_file)
    finally:
        for process in reversed(processes):
            if process.returncode is None:
                process.terminate()
            await process.wait()


async def launch_once(
    server: SpawnerServer,
    stub: spawner_pb2_grpc.SpawnerServiceStub,
    sha: str,
    on_answered: Callable[[], None] | None = None,
) -> Launch:
    """Milliseconds from `Launch` to the controller's line after its first command, and whether a warm
    sandbox served it. `on_answered` is called once `Launch` has answered."""
    started = time.monotonic()
    launched = await stub.Launch(spawner_pb2.LaunchRequest(program=sha), timeout=RPC_DEADLINE_S)
    if on_answered is not None:
        on_answered()
    supervisor = server.manager.get(launched.instance_id).supervisor
    info = await supervisor.wait()
    first = await first_output(supervisor)
    if info.reason is not ExitReason.EXITED or not first.startswith(MARKER):
        print(f"  launch failed: {info}; first output {first[:200]!r}", file=sys.stderr)
        return Launch(None, supervisor.is_warm)
    assert supervisor.first_output_at_monotonic_s is not None
    return Launch((supervisor.first_output_at_monotonic_s - started) * 1000, supervisor.is_warm)


async def first_output(supervisor: InstanceSupervisor) -> bytes:
    """The first chunk the instance wrote (on either stream), from the supervisor's replay."""
    async for event in supervisor.subscribe():
        return b"" if isinstance(event, ExitEvent) else event.data
    return b""


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def summarize(
    backend: str, mode: str, launches: list[Launch], wall_s: float, burst: BurstCost | None = None
) -> Row:
    ok = [launch.latency_ms for launch in launches if launch.latency_ms is not None]
    num_warm = sum(launch.is_warm for launch in launches)
    if not ok:
        nan = float("nan")
        return Row(backend, mode, len(launches), 0, num_warm, nan, nan, nan, wall_s, burst)
    p50, p99 = statistics.median(ok), percentile(ok, 0.99)
    return Row(backend, mode, len(launches), len(ok), num_warm, p50, p99, max(ok), wall_s, burst)


async def wait_pool_full(server: SpawnerServer) -> None:
    wait = getattr(server.manager.sandbox, "wait_warm_pool_full", None)
    if wait is not None:
        await asyncio.wait_for(wait(), POOL_FILL_TIMEOUT_S)


@dataclass(frozen=True)
class Spawner:
    server: SpawnerServer
    stub: spawner_pb2_grpc.SpawnerServiceStub
    program_sha256: str  # CONTROLLER, uploaded


@contextlib.asynccontextmanager
async def running_spawner(
    backend: str,
    cluster: Cluster,
    root: Path,
    pool_size: int,
    controller: bytes = CONTROLLER,
    **overrides: Any,
) -> AsyncIterator[Spawner]:
    """A spawner for `backend` in this process, `controller` uploaded, its warm pool (if any) full.
    `overrides`: more `SpawnerConfig` fields."""
    config = SpawnerConfig(
        state_dir=root / backend,
        socket_dir=cluster.socket_dir,
        listen_address="127.0.0.1:0",
        spawner_id=f"bench-{uuid.uuid4().hex[:6]}",
        sandbox_kind="docker" if backend == "docker" else "process",
        scheduler_registry_address=cluster.registry_address,
        cluster_secret_file=cluster.secret_file,
        insecure_local=True,  # the benchmark is the only user, on loopback
        warm_pool_size=pool_size if backend == "process-warm" else 0,
        **overrides,
    )
    server = await create_server(config)
    print(f"{backend}: {json.dumps(server.manager.sandbox.enforcement())}", file=sys.stderr)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = spawner_pb2_grpc.SpawnerServiceStub(channel)
            upload = [
                spawner_pb2.UploadProgramRequest(
                    header=spawner_pb2.ProgramHeader(size_bytes=len(controller))
                ),
                spawner_pb2.UploadProgramRequest(chunk=controller),
            ]
            sha = (await stub.UploadProgram(iter(upload), timeout=RPC_DEADLINE_S)).sha256
            await wait_pool_full(server)
            yield Spawner(server, stub, sha)
    finally:
        await server.stop(None)
        remove_cgroup_parents = getattr(server.manager.sandbox, "remove_cgroup_parents", None)
        if remove_cgroup_parents is not None:
            remove_cgroup_parents()


async def bench_backend(
    backend: str,
    cluster: Cluster,
    root: Path,
    pool_size: int,
    num_launches: int,
    bursts: list[int],
    num_repeats: int = 1,
) -> list[Row]:
    async with running_spawner(backend, cluster, root, pool_size) as spawner:
        server, stub, sha = spawner.server, spawner.stub, spawner.program_sha256
        await launch_once(server, stub, sha)  # warms the page cache (for docker, the image layers)
        modes = (
            [("refilled", True), ("back-to-back", False)]
            if backend == "process-warm"
            else [("sequential", False)]
        )
        rows = []
        for mode, wait_refilled in modes if num_launches else ():
            started, launches = time.monotonic(), []
            for _ in range(num_launches):
                if wait_refilled:
                    await wait_pool_full(server)
                launches.append(await launch_once(server, stub, sha))
            rows.append(summarize(backend, mode, launches, time.monotonic() - started))
        for num_concurrent in bursts:
            for _ in range(num_repeats):
                rows.append(await burst_once(backend, spawner, num_concurrent))
        return rows


async def burst_once(backend: str, spawner: Spawner, num_launches: int) -> Row:
    """`num_launches` launches at once through a full pool: their latencies, and the spawner's CPU
    per launch in each window (hand-over, run+exit, refill)."""
    server, stub, sha = spawner.server, spawner.stub, spawner.program_sha256
    await wait_pool_full(server)
    num_answered, handover = 0, (0.0, 0.0)  # (monotonic s, CPU s) when the last Launch answered

    def on_answered() -> None:
        nonlocal num_answered, handover
        num_answered += 1
        if num_answered == num_launches:
            handover = (time.monotonic(), time.process_time())

    load_average = os.getloadavg()[0]
    print(f"{backend}: a burst of {num_launches} launches", file=sys.stderr, flush=True)
    started, cpu_started = time.monotonic(), time.process_time()
    launches = await asyncio.gather(
        *(launch_once(server, stub, sha, on_answered) for _ in range(num_launches))
    )
    exited, cpu_exited = time.monotonic(), time.process_time()
    await wait_pool_full(server)
    full, cpu_full = time.monotonic(), time.process_time()
    has_pool = getattr(server.manager.sandbox, "warm_pool_stats", lambda: None)() is not None
    cost = BurstCost(
        handover_s=handover[0] - started,
        refill_s=full - started if has_pool else 0.0,
        handover_cpu_ms=1000 * (handover[1] - cpu_started) / num_launches,
        run_exit_cpu_ms=1000 * (cpu_exited - handover[1]) / num_launches,
        refill_cpu_ms=1000 * (cpu_full - cpu_exited) / num_launches,
        load_average=load_average,
    )
    return summarize(backend, f"{num_launches} at once", list(launches), exited - started, cost)


# -- refill under load ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Refill:
    num_hogs: int
    refill_s: float | None  # None: the pool was not full again within the wait
    hog_cpu_percent: list[float]  # each hog's share of one core during the refill
    num_start_failures: int


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (/proc/<pid>/stat, fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def refill_once(spawner: Spawner, pool_size: int, num_hogs: int, max_wait_s: float) -> Refill:
    """Takes the whole pool with `pool_size` launches while `num_hogs` busy loops run, and times how
    long the pool takes to be full again, from the first launch."""
    # Each hog in a session of its own, as a separate service (the executor) would be.
    hogs = [subprocess.Popen([sys.executable, "-c", HOG], start_new_session=True) for _ in range(num_hogs)]
    try:
        await asyncio.sleep(HOG_SETTLE_S)
        started, cpu_before = time.monotonic(), [process_cpu_s(hog.pid) for hog in hogs]
        launches = [
            launch_once(spawner.server, spawner.stub, spawner.program_sha256) for _ in range(pool_size)
        ]
        served = await asyncio.gather(*launches)
        assert all(launch.is_warm for launch in served), "the pool was not full before the round"
        refill_s: float | None = None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(spawner.server.manager.sandbox.wait_warm_pool_full(), max_wait_s)
            refill_s = time.monotonic() - started
        elapsed_s = time.monotonic() - started
        shares = [
            100 * (process_cpu_s(hog.pid) - before) / elapsed_s
            for hog, before in zip(hogs, cpu_before, strict=True)
        ]
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    await wait_pool_full(spawner.server)
    stats = spawner.server.manager.sandbox.warm_pool_stats()
    return Refill(num_hogs, refill_s, shares, stats.num_start_failures)


async def bench_refill(
    cluster: Cluster, root: Path, pool_size: int, num_hogs: int, num_rounds: int, max_wait_s: float
) -> list[Refill]:
    async with running_spawner("process-warm", cluster, root, pool_size) as spawner:
        return [
            await refill_once(spawner, pool_size, hogs, max_wait_s)
            for hogs in (0, num_hogs)
            for _ in range(num_rounds)
        ]


def print_refills(refills: list[Refill], max_wait_s: float) -> None:
    print(f"{'hogs':>4} {'refill s':>9} {'hog CPU % of a core':<22} {'start failures':>14}")
    for refill in refills:
        refill_s = (
            f"{refill.refill_s:9.2f}" if refill.refill_s is not None else f"{'>' + str(int(max_wait_s)):>9}"
        )
        shares = ", ".join(f"{share:.0f}" for share in refill.hog_cpu_percent) or "-"
        print(f"{refill.num_hogs:>4} {refill_s} {shares:<22} {refill.num_start_failures:>14}")


def print_table(rows: list[Row]) -> None:
    header = f"{'backend':<12} {'mode':<12} {'ok':>7} {'warm':>4} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'wall s':>7}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row.backend:<12} {row.mode:<12} {row.num_ok:>3}/{row.num_launches:<3} {row.num_warm:>4} "
            f"{row.p50_ms:>8.1f} {row.p99_ms:>8.1f} {row.max_ms:>8.1f} {row.wall_s:>7.2f}"
        )
    bursts = [row for row in rows if row.burst is not None]
    if not bursts:
        return
    print()
    header = (
        f"{'backend':<12} {'burst':>5} {'hand-over s':>11} {'refill s':>8} "
        f"{'spawner CPU ms/launch: hand-over':>32} {'run+exit':>8} {'refill':>7} {'load':>5}"
    )
    print(header)
    print("-" * len(header))
    for row in bursts:
        cost = row.burst
        assert cost is not None
        print(
            f"{row.backend:<12} {row.num_launches:>5} {cost.handover_s:>11.2f} {cost.refill_s:>8.1f} "
            f"{cost.handover_cpu_ms:>32.1f} {cost.run_exit_cpu_ms:>8.1f} {cost.refill_cpu_ms:>7.1f} "
            f"{cost.load_average:>5.1f}"
        )


async def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backends", default="process,process-warm,docker")
    parser.add_argument("--pool-size", type=int, default=2, help="warm sandboxes for process-warm")
    parser.add_argument("--launches", type=int, default=30, help="sequential launches per backend")
    parser.add_argument(
        "--concurrent", default="50", help="launches started at once; a list (16,64) runs a burst of each"
    )
    parser.add_argument("--repeats", type=int, default=1, help="bursts of each --concurrent size")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument(
        "--refill",
        action="store_true",
        help="instead: time process-warm pool refills with and without --hogs busy loops",
    )
    parser.add_argument("--hogs", type=int, default=2, help="busy loops for --refill (one per core)")
    parser.add_argument("--rounds", type=int, default=3, help="refills timed per number of hogs")
    parser.add_argument("--max-wait-s", type=float, default=300.0, help="how long a refill may take")
    args = parser.parse_args()

    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="l4m-bench-") as directory:
        root = Path(directory)
        async with scheduler_cluster(root) as cluster:
            if args.refill:
                refills = await bench_refill(
                    cluster, root, args.pool_size, args.hogs, args.rounds, args.max_wait_s
                )
                print_refills(refills, args.max_wait_s)
                if args.json:
                    args.json.parent.mkdir(parents=True, exist_ok=True)
                    args.json.write_text(json.dumps([asdict(refill) for refill in refills], indent=1))
                return 0
            bursts = [int(size) for size in args.concurrent.split(",") if size]
            for backend in args.backends.split(","):
                rows += await bench_backend(
                    backend, cluster, root, args.pool_size, args.launches, bursts, args.repeats
                )
    print_table(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(row) for row in rows], indent=1))
    for row in rows:
        if row.backend.startswith("process") and row.mode in ("sequential", "refilled"):
            verdict = "meets" if row.p50_ms <= TARGET_PROCESS_P50_MS else "misses"
            print(
                f"{row.backend} sandbox p50 {row.p50_ms:.1f} ms ({row.mode}) {verdict} "
                f"the {TARGET_PROCESS_P50_MS:.0f} ms target"
            )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
