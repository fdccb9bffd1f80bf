"""Control-plane benchmark of the scheduler: commands/s, mean batch size, p50/p99 command latency for
1, 16 and 128 concurrent instances per batching strategy, against the simulated executor.

Each instance runs a closed decode loop: one forward_text with one greedy output per step, the next
sent when the reply arrives (so commands in flight = instances).

    .venv/bin/python bench/scheduler.py                 # in-process: the scheduler core, no gRPC
    .venv/bin/python bench/scheduler.py --grpc          # scheduler and executor processes, clients over gRPC
    .venv/bin/python bench/scheduler.py --grpc --framed # the same, clients over framed sessions (--listen-framed)
    .venv/bin/python bench/scheduler.py --grpc --framed --sdk   # clients are the SDK's sessions (l4m.session)
    python bench/scheduler.py --grpc --framed --sdk --executor-device cuda:0 --strategies adaptive
                                                        # the real executor (default model) on a GPU
    .venv/bin/python bench/scheduler.py --grpc --framed --sdk --forward-latency-ms 2 --sizes 64
                                                        # the simulated executor takes 2 ms per forward batch
                                                        # of any size, as a GPU's decode step nearly does

With --grpc the table has the scheduler's CPU per command (its process time over the commands answered):
1e6 / that is what one scheduler core can take, whatever the clients beside it on this machine cost.
With --executor-device the executor is l4m's own on that device (the default model, its token ids
`step % 1000`, four pages per instance written over and over): every command is one decoded token, so
commands/s is the stack's decode tokens/s without the spawner and sandboxes, to set beside
bench/executor.py's figure for the executor alone.
    taskset -c 0,1 .venv/bin/python bench/scheduler.py  # the 2-core target
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from transport import process_cpu_s  # bench/transport.py, beside this file

from l4m import eventloop
from l4m.scheduler import requests as rq
from l4m.scheduler.config import SchedulerConfig
from l4m.scheduler.core import Scheduler
from l4m.scheduler.simulated import SimulatedExecutor, SimulatedExecutorConfig, SimulatedLink
from l4m.v1 import l4m_pb2

PAGE_SIZE = 16
NUM_PAGES_PER_INSTANCE = 4
STRATEGIES = ("adaptive", "t-only:1", "k-only:{k}", "k-or-t:8:1")
SIZES = (1, 16, 128)
WARM_UP_BOUND_S = 120.0


def strategy_for(template: str, num_instances: int) -> str:
    # k-only never fires below k items: with fewer instances than k it would stall, so k = min(8, n).
    return template.format(k=min(8, num_instances))


def decode_step(step: int, request_id: int) -> l4m_pb2.SessionRequest:
    """Step `step` of a decode loop over NUM_PAGES_PER_INSTANCE pages (wrapping around)."""
    position = step % (PAGE_SIZE * NUM_PAGES_PER_INSTANCE)
    num_pages = position // PAGE_SIZE + 1
    return rq.forward_text(list(range(num_pages)), position % PAGE_SIZE + 1, [step % 1000], [position], outputs=[0],
                           request_id=request_id)


class LoopClient:
    """An in-process instance: its sink sends the next step as soon as a reply arrives."""

    def __init__(self, scheduler: Scheduler, instance, latencies: list[float]) -> None:  # type: ignore[no-untyped-def]
        self.scheduler = scheduler
        self.instance = instance
        self.latencies = latencies
        self.step = 0
        self.sent_at = 0.0
        self.running = True

    def send(self, response: l4m_pb2.SessionResponse) -> None:
        if response.WhichOneof("event") == "trap":
            raise RuntimeError(response.trap.reason)
        now = time.perf_counter()
        self.latencies.append(now - self.sent_at)
        if self.running:
            self.next(now)

    def end(self, trap: l4m_pb2.Trap | None) -> None:
        self.running = False

    def next(self, now: float) -> None:
        self.step += 1
        self.sent_at = now
        self.scheduler.submit(self.instance, decode_step(self.step, self.step))


async def run_in_process(strategy: str, num_instances: int, duration_s: float) -> dict[str, float]:
    sim = SimulatedExecutor(SimulatedExecutorConfig(num_kv_pages=8192, num_embed_slots=64))
    scheduler = Scheduler(SchedulerConfig(batching=strategy), [SimulatedLink(sim)])  # type: ignore[list-item]
    scheduler.start()
    latencies: list[float] = []
    clients = []
    for i in range(num_instances):
        instance = scheduler.register_instance(f"bench-{i}", f"bench-token-{i:08d}", 0, i)
        client = LoopClient(scheduler, instance, latencies)
        scheduler.open_session(instance, client)
        scheduler.submit(instance, rq.allocate(list(range(NUM_PAGES_PER_INSTANCE))))
        clients.append(client)
    await asyncio.sleep(0.01)
    now = time.perf_counter()
    for client in clients:
        client.next(now)
    await asyncio.sleep(0.2)  # warm up
    latencies.clear()
    before = scheduler.metrics.counts()
    started = time.perf_counter()
    await asyncio.sleep(duration_s)
    elapsed = time.perf_counter() - started
    after = scheduler.metrics.counts()
    num_commands = after["commands"] - before["commands"]
    num_items = after["items"].get("forward_text", 0) - before["items"].get("forward_text", 0)
    num_batches = after["batches"].get("forward_text", 0) - before["batches"].get("forward_text", 0)
    for client in clients:
        client.running = False
    await asyncio.sleep(0.05)
    return summarize(num_commands, elapsed, num_items, num_batches, latencies)


def summarize(num_commands: int, elapsed: float, num_items: int, num_batches: int, latencies: list[float]) -> dict[str, float]:
    quantiles = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [0.0] * 99
    return {
        "commands_per_s": num_commands / elapsed,
        "mean_batch": num_items / max(num_batches, 1),
        "p50_ms": quantiles[49] * 1000,
        "p99_ms": quantiles[98] * 1000,
    }


async def switch_batching(stub: object, registry: GrpcProcesses, strategy: str) -> None:
    """Retunes batching through an admin instance (anonymous ones may not: it is a cluster-wide knob)."""
    from l4m.spawner.registry_client import GrpcInstanceRegistry

    registry.num_controls += 1
    instance_id = f"bench-control-{registry.num_controls}"
    token = f"{instance_id}-token-0123456789"
    client = GrpcInstanceRegistry(registry.registry_address, registry.secret)
    await client.register(instance_id, token, 0, 0, is_admin=True)
    control = stub.Session(metadata=(("l4m-instance-token", token),))  # type: ignore[attr-defined]
    await control.write(rq.debug_query(f"batching:{strategy}", request_id=1))
    await control.read()
    await control.done_writing()
    await client.destroy(instance_id, "done")
    await client.close()


async def run_grpc(processes: GrpcProcesses, strategy: str, num_instances: int, duration_s: float,
                   sdk: bool = False, warm_up_commands: int = 0) -> dict[str, float]:
    import grpc

    from l4m.framed import FramedStub
    from l4m.session import Session
    from l4m.v1 import l4m_pb2_grpc

    async with grpc.aio.insecure_channel(processes.address) as channel:
        stub = FramedStub(processes.framed_path) if processes.framed_path else l4m_pb2_grpc.L4MServiceStub(channel)
        await switch_batching(stub, processes, strategy)
        control = stub.Session()
        latencies: list[float] = []
        counters = {"commands": 0}
        stop = asyncio.Event()

        async def instance() -> None:
            call = stub.Session()
            await call.write(rq.allocate(list(range(NUM_PAGES_PER_INSTANCE))))
            step = 0
            while not stop.is_set():
                step += 1
                sent_at = time.perf_counter()
                await call.write(decode_step(step, step))
                await call.read()
                latencies.append(time.perf_counter() - sent_at)
                counters["commands"] += 1
            await call.done_writing()

        async def sdk_instance() -> None:
            """The SDK's own session (l4m.session.Session: on framed sessions, no task per direction)."""
            session = Session(stub)
            allocate = rq.allocate(list(range(NUM_PAGES_PER_INSTANCE)))
            session.send("allocate", allocate.allocate)
            step = 0
            while not stop.is_set():
                step += 1
                sent_at = time.perf_counter()
                await session.request("forward_text", decode_step(step, step).forward_text)
                latencies.append(time.perf_counter() - sent_at)
                counters["commands"] += 1
            await session.close()

        async def stats() -> dict:  # type: ignore[type-arg]
            await control.write(rq.debug_query("stats", request_id=2))
            return json.loads((await control.read()).debug_query.response)

        tasks = [asyncio.create_task(sdk_instance() if sdk else instance()) for _ in range(num_instances)]
        await asyncio.sleep(0.3)
        # A real executor captures a CUDA graph per (batch, pages) bucket the first time one is needed:
        # warm up until every instance has gone round its pages twice (each bucket seen), within a bound.
        warm_until = time.monotonic() + WARM_UP_BOUND_S
        while counters["commands"] < warm_up_commands * num_instances and time.monotonic() < warm_until:
            await asyncio.sleep(0.1)
        latencies.clear()
        before, commands_before = await stats(), counters["commands"]
        scheduler_cpu_before, client_cpu_before = process_cpu_s(processes.scheduler_pid), time.process_time()
        started = time.perf_counter()
        await asyncio.sleep(duration_s)
        elapsed = time.perf_counter() - started
        scheduler_cpu = process_cpu_s(processes.scheduler_pid) - scheduler_cpu_before
        client_cpu = time.process_time() - client_cpu_before
        after, commands_after = await stats(), counters["commands"]
        stop.set()
        await asyncio.gather(*tasks)
        await control.done_writing()
    num_items = after["items"].get("forward_text", 0) - before["items"].get("forward_text", 0)
    num_batches = after["batches"].get("forward_text", 0) - before["batches"].get("forward_text", 0)
    num_commands = commands_after - commands_before
    row = summarize(num_commands, elapsed, num_items, num_batches, latencies)
    row["scheduler_cpu_us"] = scheduler_cpu / max(num_commands, 1) * 1e6
    row["client_cpu_us"] = client_cpu / max(num_commands, 1) * 1e6
    return row


@dataclass
class GrpcProcesses:
    """The scheduler and executor processes of `--grpc`, and the scheduler's registry (the bench's
    control sessions register as admin there)."""

    processes: list[subprocess.Popen]  # type: ignore[type-arg]
    address: str
    registry_address: str
    secret: str
    framed_path: str | None = None  # the scheduler's --listen-framed socket: the clients use framed sessions
    num_controls: int = 0

    @property
    def scheduler_pid(self) -> int:
        return self.processes[1].pid


SCHEDULER_START_TIMEOUT_S = 60.0
EXECUTOR_START_TIMEOUT_S = 600.0  # a real executor loads its model (and, on a GPU, the CUDA runtime) first


def wait_serving(process: subprocess.Popen, address: str, log: Path, timeout_s: float) -> None:  # type: ignore[type-arg]
    """Until the executor's gRPC health check says SERVING; its log tail in the error if it exits or stalls."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
                state = f"exited with {process.returncode}" if process.returncode is not None else "is not serving"
                raise RuntimeError(f"the executor {state} after {timeout_s:.0f} s at most; its log:\n{tail}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)


def start_processes(framed_path: str | None = None, executor_transport: str = "framed",
                    simulated_args: Sequence[str] = (), executor_device: str = "") -> GrpcProcesses:
    """The simulated executor (with `simulated_args`), or l4m's executor on `executor_device`, and the
    scheduler (also serving framed sessions on `framed_path` when given); the scheduler sends its batches
    on the executor's framed Execute socket, or on gRPC."""
    import socket

    from l4m.wire.credentials import write_secret_file

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    executor_address, scheduler_address = f"127.0.0.1:{port()}", f"127.0.0.1:{port()}"
    state = Path(tempfile.mkdtemp(prefix="l4m-bench-"))
    secret_file = state / "cluster.secret"
    secret = write_secret_file(secret_file)
    registry_address = f"unix:{state}/registry.sock"
    env = {**os.environ}
    framed_execute = ["--listen-framed", str(state / "executor.frames.sock")]
    if executor_device:
        log = state / "executor.log"
        with log.open("wb") as sink:
            executor = subprocess.Popen([sys.executable, "-m", "l4m.executor", "--listen", executor_address,
                                         "--device", executor_device, "--num-pages", "2048",
                                         "--cluster-secret-file", str(secret_file), *framed_execute],
                                        env=env, stdout=sink, stderr=subprocess.STDOUT)
        try:
            wait_serving(executor, executor_address, log, EXECUTOR_START_TIMEOUT_S)
        except BaseException:
            executor.kill()
            raise
    else:
        executor = subprocess.Popen([sys.executable, "-m", "l4m.scheduler.simulated", "--listen", executor_address,
                                     "--num-kv-pages", "8192", *framed_execute, *simulated_args],
                                    env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    scheduler = subprocess.Popen([sys.executable, "-m", "l4m.scheduler", "--listen", scheduler_address, "--executor",
                                  executor_address, "--allow-anonymous", "--log-level", "WARNING",
                                  "--registry-listen", registry_address, "--cluster-secret-file", str(secret_file),
                                  *(["--listen-framed", framed_path] if framed_path else []),
                                  "--executor-transport", "auto" if executor_transport == "framed" else "grpc"],
                                 env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # Until its sockets exist (seconds on a loaded machine), then a moment for the executor to connect.
    sockets = [Path(registry_address.removeprefix("unix:")), *([Path(framed_path)] if framed_path else [])]
    deadline = time.monotonic() + SCHEDULER_START_TIMEOUT_S
    while not all(path.exists() for path in sockets):
        if scheduler.poll() is not None or time.monotonic() > deadline:
            executor.kill()
            scheduler.kill()
            raise RuntimeError(f"the scheduler did not open {', '.join(map(str, sockets))} within "
                               f"{SCHEDULER_START_TIMEOUT_S:.0f} s (exit code {scheduler.returncode})")
        time.sleep(0.1)
    time.sleep(1.0)
    return GrpcProcesses([executor, scheduler], scheduler_address, registry_address, secret, framed_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grpc", action="store_true", help="through gRPC: scheduler and executor as processes")
    parser.add_argument("--framed", action="store_true", help="with --grpc: the clients use framed sessions")
    parser.add_argument("--sdk", action="store_true",
                        help="with --grpc: the clients are the SDK's sessions (l4m.session.Session), not raw calls")
    parser.add_argument("--executor-transport", default="framed", choices=["framed", "grpc"],
                        help="with --grpc: how the scheduler sends batches to the simulated executor")
    parser.add_argument("--executor-device", default="", metavar="DEVICE",
                        help="with --grpc: l4m's executor (the default model) on cpu or cuda:N, not the simulated one")
    parser.add_argument("--forward-latency-ms", type=float, default=0.0,
                        help="with --grpc: the simulated executor's time per forward batch, whatever its size (a GPU's "
                             "decode step is nearly flat in the batch size)")
    parser.add_argument("--duration-s", type=float, default=1.5)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="batching strategies, comma separated")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.framed and not args.grpc:
        parser.error("--framed goes with --grpc (the in-process mode has no transport)")
    if args.executor_device and not args.grpc:
        parser.error("--executor-device goes with --grpc (the in-process mode runs the simulated executor)")
    if args.forward_latency_ms and (not args.grpc or args.executor_device):
        parser.error("--forward-latency-ms goes with --grpc and the simulated executor")
    if args.forward_latency_ms < 0:
        parser.error("--forward-latency-ms must be at least 0")
    framed_path = f"{tempfile.mkdtemp(prefix='l4m-bench-framed-')}/scheduler.frames.sock" if args.framed else None
    simulated_args = ["--forward-latency-ms", str(args.forward_latency_ms)] if args.forward_latency_ms else []
    grpc_processes = (start_processes(framed_path, args.executor_transport, simulated_args, args.executor_device)
                      if args.grpc else None)
    # Each instance's steps cycle through its pages: twice round covers every page bucket.
    warm_up_commands = 2 * PAGE_SIZE * NUM_PAGES_PER_INSTANCE if args.executor_device else 0
    mode = "in-process core + simulated executor"
    if args.grpc:
        executor = f"l4m executor ({args.executor_device})" if args.executor_device else "simulated executor"
        mode = (f"scheduler + {executor} processes, {'SDK sessions' if args.sdk else 'raw calls'} over "
                f"{'framed sessions' if args.framed else 'gRPC'}, batches over {args.executor_transport}"
                + (f", forward batches of {args.forward_latency_ms:g} ms" if args.forward_latency_ms else ""))
    print(f"scheduler benchmark, {mode}, cpus={len(os.sched_getaffinity(0))}")
    # "1 core cmds/s": what one core running only the scheduler takes (1e6 / its CPU per command).
    cpu_columns = f" {'scheduler CPU us/cmd':>20} {'1 core cmds/s':>13} {'clients CPU us/cmd':>18}" if args.grpc else ""
    print(f"{'strategy':<12} {'instances':>9} {'commands/s':>11} {'mean batch':>10} {'p50 ms':>8} {'p99 ms':>8}"
          + cpu_columns)
    try:
        for template in args.strategies.split(","):
            for num_instances in sizes:
                strategy = strategy_for(template, num_instances)
                if grpc_processes is not None:
                    row = eventloop.run(run_grpc(grpc_processes, strategy, num_instances, args.duration_s, args.sdk,
                                                  warm_up_commands))
                else:
                    row = asyncio.run(run_in_process(strategy, num_instances, args.duration_s))
                print(f"{strategy:<12} {num_instances:>9} {row['commands_per_s']:>11,.0f} {row['mean_batch']:>10.1f} "
                      f"{row['p50_ms']:>8.3f} {row['p99_ms']:>8.3f}"
                      + (f" {row['scheduler_cpu_us']:>20.1f} {1e6 / max(row['scheduler_cpu_us'], 1e-3):>13,.0f}"
                         f" {row['client_cpu_us']:>18.1f}" if args.grpc else ""),
                      flush=True)
    finally:
        for process in grpc_processes.processes if grpc_processes is not None else []:
            process.terminate()


if __name__ == "__main__":
    main()
