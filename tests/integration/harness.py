"""The one way integration tests start real processes on loopback: free ports, a service, a whole cluster.

- `free_port` / `free_ports`: ports nobody listens on right now; `free_metrics_port_base`: a base port
  whose every `l4m up` metrics offset (`METRICS_OFFSETS`) is free.
- `ServiceProcess`: `python -m MODULE ARGS` (executor, scheduler, simulated executor, spawner) with its
  output in a log file; `wait_listening` waits for the "... listening on ADDRESS" line each service
  prints once it serves, and returns ADDRESS. `executor_args` are a lone executor's flags.
- `UpCluster` / `up_cluster`: the real `l4m up` command users run, on free ports with its own state
  directory, stopped with Ctrl-C; `Metrics` reads one scrape of a service's Prometheus endpoint.
- `CliRun`: one `l4m run`, as the `l4m_run` fixture (conftest.py) runs it.

Tests that need a service inside the test process use `create_server` on port 0 instead
(`spawner/harness.py` `running_spawner`), as `main()` does.
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
L4M_CLI = Path(sys.executable).parent / "l4m"
UP_TIMEOUT_S = 300.0  # the executor loads the model first: about 10 s idle, a minute on a busy 2-core box
# `l4m up` puts the spawner's metrics at base+0, the scheduler's at base+1, the gateway's at base+2, executor
# i's at base+10+i.
METRICS_OFFSETS = {"spawner": 0, "scheduler": 1, "gateway": 2, "executor": 10}


# ---- ports -------------------------------------------------------------------------------------------


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports that were free a moment ago (all bound at once, then released)."""
    with contextlib.ExitStack() as stack:
        probes = [stack.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]


def free_port() -> int:
    return free_ports(1)[0]


def is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_metrics_port_base() -> int:
    """A base port whose every `l4m up` metrics offset is free right now."""
    for _ in range(100):
        base = free_port()
        if base + max(METRICS_OFFSETS.values()) < 65536 and all(is_free(base + o) for o in METRICS_OFFSETS.values()):
            return base
    raise RuntimeError("found no free block of ports for the metrics endpoints")


def service_env() -> dict[str, str]:
    """The environment for cluster commands: the developer's OTEL_*/L4M_* settings stay out."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "L4M_"))}


# ---- one service ----------------------------------------------------------------------------------------


def executor_args(listen: str = "127.0.0.1:0") -> list[str]:
    """A real executor's flags: extra ones from $L4M_EXECUTOR_ARGS (default `--device cpu`)."""
    return ["--listen", listen, *shlex.split(os.environ.get("L4M_EXECUTOR_ARGS", "--device cpu"))]


class ServiceProcess:
    """`python -m MODULE ARGS` with its output (stdout and stderr) in `log_path` (a temporary file when
    None); `env` is added to this process's environment. Each l4m service prints `... listening on
    ADDRESS` once it serves: `wait_listening` returns that ADDRESS."""

    def __init__(self, module: str, args: Sequence[str], log_path: Path | None = None,
                 env: Mapping[str, str] | None = None, name: str | None = None) -> None:
        self.name = name or module
        if log_path is None:
            log_path = Path(tempfile.mkstemp(prefix=f"l4m-{self.name}-", suffix=".log")[1])
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.process = subprocess.Popen([sys.executable, "-m", module, *args], stdout=self._log,
                                        stderr=subprocess.STDOUT, cwd=REPO,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.address = ""

    def wait_listening(self, timeout_s: float = 60.0) -> str:
        """The address of its first "listening on" line; stops it and raises when it exits or is silent
        for `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.output().splitlines():
                if "listening on " in line:
                    self.address = line.split("listening on ", 1)[1].split()[0]
                    return self.address
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.name} did not start:\n{self.log_tail()}")

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, num_chars: int = 6000) -> str:
        return self.output()[-num_chars:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()


# ---- a whole cluster: `l4m up` ------------------------------------------------------------------------


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
    """`l4m up` (the command users run) in a subprocess, its output in a file; stopped with Ctrl-C (SIGINT).

    `extra_args` are more `l4m up` flags; `env` its environment (default `service_env()`); without
    `metrics` its endpoints are off (`--metrics-port-base 0`); `echo_logs` leaves out `--quiet`, so the
    services' logs are echoed into its output too."""

    def __init__(self, work_dir: Path, extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 metrics: bool = True, echo_logs: bool = False) -> None:
        self.state_dir = work_dir / "state"
        self.log_path = work_dir / "l4m-up.log"
        spawner_port, scheduler_port, gateway_port = free_ports(3)
        self.gateway_url = f"http://127.0.0.1:{gateway_port}/v1"
        self.metrics_port_base = free_metrics_port_base() if metrics else 0
        self.spawner_address, self.scheduler_address = f"127.0.0.1:{spawner_port}", f"127.0.0.1:{scheduler_port}"
        argv = [str(L4M_CLI), "up", "--state-dir", str(self.state_dir), "--spawner-port", str(spawner_port),
                "--scheduler-port", str(scheduler_port), "--gateway-port", str(gateway_port),
                "--metrics-port-base", str(self.metrics_port_base),
                *([] if echo_logs else ["--quiet"]), *extra_args]
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                            env=service_env() if env is None else dict(env))

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

    @property
    def executor_socket(self) -> Path:
        """executor-0's Unix socket."""
        return self.state_dir / "internal" / "executor-0.sock"

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

    def logs(self, num_output_chars: int = 4000) -> str:
        """The tail of `l4m up`'s output, then of each service's log."""
        services = sorted((self.state_dir / "logs").glob("*.log"))
        parts = [f"----- l4m up -----\n{self.output()[-num_output_chars:]}"]
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


@contextlib.contextmanager
def up_cluster(work_dir: Path, extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
               metrics: bool = True, echo_logs: bool = False) -> Iterator[UpCluster]:
    """An `UpCluster` that is up, stopped on the way out (also when it never came up)."""
    cluster = UpCluster(work_dir, extra_args, env=env, metrics=metrics, echo_logs=echo_logs)
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
