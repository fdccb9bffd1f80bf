"""Shared fixtures for integration tests: real processes on loopback, logs printed when a test fails.

`l4m_up` (session-scoped) is the real `l4m up` command on free ports with its own state directory:
executor (SmolLM2 on CPU), scheduler and spawner with bubblewrap sandboxes, metrics endpoints on. `l4m_run`
runs the real `l4m run FILE -- ARGS` against it, as a user does (with the admin key `l4m up` wrote, unless
the options name another), and keeps its exit status, stdout (the controller's messages, one per line)
and stderr (its log lines and, on an abnormal end, the reason). `UpCluster.add_user_key` makes a user's
key with `l4m keys add`.

`ServiceProcess` + `executor_argv` start a lone service (e.g. an executor that only a reference decoding
talks to; extra executor flags from $L4M_EXECUTOR_ARGS, default `--device cpu`).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
L4M_CLI = Path(sys.executable).parent / "l4m"
UP_TIMEOUT_S = 300.0  # the executor loads the model first: about 10 s idle, a minute on a busy 2-core box
# `l4m up` puts the spawner's metrics at base+0, the scheduler's at base+1, executor i's at base+10+i.
METRICS_OFFSETS = {"spawner": 0, "scheduler": 1, "executor": 10}


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


def _is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def free_metrics_port_base() -> int:
    """A base port whose every `l4m up` metrics offset is free right now."""
    for _ in range(100):
        base = free_port()
        if base + max(METRICS_OFFSETS.values()) < 65536 and all(_is_free(base + o) for o in METRICS_OFFSETS.values()):
            return base
    raise RuntimeError("found no free block of ports for the metrics endpoints")


def service_env() -> dict[str, str]:
    """The environment for cluster commands: the developer's OTEL_*/L4M_* settings stay out."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "L4M_"))}


class Metrics:
    """One scrape of a Prometheus endpoint: `value(name, **labels)` reads a sample."""

    def __init__(self, text: str) -> None:
        self.samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self.samples[(sample.name, frozenset(sample.labels.items()))] = sample.value

    def value(self, name: str, default: float | None = None, **labels: str) -> float:
        """The sample's value; `default` for a labelled sample not exported yet (a counter never bumped)."""
        key = (name, frozenset(labels.items()))
        if key in self.samples:
            return self.samples[key]
        if default is None:
            raise KeyError(f"no sample {name}{labels or ''}; samples: {sorted({n for n, _ in self.samples})}")
        return default


class UpCluster:
    """`l4m up` (the command users run) in a subprocess, its output in a file; stopped with Ctrl-C (SIGINT)."""

    def __init__(self, work_dir: Path, extra_args: Sequence[str] = ()) -> None:
        self.state_dir = work_dir / "state"
        self.log_path = work_dir / "l4m-up.log"
        spawner_port, scheduler_port = free_port(), free_port()
        self.metrics_port_base = free_metrics_port_base()
        self.spawner_address, self.scheduler_address = f"127.0.0.1:{spawner_port}", f"127.0.0.1:{scheduler_port}"
        argv = [str(L4M_CLI), "up", "--state-dir", str(self.state_dir), "--spawner-port", str(spawner_port),
                "--scheduler-port", str(scheduler_port), "--metrics-port-base", str(self.metrics_port_base), "--quiet",
                *extra_args]
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=service_env())

    def wait_up(self, timeout_s: float = UP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while "l4m is up" not in self.output():
            if self.process.poll() is not None:
                raise RuntimeError(f"l4m up exited with {self.process.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"l4m up did not come up in {timeout_s:.0f} s:\n{self.output()}")
            time.sleep(0.2)

    @property
    def admin_key_path(self) -> Path:
        """The admin's API key, written by `l4m up`."""
        return self.state_dir / "admin.key"

    @property
    def admin_key(self) -> str:
        return self.admin_key_path.read_text().strip()

    @property
    def keys_path(self) -> Path:
        return self.state_dir / "api-keys.json"

    @property
    def cluster_secret_path(self) -> Path:
        """The control plane's secret (the registry's and executors' bearer token)."""
        return self.state_dir / "internal" / "cluster.secret"

    @property
    def cluster_secret(self) -> str:
        return self.cluster_secret_path.read_text().strip()

    @property
    def registry_address(self) -> str:
        return f"unix:{self.state_dir / 'internal' / 'registry.sock'}"

    @property
    def scheduler_socket(self) -> str:
        """The data plane's L4M socket (what sandboxes see as /run/l4m/scheduler.sock)."""
        return f"unix:{self.state_dir / 'sockets' / 'scheduler.sock'}"

    def add_user_key(self, name: str, *options: str) -> str:
        """`l4m keys --keys-file <state>/api-keys.json add NAME [OPTIONS]`; returns the new key it printed."""
        argv = [str(L4M_CLI), "keys", "--keys-file", str(self.keys_path), "add", name, *options]
        proc = subprocess.run(argv, cwd=REPO, env=service_env(), capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"{shlex.join(argv)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        keys = [word for word in proc.stdout.split() if word.startswith("l4m_")]
        if len(keys) != 1:
            raise RuntimeError(f"{shlex.join(argv)} printed no single key:\n{proc.stdout}")
        return keys[0]

    def write_key_file(self, name: str, key: str) -> Path:
        """A 0600 file holding `key`, for `l4m run --api-key-file`."""
        path = self.state_dir / f"{name}.key"
        path.write_text(key + "\n")
        path.chmod(0o600)
        return path

    def metrics(self, service: str) -> Metrics:
        """Scrape `spawner`, `scheduler` or `executor` (executor-0)."""
        url = f"http://127.0.0.1:{self.metrics_port_base + METRICS_OFFSETS[service]}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            return Metrics(response.read().decode())

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def logs(self) -> str:
        services = sorted((self.state_dir / "logs").glob("*.log"))
        parts = [f"----- l4m up -----\n{self.output()[-4000:]}"]
        parts += [f"----- {p.name} -----\n{p.read_text(errors='replace')[-6000:]}" for p in services]
        return "\n".join(parts)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # Ctrl-C: l4m up stops every service it started
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="session")
def l4m_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpCluster]:
    cluster = UpCluster(tmp_path_factory.mktemp("l4m-up"))
    try:
        cluster.wait_up()
        yield cluster
    finally:
        cluster.stop()


@dataclass
class CliRun:
    """One `l4m run`: its exit status, stdout (a line per message) and stderr (logs, the end's reason)."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str

    @property
    def lines(self) -> list[str]:
        return self.stdout.splitlines()

    def summary(self) -> dict:
        """The last line, parsed as JSON (the examples end with a JSON summary on one line)."""
        return json.loads(self.lines[-1])

    def describe(self) -> str:
        return f"$ {shlex.join(self.argv)}  (exit {self.returncode})\n{self.stdout[-4000:]}\n{self.stderr[-4000:]}"


@pytest.fixture
def l4m_run(l4m_up: UpCluster, request: pytest.FixtureRequest) -> Iterator[Callable[..., CliRun]]:
    runs: list[CliRun] = []

    def run(program: str | Path, *args: str, options: Sequence[str] = (), timeout_s: float = 300) -> CliRun:
        """`l4m run [OPTIONS] PROGRAM -- ARGS`, as the admin unless OPTIONS give `--api-key-file`."""
        key = [] if "--api-key-file" in options else ["--api-key-file", str(l4m_up.admin_key_path)]
        argv = [str(L4M_CLI), "run", "--spawner", l4m_up.spawner_address, *key, *options, str(program), "--", *args]
        proc = subprocess.run(argv, cwd=REPO, env=service_env(), capture_output=True, text=True, timeout=timeout_s)
        result = CliRun(argv, proc.returncode, proc.stdout, proc.stderr)
        runs.append(result)
        return result

    yield run
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        for result in runs:
            print(result.describe())
        print(l4m_up.logs())


def executor_argv(listen: str = "127.0.0.1:0") -> list[str]:
    extra = shlex.split(os.environ.get("L4M_EXECUTOR_ARGS", "--device cpu"))
    return [sys.executable, "-m", "l4m.executor", "--listen", listen, *extra]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)
