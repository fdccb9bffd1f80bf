"""Services for scheduler integration tests: executors and a scheduler on loopback, each started with
`harness.ServiceProcess` and then probed over gRPC until it answers GetInfo (a scheduler answers once
its executors are connected); the `cluster` fixture prints their logs when a test fails."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc

from l4m.v1 import executor_pb2, executor_pb2_grpc, l4m_pb2, l4m_pb2_grpc
from tests.integration.harness import REPO, ServiceProcess, executor_args

REAL_EXECUTOR_READY = (REPO / "services/executor/__main__.py").exists() or (REPO / "services/executor/server.py").exists()
Probe = Callable[[grpc.Channel], object]


def sync_channel(address: str, ca_path: Path | None = None) -> grpc.Channel:
    """A blocking channel: TLS verified against `ca_path` when given."""
    if ca_path is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(ca_path.read_bytes()))


def wait_for(address: str, probe: Probe, timeout_s: float, process: ServiceProcess, ca_path: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    with sync_channel(address, ca_path) as channel:
        while True:
            if process.process.poll() is not None:
                raise RuntimeError(f"{process.name} exited:\n{process.log_tail(8000)}")
            try:
                probe(channel)
                return
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{process.name} not ready at {address}:\n{process.log_tail(8000)}") from None
                time.sleep(0.1)


def executor_probe(channel: grpc.Channel) -> None:
    executor_pb2_grpc.ExecutorServiceStub(channel).GetInfo(executor_pb2.ExecutorServiceGetInfoRequest(), timeout=2)


def scheduler_probe(channel: grpc.Channel) -> None:
    l4m_pb2_grpc.L4MServiceStub(channel).GetInfo(l4m_pb2.GetInfoRequest(), timeout=2)


class Cluster:
    """The services a test started, stopped in reverse order."""

    def __init__(self) -> None:
        self.processes: list[ServiceProcess] = []

    def start(self, name: str, module: str, args: Sequence[str], probe: Probe, timeout_s: float = 60,
              ca_path: Path | None = None) -> str:
        """Its address, once it listens (on a port of its own choosing) and `probe` succeeds."""
        process = ServiceProcess(module, args, name=name)
        self.processes.append(process)
        address = process.wait_listening(timeout_s)
        wait_for(address, probe, timeout_s, process, ca_path)
        return address

    def simulated_executor(self, *extra: str) -> str:
        return self.start("simulated-executor", "l4m.scheduler.simulated", ["--listen", "127.0.0.1:0", *extra],
                          executor_probe)

    def real_executor(self, *extra: str) -> str:
        return self.start("executor", "l4m.executor", [*executor_args(), *extra], executor_probe, timeout_s=300)

    def scheduler(self, *executors: str, batching: str = "adaptive", extra: tuple[str, ...] = ("--allow-anonymous",),
                  ca_path: Path | None = None) -> str:
        """Its L4M address (TLS when `extra` has --tls-cert: pass the CA); `extra` may add a registry
        listener (--registry-listen, --cluster-secret-file)."""
        args = ["--listen", "127.0.0.1:0", "--batching", batching, "--log-level", "WARNING", *extra]
        for executor in executors:
            args += ["--executor", executor]
        return self.start("scheduler", "l4m.scheduler", args, scheduler_probe, ca_path=ca_path)

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()
