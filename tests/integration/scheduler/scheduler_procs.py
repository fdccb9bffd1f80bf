"""Processes for scheduler integration tests: executors and a scheduler on loopback, each logging to
a file that the `cluster` fixture prints when a test fails."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from l4m.v1 import executor_pb2, executor_pb2_grpc, l4m_pb2, l4m_pb2_grpc

REPO = Path(__file__).resolve().parents[3]
REAL_EXECUTOR_READY = (REPO / "services/executor/__main__.py").exists() or (REPO / "services/executor/server.py").exists()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A child process whose output goes to a log file, shown when the test fails."""

    def __init__(self, name: str, argv: list[str]) -> None:
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ})

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-8000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def sync_channel(address: str, ca_path: Path | None = None) -> grpc.Channel:
    """A blocking channel: TLS verified against `ca_path` when given."""
    if ca_path is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(ca_path.read_bytes()))


def wait_for(address: str, probe, timeout_s: float, process: Process, ca_path: Path | None = None) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    with sync_channel(address, ca_path) as channel:
        while True:
            if process.proc.poll() is not None:
                raise RuntimeError(f"{process.name} exited:\n{process.output()}")
            try:
                probe(channel)
                return
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{process.name} not ready at {address}:\n{process.output()}") from None
                time.sleep(0.1)


def _executor_probe(channel: grpc.Channel) -> None:
    executor_pb2_grpc.ExecutorServiceStub(channel).GetInfo(executor_pb2.ExecutorServiceGetInfoRequest(), timeout=2)


def _scheduler_probe(channel: grpc.Channel) -> None:
    l4m_pb2_grpc.L4MServiceStub(channel).GetInfo(l4m_pb2.GetInfoRequest(), timeout=2)


class Cluster:
    def __init__(self) -> None:
        self.processes: list[Process] = []

    def start(self, name: str, argv: list[str], probe, timeout_s: float = 60, ca_path: Path | None = None) -> str:  # type: ignore[no-untyped-def]
        port = free_port()
        address = f"127.0.0.1:{port}"
        process = Process(name, [arg.replace("{listen}", address) for arg in argv])
        self.processes.append(process)
        wait_for(address, probe, timeout_s, process, ca_path)
        return address

    def simulated_executor(self, *extra: str) -> str:
        return self.start("simulated-executor", [sys.executable, "-m", "l4m.scheduler.simulated", "--listen", "{listen}",
                                                 *extra], _executor_probe)

    def real_executor(self) -> str:
        extra = shlex.split(os.environ.get("L4M_EXECUTOR_ARGS", "--device cpu"))
        return self.start("executor", [sys.executable, "-m", "l4m.executor", "--listen", "{listen}", *extra],
                          _executor_probe, timeout_s=300)

    def scheduler(self, *executors: str, batching: str = "adaptive", extra: tuple[str, ...] = ("--allow-anonymous",),
                  ca_path: Path | None = None) -> str:
        """Its L4M address (TLS when `extra` has --tls-cert: pass the CA); `extra` may add a registry
        listener (--registry-listen, --cluster-secret-file)."""
        argv = [sys.executable, "-m", "l4m.scheduler", "--listen", "{listen}", "--batching", batching,
                "--log-level", "WARNING", *extra]
        for executor in executors:
            argv += ["--executor", executor]
        return self.start("scheduler", argv, _scheduler_probe, ca_path=ca_path)

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()


