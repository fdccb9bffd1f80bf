"""The attack suite's tools: a raw SpawnerService client that presents a given API key (or none), the
two users' keys, made once with `l4m keys add` on the session's shared `l4m up`, and the baseline every
test of this directory is compared with at its end (`test_zz_unharmed.py`): taken before the first one."""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from l4m.v1 import spawner_pb2, spawner_pb2_grpc
from l4m.wire.credentials import bearer_metadata
from tests.integration.harness import L4M_CLI, REPO, UpCluster, service_env

CONTROLLERS = Path(__file__).parent / "controllers"
ATTACKER = CONTROLLERS / "attacker.py"
TEXT_COMPLETION = REPO / "examples" / "controllers" / "text_completion.py"
GREEDY_ARGS = ("--no-stream", "--max-tokens", "12", "Name a colour.")
CLI_TIMEOUT_S = 300


@dataclass
class Ended:
    """One instance's events: its messages and how it ended."""

    instance_id: str
    messages: list[str] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)
    exit: spawner_pb2.InstanceExit | None = None

    @property
    def reason(self) -> str:
        return spawner_pb2.ExitReason.Name(self.exit.reason) if self.exit is not None else "none"

    def describe(self) -> str:
        return (f"{self.instance_id}: {self.reason}: {self.exit.message if self.exit else ''}\n"
                f"messages: {self.messages}\nlogs: {self.logs[-20:]}")


class Spawner:
    """SpawnerService over a plain channel, every call with `authorization: Bearer <key>` (none: no key)."""

    def __init__(self, address: str, key: str | None) -> None:
        self._channel = grpc.insecure_channel(address)
        self.stub = spawner_pb2_grpc.SpawnerServiceStub(self._channel)
        self.metadata = bearer_metadata(key) if key else ()
        self.held: list[grpc.Call] = []  # attach streams kept open

    def close(self) -> None:
        for stream in self.held:
            stream.cancel()
        self._channel.close()

    def upload(self, path: Path) -> str:
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        header = spawner_pb2.ProgramHeader(size_bytes=len(data), sha256=digest, filename=path.name)
        parts = [spawner_pb2.UploadProgramRequest(header=header), spawner_pb2.UploadProgramRequest(chunk=data)]
        return self.stub.UploadProgram(iter(parts), timeout=60, metadata=self.metadata).sha256

    def launch(self, path: Path, args: Sequence[str], limits: spawner_pb2.Limits | None = None,
               detached: bool = False) -> str:
        request = spawner_pb2.LaunchRequest(program=self.upload(path), args=list(args), limits=limits,
                                            detached=detached)
        return self.stub.Launch(request, timeout=60, metadata=self.metadata).instance_id

    def attach(self, instance_id: str, timeout_s: float = 120) -> Ended:
        ended = Ended(instance_id)
        for event in self.stub.Attach(spawner_pb2.AttachRequest(instance_id=instance_id), timeout=timeout_s,
                                      metadata=self.metadata):
            kind = event.WhichOneof("event")
            if kind == "message":
                ended.messages.append(event.message.text)
            elif kind == "log":
                ended.logs.append(event.log.line)
            elif kind == "exit":
                ended.exit = event.exit
        return ended

    def run(self, path: Path, *args: str, limits: spawner_pb2.Limits | None = None) -> Ended:
        return self.attach(self.launch(path, args, limits))

    def wait_for_message(self, instance_id: str, timeout_s: float = 60) -> str:
        """The instance's first message. The attach stream stays open (in `self.held`): the instance is not
        detached, so the end of its last attach would end it."""
        stream = self.stub.Attach(spawner_pb2.AttachRequest(instance_id=instance_id), timeout=timeout_s,
                                  metadata=self.metadata)
        for event in stream:
            if event.WhichOneof("event") == "message":
                self.held.append(stream)
                return event.message.text
        raise AssertionError(f"{instance_id} ended before sending anything")


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05) -> float:  # type: ignore[no-untyped-def]
    """Seconds until `predicate()` held; raises AssertionError past `timeout_s`."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"not within {timeout_s} s")
        time.sleep(interval_s)
    return time.monotonic() - started


@dataclass
class Users:
    admin: Spawner
    alice: Spawner
    bob: Spawner
    anonymous: Spawner
    alice_key: str
    bob_key: str


@pytest.fixture(scope="session")
def users(l4m_up: UpCluster) -> Iterator[Users]:
    alice_key, bob_key = l4m_up.add_user_key("alice"), l4m_up.add_user_key("bob")
    users = Users(Spawner(l4m_up.spawner_address, l4m_up.admin_key), Spawner(l4m_up.spawner_address, alice_key),
                  Spawner(l4m_up.spawner_address, bob_key), Spawner(l4m_up.spawner_address, None),
                  alice_key, bob_key)
    yield users
    for spawner in (users.admin, users.alice, users.bob, users.anonymous):
        spawner.close()


def greedy_completion(l4m_up: UpCluster) -> list[int]:
    """The tokens of a normal controller's greedy completion, run as the admin through `l4m run`."""
    argv = [str(L4M_CLI), "run", "--spawner", l4m_up.spawner_address, "--api-key-file", str(l4m_up.admin_key_path),
            str(TEXT_COMPLETION), "--", *GREEDY_ARGS]
    proc = subprocess.run(argv, cwd=REPO, env=service_env(), capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.splitlines()[-1])["token_ids"]


def pages_used(l4m_up: UpCluster) -> dict[str, float]:
    """KV pages and embedding slots held, as the scheduler counts them and as the executor does."""
    scheduler, executor = l4m_up.metrics("scheduler"), l4m_up.metrics("executor")
    return {
        "scheduler_kv_pages": scheduler.value("l4m_scheduler_kv_pages_used"),
        "executor_kv_pages": executor.value("l4m_executor_kv_pages_used"),
        "scheduler_embed_slots": scheduler.value("l4m_scheduler_embed_slots_used"),
        "executor_embed_slots": executor.value("l4m_executor_embed_slots_used"),
    }


@dataclass(frozen=True)
class Baseline:
    """A clean cluster, before the first attack: the greedy tokens, and what was held then (the session's
    cluster is shared with earlier test modules, whose persistent exports may hold some pages)."""

    tokens: list[int]
    held: dict[str, float]


@pytest.fixture(scope="session")
def baseline(l4m_up: UpCluster) -> Baseline:
    return Baseline(greedy_completion(l4m_up), pages_used(l4m_up))


@pytest.fixture(autouse=True)
def _baseline_before_the_first_attack(request: pytest.FixtureRequest) -> None:
    """Every test here runs after the baseline was taken, whichever of them runs first (or alone)."""
    if "l4m_up" in request.fixturenames or "users" in request.fixturenames:
        request.getfixturevalue("baseline")
