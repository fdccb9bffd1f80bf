"""`docker compose up` brings the cluster up from images built here, `l4m run` works against it, so does
the OpenAI gateway (with the admin key the `init` service made; without a key it answers 401), and
`docker compose down -v` leaves nothing behind.

One test, on purpose: it may take minutes (installing/starting an engine, building the base image and
the l4m images on a cold machine; about a minute when the images are current). It uses the host-network
override (this project's machines have no bridge network and cannot pull images), its own project name
and free ports, so it does not disturb a developer's `l4m up` or their own compose project. The services
export their spans to an OTLP receiver the test starts (Jaeger cannot be pulled here).

Never skipped: when Docker cannot be made to work, the test fails and says why.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.integration.harness import REPO, free_ports
from tests.integration.otlp_receiver import OtlpReceiver

pytestmark = [pytest.mark.docker, pytest.mark.slow]

PROJECT = "l4m-test"
COMPOSE = ["docker", "compose", "-p", PROJECT, "-f", "docker-compose.yml", "-f", "docker-compose.host.yml"]
LOCK = Path(tempfile.gettempdir()) / "l4m-compose-test.lock"  # one run of this project at a time
PROMPT = "What is 2+2?"
MAX_TOKENS = 8


def _run(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def _must(argv: list[str], timeout: float, what: str, env: dict[str, str] | None = None) -> str:
    result = _run(argv, timeout, env)
    if result.returncode != 0:
        pytest.fail(
            f"{what} failed (exit {result.returncode}): {' '.join(argv)}\n"
            f"--- stdout ---\n{result.stdout[-6000:]}\n--- stderr ---\n{result.stderr[-6000:]}",
            pytrace=False,
        )
    return result.stdout


def _ensure_docker() -> None:
    """A running engine with `docker compose`, and the base image; installed/started/built if missing."""
    if (
        shutil.which("docker") is None
        or _run(["docker", "info"], 60).returncode != 0
        or _run(["docker", "compose", "version"], 60).returncode != 0  # e.g. a plugin link left dangling
    ):
        _must(["scripts/ci/docker-engine.sh"], 900, "installing/starting a Docker engine and its compose plugin")
    _must(["docker", "info"], 60, "reaching the Docker engine")
    _must(["docker", "compose", "version"], 60, "docker compose (the v2 CLI plugin)")
    _must(["scripts/ci/base-image.sh", "python:3.11-slim"], 900, "providing the base image python:3.11-slim")


def _leftovers() -> dict[str, list[str]]:
    """What of this project the engine still has: containers, volumes, networks, controller containers."""
    project = f"label=com.docker.compose.project={PROJECT}"
    found = {
        "containers": _run(["docker", "ps", "-a", "-q", "--filter", project], 60).stdout.split(),
        "volumes": _run(["docker", "volume", "ls", "-q", "--filter", project], 60).stdout.split(),
        "networks": _run(["docker", "network", "ls", "-q", "--filter", project], 60).stdout.split(),
        "controller containers": _run(
            ["docker", "ps", "-a", "-q", "--filter", f"label=l4m.spawner={PROJECT}"], 60
        ).stdout.split(),
    }
    return {kind: ids for kind, ids in found.items() if ids}


def _remove_host_dir(path: Path) -> None:
    """The services write there as root; a non-root test removes it through a container."""
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        _run(["docker", "run", "--rm", "--network", "none", "-v", f"{path}:/d", "l4m:latest",
              "sh", "-c", "rm -rf /d/* /d/.[!.]*"], 120)
        shutil.rmtree(path, ignore_errors=True)


def _anonymous_status(url: str, model: str) -> int:
    """The HTTP status of a chat completion sent with no `authorization` header at all."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1})
    request = urllib.request.Request(url, data=body.encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


@contextlib.contextmanager
def _exclusive() -> Iterator[None]:
    with LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.mark.timeout(2400)
def test_compose_up_run_down() -> None:
    with _exclusive():
        _compose_up_run_down()


def _compose_up_run_down() -> None:
    started = time.monotonic()
    _ensure_docker()
    print(_must(["scripts/docker-build.sh"], 1800, "building the l4m images (scripts/docker-build.sh)"))

    host_dir = Path(tempfile.mkdtemp(prefix="l4m-compose-"))
    spawner_port, scheduler_port, gateway_port, *metrics_ports = free_ports(7)
    receiver = OtlpReceiver().__enter__()  # stopped in the finally below
    env = {
        **os.environ,
        "L4M_HOST_DIR": str(host_dir),
        "L4M_SPAWNER_PORT": str(spawner_port),
        "L4M_SCHEDULER_PORT": str(scheduler_port),
        "L4M_GATEWAY_PORT": str(gateway_port),
        "L4M_SPAWNER_METRICS_PORT": str(metrics_ports[0]),
        "L4M_SCHEDULER_METRICS_PORT": str(metrics_ports[1]),
        "L4M_EXECUTOR_METRICS_PORT": str(metrics_ports[2]),
        "L4M_GATEWAY_METRICS_PORT": str(metrics_ports[3]),
        "L4M_OTLP_ENDPOINT": receiver.endpoint,
    }
    env.pop("COMPOSE_FILE", None)
    env.pop("COMPOSE_PROJECT_NAME", None)
    _run([*COMPOSE, "down", "-v", "--remove-orphans"], 300, env)  # what an interrupted run left
    passed = False
    try:
        up = _run([*COMPOSE, "up", "-d", "--wait", "--wait-timeout", "600"], 660, env)
        assert up.returncode == 0, f"docker compose up failed:\n{up.stdout[-4000:]}\n{up.stderr[-4000:]}"
        up_s = time.monotonic() - started

        l4m = Path(sys.executable).with_name("l4m")
        program = "examples/controllers/text_completion.py"
        # The admin key the `init` service made (root's file on the host: read it through the spawner).
        key = _must([*COMPOSE, "exec", "-T", "spawner", "cat", f"{host_dir}/keys/admin.key"], 60,
                    "reading the admin key", env).strip()
        refused = _run([str(l4m), "run", "--spawner", f"127.0.0.1:{spawner_port}", program], 120, env)
        assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr, refused.stderr  # no key, no entry
        run = _run([str(l4m), "run", "--spawner", f"127.0.0.1:{spawner_port}", program, "--",
                    "--max-tokens", str(MAX_TOKENS), PROMPT], 300, {**env, "L4M_API_KEY": key})
        assert run.returncode == 0, f"l4m run exited {run.returncode}:\n{run.stdout}\n{run.stderr}"
        summaries = [json.loads(line) for line in run.stdout.splitlines() if line.startswith('{"prompt_tokens"')]
        assert summaries, f"no JSON summary line in the controller's output:\n{run.stdout}\n{run.stderr}"
        summary = summaries[-1]
        assert summary["prompt_tokens"] > 0
        assert len(summary["token_ids"]) == MAX_TOKENS or summary["stop"] not in ("", "length"), summary
        assert summary["text"].strip(), summary
        print(f"compose up (incl. build) {up_s:.0f} s; controller said: {summary['text']!r}")

        # The controller ran in a container of this spawner, removed when it exited.
        assert not _run(["docker", "ps", "-a", "-q", "--filter", f"label=l4m.spawner={PROJECT}"], 60).stdout.split()

        # The OpenAI gateway, with the same key: a greedy chat completion of a few tokens.
        gateway_url = f"http://127.0.0.1:{gateway_port}/v1"
        client = openai.OpenAI(base_url=gateway_url, api_key=key, max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                                temperature=0, max_tokens=MAX_TOKENS)
        assert answer.choices[0].message.content.strip(), answer
        print(f"gateway ({model}) said: {answer.choices[0].message.content!r}")
        assert _anonymous_status(f"{gateway_url}/chat/completions", model) == 401  # no key, no entry
        passed = True
    finally:
        if not passed:
            logs = _run([*COMPOSE, "logs", "--no-color", "--timestamps", "--tail", "200"], 120, env)
            print(f"--- docker compose logs ---\n{logs.stdout}\n{logs.stderr}")
            ps = _run([*COMPOSE, "ps", "-a"], 60, env)
            print(f"--- docker compose ps -a ---\n{ps.stdout}\n{ps.stderr}")
        down = _run([*COMPOSE, "down", "-v", "--remove-orphans", "--timeout", "30"], 300, env)
        receiver.__exit__(None, None, None)
        _remove_host_dir(host_dir)
    assert down.returncode == 0, f"docker compose down failed:\n{down.stdout}\n{down.stderr}"
    assert not _leftovers(), f"docker compose down -v left things behind: {_leftovers()}"

    # Each service flushes its spans when it stops: all three reached the receiver from their containers.
    services = {span.service for span in receiver.spans}
    assert {"l4m.spawner", "l4m.controller", "l4m.scheduler", "l4m.executor"} <= services, services
    # ... and the launch is one trace across the spawner, the controller (its spans forwarded by the
    # spawner) and the scheduler.
    by_trace: dict[str, set[str]] = {}
    for span in receiver.spans:
        by_trace.setdefault(span.trace_id, set()).add(span.service)
    assert any({"l4m.spawner", "l4m.controller", "l4m.scheduler"} <= found for found in by_trace.values()), by_trace
    print(f"total {time.monotonic() - started:.0f} s; {len(receiver.spans)} spans from {sorted(services)}")
