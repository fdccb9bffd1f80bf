"""Real sandboxes for the spawner's integration tests: bubblewrap (every launch cold, or served by a
warm pool), and a real Docker engine.

The docker fixture starts an engine with the shared scripts when `docker info` fails, builds the
stand-in base image and the controller image once per machine (the controller tag is a content
hash, so later runs reuse it), and fails (does not skip) when any of that is impossible: the escape
suite must run on both backends.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from l4m.fake import tiny_tokenizer_json
from l4m.spawner.config import SpawnerConfig
from l4m.spawner.docker_image import ensure_controller_image
from l4m.spawner.docker_sandbox import DockerSandbox, DockerSandboxConfig
from l4m.spawner.process_command import ProcessSandboxConfig
from l4m.spawner.process_sandbox import ProcessSandbox
from l4m.spawner.sandbox import Sandbox
from l4m.wire.credentials import write_secret_file
from tests.integration.harness import ServiceProcess

# The repository carries copies of the engine / base-image helpers (scripts/ci), so a fresh clone has them.
SHARED_SCRIPTS = Path(__file__).resolve().parents[3] / "scripts" / "ci"
BASE_IMAGE = "python:3.11-slim"


def _run(command: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)


def _docker_engine_up() -> bool:
    return shutil.which("docker") is not None and _run(["docker", "info"], 30).returncode == 0


def _ensure_docker_engine() -> None:
    if _docker_engine_up():
        return
    script = SHARED_SCRIPTS / "docker-engine.sh"
    if not script.exists():
        pytest.fail(f"no Docker engine is running and {script} (which starts one) does not exist")
    result = _run(["bash", str(script)], 600)
    if result.returncode != 0 or not _docker_engine_up():
        pytest.fail(f"could not start a Docker engine with {script}:\n{result.stdout}\n{result.stderr}")


def _ensure_base_image() -> None:
    if _run(["docker", "image", "inspect", BASE_IMAGE], 60).returncode == 0:
        return
    script = SHARED_SCRIPTS / "base-image.sh"
    result = _run(["bash", str(script), BASE_IMAGE], 900)
    if result.returncode != 0:
        pytest.fail(f"could not build the base image {BASE_IMAGE} with {script}:\n{result.stderr[-4000:]}")


@pytest.fixture(scope="session")
def spawner_id() -> str:
    return f"test-{os.getpid()}"


@pytest.fixture(scope="session")
def process_sandbox(spawner_id: str) -> Iterator[ProcessSandbox]:
    sandbox = ProcessSandbox(ProcessSandboxConfig(spawner_id=spawner_id))
    yield sandbox
    sandbox.remove_cgroup_parents()


@pytest.fixture(scope="session")
def warm_socket_dir() -> Iterator[Path]:
    """The socket directory warm sandboxes are started with; a launch naming another one starts cold."""
    with tempfile.TemporaryDirectory(prefix="l4m-warm-sockets-") as directory:
        os.chmod(directory, 0o755)  # the sandbox uid must enter it
        yield Path(directory)


@pytest.fixture(scope="session")
def warm_process_sandbox(spawner_id: str, warm_socket_dir: Path) -> Iterator[ProcessSandbox]:
    """A process sandbox with a warm pool of 2 (default limits as its ceilings). Its pool lives on one
    event loop: tests run their launches through `harness.run_with`, which opens it full and closes it.
    Its uids do not overlap `process_sandbox`'s."""
    config = ProcessSandboxConfig(
        spawner_id=f"{spawner_id}-warm", uid_base=120_000, warm_pool_size=2, warm_socket_dir=warm_socket_dir
    )
    sandbox = ProcessSandbox(config)
    yield sandbox
    sandbox.remove_cgroup_parents()


@pytest.fixture(scope="session")
def docker_sandbox(spawner_id: str) -> DockerSandbox:
    import docker

    _ensure_docker_engine()
    _ensure_base_image()
    try:
        tag = ensure_controller_image(docker.from_env())
    except Exception as exc:  # noqa: BLE001 - any failure here must fail the suite with its reason
        pytest.fail(f"could not build the controller image: {exc}")
    return DockerSandbox(DockerSandboxConfig(image=tag, spawner_id=spawner_id))


@pytest.fixture(params=["process", "warm_process", pytest.param("docker", marks=pytest.mark.docker)])
def sandbox(request: pytest.FixtureRequest) -> Sandbox:
    return request.getfixturevalue(f"{request.param}_sandbox")


@dataclass(frozen=True)
class SchedulerCluster:
    """A real scheduler (with a simulated executor) whose L4M Unix sockets lie in `socket_dir` (gRPC's
    scheduler.sock, framed sessions' scheduler.frames.sock); its registry is on a separate socket,
    outside `socket_dir`, and needs the cluster secret."""

    socket_dir: Path
    registry_address: str  # the spawner's --scheduler
    scheduler_address: str  # TCP, for the test's own (anonymous) sessions
    cluster_secret_file: Path  # the spawner's --cluster-secret-file

    def spawner_config(self, tmp_path: Path, name: str, **overrides: object) -> SpawnerConfig:
        """A spawner of this cluster, its state in `tmp_path`, its id `name` and the test's."""
        return SpawnerConfig(
            state_dir=tmp_path / "state",
            socket_dir=self.socket_dir,
            spawner_id=f"{name}-{tmp_path.name[-20:]}",
            scheduler_registry_address=self.registry_address,
            cluster_secret_file=self.cluster_secret_file,
            **overrides,  # type: ignore[arg-type]
        )


@pytest.fixture
def scheduler_cluster(tmp_path: Path) -> Iterator[SchedulerCluster]:
    """`python -m l4m.scheduler.simulated` (serving the SDK fake's tiny tokenizer, so that controllers can
    tokenize) and `python -m l4m.scheduler` as real processes; their logs are printed at teardown (pytest
    shows them when the test fails)."""
    socket_dir = tmp_path / "sockets"
    socket_dir.mkdir()
    internal = tmp_path / "internal"
    secret_file = internal / "cluster.secret"
    write_secret_file(secret_file)
    registry_socket = internal / "registry.sock"
    tokenizer = internal / "tokenizer.json"
    tokenizer.write_text(tiny_tokenizer_json())
    executor = ServiceProcess(
        "l4m.scheduler.simulated",
        ["--listen", "127.0.0.1:0", "--num-kv-pages", "256", "--tokenizer-json", str(tokenizer)],
        tmp_path / "executor.log",
    )
    processes = [executor]
    try:
        executor_address = executor.wait_listening(30)
        scheduler_socket = socket_dir / "scheduler.sock"
        scheduler = ServiceProcess(
            "l4m.scheduler",
            ["--executor", executor_address, "--listen", "127.0.0.1:0",
             "--listen-unix", str(scheduler_socket), "--listen-framed", str(socket_dir / "scheduler.frames.sock"),
             "--allow-anonymous",
             "--registry-listen", f"unix:{registry_socket}", "--cluster-secret-file", str(secret_file)],
            tmp_path / "scheduler.log",
        )  # fmt: skip
        processes.append(scheduler)
        scheduler_address = scheduler.wait_listening(30)
        yield SchedulerCluster(socket_dir, f"unix:{registry_socket}", scheduler_address, secret_file)
    finally:
        for process in reversed(processes):
            process.stop()
            print(f"---- {process.log_path.name} ----\n{process.log_tail()}")
