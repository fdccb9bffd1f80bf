"""Sandbox launch latency: launch → first output line of a controller that has imported what the
SDK's runner (`python -m l4m.controller`) imports before its first command (grpc, the session, the
model and context layers, numpy, tokenizers). The first command itself is a round trip to the
scheduler on top, which this benchmark leaves out so that it needs no scheduler.

    .venv/bin/python bench/spawner.py                      # both backends
    .venv/bin/python bench/spawner.py --backends process --launches 50

For each backend: `--launches` launches one after another (p50/p99 of launch-to-first-output),
then `--concurrent` launches at once (the same latencies under load, and the wall time for all of
them). Runs as root (the process sandbox switches uids); the docker backend needs a running engine
and builds the controller image on first use. Target: process sandbox p50 ≤ 150 ms.
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


@dataclass(frozen=True)
class Row:
    backend: str
    mode: str
    num_launches: int
    num_ok: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    wall_s: float


async def launch_once(sandbox: Sandbox, program: Path) -> float | None:
    """Milliseconds from launch to the first output line, or None if it did not exit cleanly."""
    spec = SandboxSpec(
        f"bench-{uuid.uuid4().hex[:12]}", program, limits=Limits(wall_time_s=120, cpu_time_s=60)
    )
    supervisor = InstanceSupervisor(sandbox, spec)
    await supervisor.start()
    info = await supervisor.wait()
    if info.reason is not ExitReason.EXITED or supervisor.first_output_at_monotonic_s is None:
        print(f"  launch failed: {info}", file=sys.stderr)
        return None
    return (supervisor.first_output_at_monotonic_s - supervisor.started_at_monotonic_s) * 1000


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def summarize(backend: str, mode: str, latencies: list[float | None], wall_s: float) -> Row:
    ok = [value for value in latencies if value is not None]
    if not ok:
        return Row(backend, mode, len(latencies), 0, float("nan"), float("nan"), float("nan"), wall_s)
    return Row(
        backend, mode, len(latencies), len(ok), statistics.median(ok), percentile(ok, 0.99), max(ok), wall_s
    )


async def bench_backend(sandbox: Sandbox, program: Path, num_launches: int, num_concurrent: int) -> list[Row]:
    await launch_once(sandbox, program)  # warm the page cache (and, for docker, the image layers)
    started = time.monotonic()
    sequential = [await launch_once(sandbox, program) for _ in range(num_launches)]
    rows = [summarize(sandbox.kind, "sequential", sequential, time.monotonic() - started)]
    started = time.monotonic()
    concurrent = await asyncio.gather(*(launch_once(sandbox, program) for _ in range(num_concurrent)))
    rows.append(
        summarize(sandbox.kind, f"{num_concurrent} at once", list(concurrent), time.monotonic() - started)
    )
    return rows


def make_sandbox(backend: str) -> Sandbox:
    spawner_id = f"bench-{uuid.uuid4().hex[:6]}"
    if backend == "process":
        from l4m.spawner.process_sandbox import ProcessSandbox, ProcessSandboxConfig

        return ProcessSandbox(ProcessSandboxConfig(spawner_id=spawner_id))
    import docker
    from l4m.spawner.docker_image import ensure_controller_image
    from l4m.spawner.docker_sandbox import DockerSandbox, DockerSandboxConfig

    image = ensure_controller_image(docker.from_env())
    return DockerSandbox(DockerSandboxConfig(image=image, spawner_id=spawner_id))


def print_table(rows: list[Row]) -> None:
    header = f"{'backend':<8} {'mode':<12} {'ok':>7} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'wall s':>7}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row.backend:<8} {row.mode:<12} {row.num_ok:>3}/{row.num_launches:<3} "
            f"{row.p50_ms:>8.1f} {row.p99_ms:>8.1f} {row.max_ms:>8.1f} {row.wall_s:>7.2f}"
        )


async def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backends", default="process,docker")
    parser.add_argument("--launches", type=int, default=30, help="sequential launches per backend")
    parser.add_argument("--concurrent", type=int, default=50, help="launches started at once")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()

    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="l4m-bench-") as root:
        program = ProgramStore(Path(root)).put(CONTROLLER).program.path
        for backend in args.backends.split(","):
            sandbox = make_sandbox(backend)
            print(f"{backend}: {json.dumps(sandbox.enforcement(), indent=None)}", file=sys.stderr)
            rows += await bench_backend(sandbox, program, args.launches, args.concurrent)
            if hasattr(sandbox, "close"):
                sandbox.close()
    print_table(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(row) for row in rows], indent=1))
    process = [row for row in rows if row.backend == "process" and row.mode == "sequential"]
    if process:
        verdict = "meets" if process[0].p50_ms <= TARGET_PROCESS_P50_MS else "misses"
        print(
            f"process sandbox p50 {process[0].p50_ms:.1f} ms {verdict} the {TARGET_PROCESS_P50_MS:.0f} ms target"
        )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
