"""Who may read the services' /metrics: by default only this host's loopback. The endpoints carry counts,
latencies and page usage, no prompts, tokens or keys (docs/security.md), but they have no authentication,
so they listen on 127.0.0.1 unless the operator names another address with --metrics-host (compose and
Kubernetes do, inside networks only their Prometheus shares).

Checked on the listening sockets themselves (/proc/net/tcp*: bound to 127.0.0.1, nothing on a wildcard or
IPv6 address) and by connecting: 127.0.0.1 answers, 127.0.0.2 (loopback too, but not the bound address,
as any other address of the host) is refused. Every service `l4m up` starts is checked, the gateway
included; the gateway's labels are its own routes, never a path a caller made up (which could carry
anything, a key included)."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

import pytest

from tests.integration.harness import METRICS_OFFSETS, ServiceProcess, UpCluster, free_port
from tests.integration.scheduler.scheduler_procs import Cluster

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column


def _listening_addresses(port: int) -> list[str]:
    """The local addresses of the TCP sockets listening on `port` in this network namespace."""
    found = []
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        for line in table.read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].rsplit(":", 1)
            if fields[3] == _LISTEN and int(port_hex, 16) == port:
                raw = bytes.fromhex(address)
                # The kernel prints each 32-bit word in host order (little-endian here).
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.append(socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words))
    return found


def _answers(host: str, port: int) -> bool:
    """True when http://host:port/metrics answers 200; False when the connection is refused."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
            return response.status == 200 and b"# TYPE" in response.read()
    except urllib.error.URLError as error:
        if isinstance(error.reason, ConnectionRefusedError):
            return False
        raise


def test_metrics_listen_on_loopback_only_by_default(l4m_up: UpCluster) -> None:
    for service, offset in METRICS_OFFSETS.items():
        port = l4m_up.metrics_port_base + offset
        assert _listening_addresses(port) == ["127.0.0.1"], (service, _listening_addresses(port))
        assert _answers("127.0.0.1", port), service
        assert not _answers("127.0.0.2", port), f"{service}'s metrics answer on an address not bound"


def test_metrics_host_names_the_one_address_metrics_listen_on() -> None:
    cluster = Cluster()
    port = free_port()
    try:
        executor = cluster.simulated_executor()
        cluster.scheduler(executor, extra=("--allow-anonymous", "--metrics-port", str(port),
                                           "--metrics-host", "127.0.0.2"))
        assert _listening_addresses(port) == ["127.0.0.2"]
        assert _answers("127.0.0.2", port)
        assert not _answers("127.0.0.1", port)
    except BaseException:
        for process in cluster.processes:
            print(f"----- {process.name} log -----\n{process.log_tail(8000)}")
        raise
    finally:
        cluster.stop()


def test_the_gateways_metrics_host_names_the_one_address_and_no_caller_path_becomes_a_label(tmp_path: Path) -> None:
    port = free_port()
    nowhere = f"unix:{tmp_path / 'no-scheduler.sock'}"  # the gateway dials lazily: no cluster needed here
    gateway = ServiceProcess("l4m.gateway", ["--port", "0", "--insecure-local", "--scheduler", nowhere,
                                             "--registry", nowhere, "--metrics-port", str(port),
                                             "--metrics-host", "127.0.0.2"], name="gateway")
    try:
        http = gateway.wait_listening()
        assert _listening_addresses(port) == ["127.0.0.2"]
        assert _answers("127.0.0.2", port)
        assert not _answers("127.0.0.1", port)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{http}/v1/sk-pasted-by-mistake", timeout=10)
        assert refused.value.code == 404
        with urllib.request.urlopen(f"http://127.0.0.2:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
        assert 'l4m_gateway_requests_total{code="404",endpoint="other"} 1.0' in text
        assert "sk-pasted" not in text
    except BaseException:
        print(f"----- gateway log -----\n{gateway.log_tail(8000)}")
        raise
    finally:
        gateway.stop()


def test_a_bad_metrics_host_stops_the_service_before_it_listens() -> None:
    cluster = Cluster()
    try:
        with pytest.raises(RuntimeError, match="--metrics-host must be an IP address") as error:
            cluster.scheduler("127.0.0.1:1", extra=("--metrics-port", "1", "--metrics-host", "everywhere"))
        assert "got 'everywhere'" in str(error.value)
    finally:
        cluster.stop()
