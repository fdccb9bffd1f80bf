"""Sandbox launch latency: launch → first output line of a controller that has imported what the
SDK's runner (`python -m l4m.controller`) imports before its first command (grpc, protobuf, the
session, model, runtime and context layers). The first command itself is a round trip to the
scheduler on top, which this benchmark leaves out so that it needs no scheduler.

    .venv/bin/python bench/spawner.py                      # every backend
    .venv/bin/python bench/spawner.py --backends process,process-warm --launches 50

Backends: `process` (bubblewrap, every launch cold), `process-warm` (bubblewrap with a warm pool of
`--pool-size` sandboxes that have imported the SDK already), `docker`. For each: `--launches`
launches one after another (p50/p99 of launch-to-first-output), then `--concurrent` launches at once
(the same latencies under load, and the wall time for all of them). `process-warm` runs the
sequential launches twice: "refilled" waits (untimed) for a full pool before each launch, the
latency while launches come slower than the pool refills; "back-to-back" does not wait, so launches
that find the pool empty start cold. The `warm` column counts launches served by a warm sandbox.
Runs as root (the process sandbox switches uids); the docker backend needs a running engine and
builds the controller image on first use. Target: process sandbox p50 ≤ 150 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from l4m.spawner.programs import ProgramStore
from l4m.spawner.sandbox import ExitReason, Limits, Sandbox, SandboxSpec
from l4m.spawner.supervisor import InstanceSupervisor

CONTROLLER = b"""
import l4m.controller
print("ready", flush=True)
"""
TARGET_PROCESS_P50_MS = 150.0
POOL_FILL_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Launch:
    latency_ms: float | None  # None: it did not exit cleanly
    is_warm: bool


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


async def launch_once(sandbox: Sandbox, program: Path) -> Launch:
    """Milliseconds from launch to the first output line, and whether a warm sandbox served it."""
    spec = SandboxSpec(
        f"bench-{uuid.uuid4().hex[:12]}", program, limits=Limits(wall_time_s=120, cpu_time_s=60)
    )
    supervisor = InstanceSupervisor(sandbox, spec)
    await supervisor.start()
    info = await supervisor.wait()
    if info.reason is not ExitReason.EXITED or supervisor.first_output_at_monotonic_s is None:
        print(f"  launch failed: {info}", file=sys.stderr)
        return Launch(None, supervisor.is_warm)
    latency_ms = (supervisor.first_output_at_monotonic_s - supervisor.started_at_monotonic_s) * 1000
    return Launch(latency_ms, supervisor.is_warm)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def summarize(backend: str, mode: str, launches: list[Launch], wall_s: float) -> Row:
    ok = [launch.latency_ms for launch in launches if launch.latency_ms is not None]
    num_warm = sum(launch.is_warm for launch in launches)
    if not ok:
        nan = float("nan")
        return Row(backend, mode, len(launches), 0, num_warm, nan, nan, nan, wall_s)
    p50, p99 = statistics.median(ok), percentile(ok, 0.99)
    return Row(backend, mode, len(launches), len(ok), num_warm, p50, p99, max(ok), wall_s)


async def sequential(sandbox: Sandbox, program: Path, num_launches: int, wait_refilled: bool) -> list[Launch]:
    launches = []
    for _ in range(num_launches):
        if wait_refilled:
            await asyncio.wait_for(wait_pool_full(sandbox), POOL_FILL_TIMEOUT_S)
        launches.append(await launch_once(sandbox, program))
    return launches


async def bench_backend(
    backend: str, sandbox: Sandbox, program: Path, num_launches: int, num_concurrent: int
) -> list[Row]:
    await sandbox.open()
    try:
        await launch_once(sandbox, program)  # warm the page cache (and, for docker, the image layers)
        modes = (
            [("refilled", True), ("back-to-back", False)]
            if backend == "process-warm"
            else [("sequential", False)]
        )
        rows = []
        for mode, wait_refilled in modes:
            started = time.monotonic()
            launches = await sequential(sandbox, program, num_launches, wait_refilled)
            rows.append(summarize(backend, mode, launches, time.monotonic() - started))
        await asyncio.wait_for(wait_pool_full(sandbox), POOL_FILL_TIMEOUT_S)
        started = time.monotonic()
        concurrent = await asyncio.gather(*(launch_once(sandbox, program) for _ in range(num_concurrent)))
        rows.append(
            summarize(backend, f"{num_concurrent} at once", list(concurrent), time.monotonic() - started)
        )
        return rows
    finally:
        await sandbox.close()


async def wait_pool_full(sandbox: Sandbox) -> None:
    wait = getattr(sandbox, "wait_warm_pool_full", None)
    if wait is not None:
        await wait()


def make_sandbox(backend: str, pool_size: int) -> Sandbox:
    spawner_id = f"bench-{uuid.uuid4().hex[:6]}"
    if backend in ("process", "process-warm"):
        from l4m.spawner.process_sandbox import ProcessSandbox, ProcessSandboxConfig

        size = pool_size if backend == "process-warm" else 0
        return ProcessSandbox(ProcessSandboxConfig(spawner_id=spawner_id, warm_pool_size=size))
    import docker
    from l4m.spawner.docker_image import ensure_controller_image
    from l4m.spawner.docker_sandbox import DockerSandbox, DockerSandboxConfig

    image = ensure_controller_image(docker.from_env())
    return DockerSandbox(DockerSandboxConfig(image=image, spawner_id=spawner_id))


def print_table(rows: list[Row]) -> None:
    header = f"{'backend':<12} {'mode':<12} {'ok':>7} {'warm':>4} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'wall s':>7}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row.backend:<12} {row.mode:<12} {row.num_ok:>3}/{row.num_launches:<3} {row.num_warm:>4} "
            f"{row.p50_ms:>8.1f} {row.p99_ms:>8.1f} {row.max_ms:>8.1f} {row.wall_s:>7.2f}"
        )


async def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backends", default="process,process-warm,docker")
    parser.add_argument("--pool-size", type=int, default=2, help="warm sandboxes for process-warm")
    parser.add_argument("--launches", type=int, default=30, help="sequential launches per backend")
    parser.add_argument("--concurrent", type=int, default=50, help="launches started at once")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()

    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="l4m-bench-") as root:
        program = ProgramStore(Path(root)).put(CONTROLLER).program.path
        for backend in args.backends.split(","):
            sandbox = make_sandbox(backend, args.pool_size)
            print(f"{backend}: {json.dumps(sandbox.enforcement(), indent=None)}", file=sys.stderr)
            rows += await bench_backend(backend, sandbox, program, args.launches, args.concurrent)
            if hasattr(sandbox, "remove_cgroup_parents"):
                sandbox.remove_cgroup_parents()
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
