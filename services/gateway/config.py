"""The gateway's configuration, built once by `__main__` from flags."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from l4m.common.metrics import METRICS_OFF, MetricsEndpoint


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 7412  # 0: any free port
    scheduler_address: str = "127.0.0.1:7411"  # L4MService: `host:port`, `unix:PATH` or `framed:PATH`
    registry_address: str = ""  # InstanceRegistryService: each request runs as an instance registered there
    cluster_secret: str = ""  # the registry's bearer secret
    registry_tls_ca: Path | None = None
    keys_path: Path | None = None  # the API keys (`l4m keys`); the same store as the spawner's
    # The spawner's user API (`host:port`): requests naming `l4m/<program>` run there as their caller; "": none.
    spawner_address: str = ""
    spawner_tls_ca: Path | None = None  # CA of a TLS spawner
    insecure_local: bool = False  # a request without a key is the admin user "local" (one-person machines)
    max_n: int = 8  # most choices one request may ask for (`n`), each a fork of the prompt
    # Requests of one user in flight at once (its key's max_instances when it sets one); past it: 429.
    max_requests_per_user: int = 64
    max_tokens_default: int = 4096  # completion tokens when a chat request names no max_tokens
    max_request_bytes: int = 4 << 20
    # Automatic prefix caching (prefix_cache.py): KV pages of cached prompt prefixes at most; 0: off.
    prefix_cache_pages: int = 512
    metrics: MetricsEndpoint = METRICS_OFF  # Prometheus /metrics (metrics.py): port 0 is off, loopback by default
