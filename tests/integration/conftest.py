"""Shared fixtures for integration tests: real processes on loopback, logs printed when a test fails.

`l4m_cluster` (session-scoped) starts one executor (SmolLM2 on CPU unless L4M_EXECUTOR_ARGS says
otherwise) and one scheduler with anonymous sessions, waits until both answer, and stops them at the
end. `run_controller` runs `python -m l4m.controller PROGRAM -- ARGS` against it and parses the
messages the controller sent (stdout lines `l4m-message: <JSON string>`).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MESSAGE_PREFIX = "l4m-message: "


class ServiceProcess:
    """A service subprocess that prints `... listening on ADDRESS` once it serves; output in a log file."""

    def __init__(self, name: str, argv: list[str], timeout_s: float = 300) -> None:
        self.name = name
        self.log_path = Path(tempfile.mkstemp(prefix=f"l4m-{name}-", suffix=".log")[1])
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.address = self._wait_for_address(timeout_s)

    def _wait_for_address(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.output().splitlines():
                if "listening on" in line:
                    return line.rsplit(" ", 1)[1].strip()
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.name} did not start:\n{self.output()}")

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


@dataclass
class L4MCluster:
    executor: ServiceProcess
    scheduler: ServiceProcess

    @property
    def scheduler_address(self) -> str:
        return self.scheduler.address

    def logs(self) -> str:
        return "\n".join(f"----- {p.name} log -----\n{p.output()[-6000:]}" for p in (self.executor, self.scheduler))


def executor_argv(listen: str = "127.0.0.1:0") -> list[str]:
    extra = shlex.split(os.environ.get("L4M_EXECUTOR_ARGS", "--device cpu"))
    return [sys.executable, "-m", "l4m.executor", "--listen", listen, *extra]


@pytest.fixture(scope="session")
def l4m_cluster() -> Iterator[L4MCluster]:
    executor = ServiceProcess("executor", executor_argv())
    try:
        scheduler = ServiceProcess("scheduler", [sys.executable, "-m", "l4m.scheduler", "--listen", "127.0.0.1:0",
                                                 "--executor", executor.address, "--allow-anonymous"], timeout_s=60)
    except Exception:
        executor.stop()
        raise
    cluster = L4MCluster(executor, scheduler)
    yield cluster
    scheduler.stop()
    executor.stop()


@dataclass
class ControllerRun:
    returncode: int
    messages: list[str]
    stdout: str
    stderr: str

    def summary(self) -> dict:
        """The last message, parsed as JSON (the examples end with a JSON summary)."""
        return json.loads(self.messages[-1])


@pytest.fixture
def run_controller(l4m_cluster: L4MCluster, request: pytest.FixtureRequest) -> Callable[..., ControllerRun]:
    runs: list[ControllerRun] = []

    def run(program: str | Path, *args: str, timeout_s: float = 300) -> ControllerRun:
        env = {**os.environ, "L4M_SCHEDULER_ADDR": l4m_cluster.scheduler_address, "PYTHONUNBUFFERED": "1"}
        env.pop("L4M_RUNTIME_ADDR", None)
        proc = subprocess.run([sys.executable, "-m", "l4m.controller", str(program), "--", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=timeout_s)
        messages = [json.loads(line[len(MESSAGE_PREFIX):]) for line in proc.stdout.splitlines()
                    if line.startswith(MESSAGE_PREFIX)]
        result = ControllerRun(proc.returncode, messages, proc.stdout, proc.stderr)
        runs.append(result)
        return result

    yield run
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        for index, result in enumerate(runs):
            print(f"----- controller run {index} (rc {result.returncode}) -----\n{result.stdout[-4000:]}\n"
                  f"{result.stderr[-4000:]}")
        print(l4m_cluster.logs())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)
