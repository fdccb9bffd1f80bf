"""Issue 16 over real gRPC: the scheduler's registry lives on its own listener behind the cluster
secret, the L4M listeners serve no registry, TCP listeners speak TLS, and a controller without the
admin role cannot retune batching. Each refusal names why; the offender alone is affected."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from scheduler_procs import Cluster, sync_channel

from l4m.scheduler import requests as rq
from l4m.spawner.instances import RegistrationRefused
from l4m.spawner.registry_client import GrpcInstanceRegistry
from l4m.v1 import l4m_pb2, l4m_pb2_grpc, registry_pb2, registry_pb2_grpc
from l4m.wire.credentials import bearer_metadata, write_secret_file
from tests.integration.harness import REPO, free_port
from tests.integration.tls_certs import make_certificates

DEADLINE_S = 10


class Planes:
    """A simulated executor and a scheduler with its L4M listeners and its registry listener."""

    def __init__(self, cluster: Cluster, tmp_path: Path, *extra: str, registry_tcp: bool = False,
                 ca_path: Path | None = None) -> None:
        self.secret_file = tmp_path / "internal" / "cluster.secret"
        self.secret = write_secret_file(self.secret_file)
        self.l4m_unix = tmp_path / "scheduler.sock"
        self.registry = f"127.0.0.1:{free_port()}" if registry_tcp else f"unix:{tmp_path}/internal/registry.sock"
        executor = cluster.simulated_executor("--num-kv-pages", "32")
        self.l4m = cluster.scheduler(executor, extra=("--listen-unix", str(self.l4m_unix), "--registry-listen",
                                                      self.registry, "--cluster-secret-file", str(self.secret_file),
                                                      *extra), ca_path=ca_path)
        self.ca_path = ca_path

    def registry_client(self, secret: str | None = None) -> GrpcInstanceRegistry:
        return GrpcInstanceRegistry(self.registry, self.secret if secret is None else secret, tls_ca=self.ca_path,
                                    deadline_s=DEADLINE_S)

    def session(self, token: str, *requests: l4m_pb2.SessionRequest) -> tuple[list[l4m_pb2.SessionResponse], grpc.StatusCode]:
        """Runs one session to its end: (events, final status)."""
        with sync_channel(self.l4m, self.ca_path) as channel:
            call = l4m_pb2_grpc.L4MServiceStub(channel).Session(iter(requests), metadata=(("l4m-instance-token", token),),
                                                                timeout=DEADLINE_S)
            events = []
            try:
                events.extend(call)
            except grpc.RpcError as error:
                return events, error.code()  # type: ignore[attr-defined]
            return events, grpc.StatusCode.OK


def _register(planes: Planes, instance_id: str, **fields: object) -> str:
    token = f"token-of-{instance_id}-0123456789"

    async def register() -> None:
        client = planes.registry_client()
        try:
            await client.register(instance_id, token, 0, 1, **fields)  # type: ignore[arg-type]
        finally:
            await client.close()

    asyncio.run(register())
    return token


def _generate(planes: Planes, token: str) -> tuple[list[l4m_pb2.SessionResponse], grpc.StatusCode]:
    return planes.session(token, rq.allocate([0]), rq.forward_text([0], 3, [1, 2, 3], outputs=[2], request_id=7))


def _raw_registry_call(address: str, metadata: tuple[tuple[str, str], ...] = ()) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as channel:
        stub = registry_pb2_grpc.InstanceRegistryServiceStub(channel)
        request = registry_pb2.RegisterInstanceRequest(instance_id="ghost", token="ghost-token-0123456789",
                                                       launched_at_unix_ms=1)
        try:
            stub.RegisterInstance(request, metadata=metadata, timeout=DEADLINE_S)
        except grpc.RpcError as error:
            return error.code()  # type: ignore[attr-defined]
        return grpc.StatusCode.OK


def test_the_l4m_listeners_serve_no_registry(cluster: Cluster, tmp_path: Path) -> None:
    planes = Planes(cluster, tmp_path)
    secret = bearer_metadata(planes.secret)
    assert _raw_registry_call(planes.l4m, secret) == grpc.StatusCode.UNIMPLEMENTED
    assert _raw_registry_call(f"unix:{planes.l4m_unix}", secret) == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("metadata", [(), bearer_metadata("not-the-cluster-secret-at-all"), (("authorization", "Basic x"),)],
                         ids=["no secret", "wrong secret", "not a bearer"])
def test_every_registry_call_needs_the_cluster_secret(cluster: Cluster, tmp_path: Path,
                                                      metadata: tuple[tuple[str, str], ...]) -> None:
    planes = Planes(cluster, tmp_path)
    assert _raw_registry_call(planes.registry, metadata) == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(planes.registry) as channel:
        stub = registry_pb2_grpc.InstanceRegistryServiceStub(channel)
        with pytest.raises(grpc.RpcError) as destroy:
            stub.DestroyInstance(registry_pb2.DestroyInstanceRequest(instance_id="x"), metadata=metadata,
                                 timeout=DEADLINE_S)
        with pytest.raises(grpc.RpcError) as watch:
            next(iter(stub.WatchInstanceEvents(registry_pb2.WatchInstanceEventsRequest(), metadata=metadata,
                                               timeout=DEADLINE_S)))
    assert destroy.value.code() == watch.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    assert "cluster secret" in destroy.value.details()  # type: ignore[attr-defined]
    _, status = _generate(planes, "ghost-token-0123456789")  # the refused registration left nothing
    assert status == grpc.StatusCode.UNAUTHENTICATED


def test_the_spawner_client_registers_with_the_secret_and_the_instance_runs(cluster: Cluster, tmp_path: Path) -> None:
    planes = Planes(cluster, tmp_path)
    token = _register(planes, "alice-1", user="alice")
    events, status = _generate(planes, token)
    assert status == grpc.StatusCode.OK and [e.request_id for e in events if e.HasField("forward_text")] == [7]


def test_a_non_admin_instance_cannot_retune_batching(cluster: Cluster, tmp_path: Path) -> None:
    planes = Planes(cluster, tmp_path)
    offender = _register(planes, "mallory-1", user="mallory")
    events, status = planes.session(offender, rq.allocate([0]), rq.debug_query("batching:k-only:100000", request_id=3))
    assert status == grpc.StatusCode.PERMISSION_DENIED
    trap = next(e.trap for e in events if e.HasField("trap"))
    assert trap.kind == l4m_pb2.TRAP_KIND_PERMISSION_DENIED and "needs an admin instance" in trap.reason
    bystander = _register(planes, "alice-1", user="alice")
    events, status = planes.session(bystander, rq.debug_query("batching", request_id=1),
                                    rq.allocate([0]), rq.forward_text([0], 1, [1], outputs=[0], request_id=2))
    assert status == grpc.StatusCode.OK and events[0].debug_query.response == "adaptive"
    admin = _register(planes, "root-1", user="root", is_admin=True)
    events, status = planes.session(admin, rq.debug_query("batching:k-or-t:2:1", request_id=1))
    assert status == grpc.StatusCode.OK and events[0].debug_query.response == "k-or-t:2:1"


def test_registrations_past_max_instances_are_refused(cluster: Cluster, tmp_path: Path) -> None:
    planes = Planes(cluster, tmp_path, "--max-instances", "2")
    _register(planes, "a")
    _register(planes, "b")
    with pytest.raises(RegistrationRefused, match="RESOURCE_EXHAUSTED.*maximum of 2 instances"):
        _register(planes, "c")

    async def destroy_then_register() -> None:
        client = planes.registry_client()
        await client.destroy("a", "done")
        await client.register("c", "token-of-c-0123456789", 0, 1)
        await client.close()

    asyncio.run(destroy_then_register())


def test_tls_listeners_work_with_the_ca_and_refuse_plaintext(cluster: Cluster, tmp_path: Path) -> None:
    certificates = make_certificates(tmp_path / "tls")
    planes = Planes(cluster, tmp_path, "--tls-cert", str(certificates.cert_path), "--tls-key",
                    str(certificates.key_path), registry_tcp=True, ca_path=certificates.ca_path)
    token = _register(planes, "alice-1", user="alice")  # the registry over TLS, with the CA
    events, status = _generate(planes, token)
    assert status == grpc.StatusCode.OK and any(e.HasField("forward_text") for e in events)
    with grpc.insecure_channel(planes.l4m) as channel, pytest.raises(grpc.RpcError) as plaintext:
        l4m_pb2_grpc.L4MServiceStub(channel).GetInfo(l4m_pb2.GetInfoRequest(), timeout=3)
    assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    assert _raw_registry_call(planes.registry, bearer_metadata(planes.secret)) == grpc.StatusCode.UNAVAILABLE


def test_the_scheduler_refuses_to_start_a_registry_without_the_secret(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "l4m.scheduler", "--executor", "127.0.0.1:1", "--registry-listen",
                             f"unix:{tmp_path}/registry.sock"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--registry-listen needs --cluster-secret-file" in result.stderr
