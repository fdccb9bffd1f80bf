"""TLS end to end: `l4m up --tls-cert --tls-key` (a CA-signed certificate for 127.0.0.1), `l4m run --tls-ca`
completes a controller, and a plaintext client is refused on the spawner's and the scheduler's ports."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from l4m.v1 import spawner_pb2, spawner_pb2_grpc
from l4m.wire.credentials import bearer_metadata
from tests.integration.harness import L4M_CLI, REPO, UpCluster, service_env, up_cluster
from tests.integration.tls_certs import CertificateFiles, make_certificates

TEXT_COMPLETION = REPO / "examples" / "controllers" / "text_completion.py"


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[UpCluster, CertificateFiles]]:
    work = tmp_path_factory.mktemp("l4m-up-tls")
    certs = make_certificates(work / "certs")
    with up_cluster(work, ["--tls-cert", str(certs.cert_path), "--tls-key", str(certs.key_path),
                           "--tls-ca", str(certs.ca_path)]) as cluster:
        yield cluster, certs


def test_l4m_run_over_tls_completes(tls_cluster: tuple[UpCluster, CertificateFiles]) -> None:
    cluster, certs = tls_cluster
    argv = [str(L4M_CLI), "run", "--spawner", cluster.spawner_address, "--tls-ca", str(certs.ca_path),
            "--api-key-file", str(cluster.admin_key_path), str(TEXT_COMPLETION), "--", "--no-stream",
            "--max-tokens", "4", "Say hi."]
    proc = subprocess.run(argv, cwd=REPO, env=service_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{cluster.logs()}"
    assert '"token_ids"' in proc.stdout.splitlines()[-1]


def test_a_plaintext_client_is_refused(tls_cluster: tuple[UpCluster, CertificateFiles]) -> None:
    cluster, certs = tls_cluster
    with grpc.insecure_channel(cluster.spawner_address) as channel:
        stub = spawner_pb2_grpc.SpawnerServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.ListInstances(spawner_pb2.ListInstancesRequest(), timeout=5,
                               metadata=bearer_metadata(cluster.admin_key))
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
    with grpc.insecure_channel(cluster.scheduler_address) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
    # ... while a TLS client that trusts the CA is served (the key still decides what it sees).
    credentials = grpc.ssl_channel_credentials(certs.ca_path.read_bytes())
    with grpc.secure_channel(cluster.spawner_address, credentials) as channel:
        stub = spawner_pb2_grpc.SpawnerServiceStub(channel)
        stub.ListInstances(spawner_pb2.ListInstancesRequest(), timeout=10, metadata=bearer_metadata(cluster.admin_key))
