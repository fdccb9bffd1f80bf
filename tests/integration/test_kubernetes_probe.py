"""The executors' Kubernetes health probe (deploy/kubernetes/base/probes/grpc_tls_health.py), run as the kubelet
runs it: a process with the pod's environment, against a real grpc.health.v1 server with TLS on loopback whose
certificate deploy/kubernetes/make-secrets.sh made (for *.executor.l4m.svc). It exits 0 only for SERVING over
a verified connection; NOT_SERVING, a name the certificate does not cover, another CA and a closed port each
exit 1 and say why."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "deploy/kubernetes/base/probes/grpc_tls_health.py"
POD_NAME = "executor-0.executor.l4m.svc"  # what the StatefulSet's pod executor-0 sets L4M_TLS_NAME to


def make_secrets(directory: Path) -> Path:
    """The executor-tls directory make-secrets.sh writes into `directory`."""
    env = {"PATH": "/usr/bin:/bin", "L4M": str(Path(sys.executable).parent / "l4m")}
    made = subprocess.run(["bash", str(ROOT / "deploy/kubernetes/make-secrets.sh"), "--dir", str(directory)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    return directory / "executor-tls"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_secrets(tmp_path_factory.mktemp("secrets"))


@pytest.fixture(scope="module")
def server(tls: Path) -> Iterator[tuple[int, health.HealthServicer]]:
    """A gRPC server with the standard health service, TLS with the executors' certificate, on 127.0.0.1."""
    grpc_server = grpc.server(ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, grpc_server)
    credentials = grpc.ssl_server_credentials((((tls / "tls.key").read_bytes(), (tls / "tls.crt").read_bytes()),))
    port = grpc_server.add_secure_port("127.0.0.1:0", credentials)
    grpc_server.start()
    try:
        yield port, servicer
    finally:
        grpc_server.stop(None)


def probe(address: str, ca: Path, name: str = POD_NAME) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "L4M_HEALTH_ADDR": address, "L4M_TLS_CA": str(ca), "L4M_TLS_NAME": name}
    return subprocess.run([sys.executable, str(PROBE)], env=env, capture_output=True, text=True, timeout=30)


def test_serving_passes_and_not_serving_fails(server: tuple[int, health.HealthServicer], tls: Path) -> None:
    port, servicer = server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    result = probe(f"127.0.0.1:{port}", tls / "ca.crt")
    assert result.returncode == 0, result.stderr
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    result = probe(f"127.0.0.1:{port}", tls / "ca.crt")
    assert result.returncode == 1
    assert "not serving: NOT_SERVING" in result.stderr
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)


def test_a_name_the_certificate_does_not_cover_fails(server: tuple[int, health.HealthServicer], tls: Path) -> None:
    port, servicer = server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    result = probe(f"127.0.0.1:{port}", tls / "ca.crt", name="executor-0.executor.other.svc")
    assert result.returncode == 1
    assert "health check failed: UNAVAILABLE" in result.stderr


def test_another_ca_fails(server: tuple[int, health.HealthServicer], tmp_path: Path) -> None:
    port, servicer = server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    result = probe(f"127.0.0.1:{port}", make_secrets(tmp_path) / "ca.crt")
    assert result.returncode == 1
    assert "health check failed: UNAVAILABLE" in result.stderr


def test_nobody_listening_fails(tls: Path) -> None:
    with socket.socket() as free:  # a port that was free a moment ago, now closed
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    result = probe(f"127.0.0.1:{port}", tls / "ca.crt")
    assert result.returncode == 1
    assert "health check failed: UNAVAILABLE" in result.stderr
