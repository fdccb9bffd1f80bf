"""The attack suite's tools: a raw SpawnerService client that presents a given API key (or none), and
the two users' keys, made once with `l4m keys add` on the session's shared `l4m up`."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from l4m.credentials import bearer_metadata
from l4m.v1 import spawner_pb2, spawner_pb2_grpc
from tests.integration.conftest import UpCluster

CONTROLLERS = Path(__file__).parent / "controllers"
ATTACKER = CONTROLLERS / "attacker.py"


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
