"""`python -m l4m.gateway`: the OpenAI-compatible HTTP API over a scheduler; prints the bound address."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import Sequence
from pathlib import Path

import uvicorn

from l4m import eventloop
from l4m.common.metrics import add_metrics_flags, metrics_endpoint, start_metrics_server
from l4m.common.serving import serve_until_signal
from l4m.common.users import Authenticator
from l4m.gateway.backend import ClusterBackend
from l4m.gateway.config import GatewayConfig
from l4m.gateway.metrics import GatewayMetrics
from l4m.gateway.programs import SpawnerClient
from l4m.gateway.server import create_app
from l4m.telemetry import configure_tracing, shutdown_tracing
from l4m.wire.credentials import CredentialError, read_secret_file

log = logging.getLogger("l4m.gateway")


def parse_config(argv: Sequence[str] | None = None) -> GatewayConfig:
    parser = argparse.ArgumentParser(prog="python -m l4m.gateway", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (HTTP)")
    parser.add_argument("--port", type=int, default=7412, help="port (0 picks one)")
    parser.add_argument("--scheduler", default="127.0.0.1:7411",
                        help="the scheduler's L4M service: host:port, unix:PATH or framed:PATH")
    parser.add_argument("--registry", default="", help="the scheduler's InstanceRegistryService (unix:PATH or "
                        "host:port): every request runs as an instance of its caller's user, registered there")
    parser.add_argument("--spawner", default="", help="the spawner's user API (host:port): a request naming "
                        "`l4m/<program>` runs that stored program there, as its caller (default: none)")
    parser.add_argument("--spawner-tls-ca", type=Path, default=None, help="CA of a TLS --spawner")
    parser.add_argument("--cluster-secret-file", type=Path, default=None, help="the registry's secret (mode 0600)")
    parser.add_argument("--registry-tls-ca", type=Path, default=None, help="CA of a TLS registry address")
    parser.add_argument("--keys-file", type=Path, default=None,
                        help="API keys (`l4m keys`): the same store as the spawner's; callers send `authorization: "
                        "Bearer <key>`")
    parser.add_argument("--insecure-local", action="store_true",
                        help="a request without a key is the admin user 'local' (a one-person machine only)")
    parser.add_argument("--max-n", type=int, default=8, help="most choices one request may ask for")
    parser.add_argument("--max-requests-per-user", type=int, default=64,
                        help="requests of one user in flight at once (a key's max_instances overrides); past it 429")
    parser.add_argument("--max-tokens-default", type=int, default=4096,
                        help="completion tokens of a chat request that names no max_tokens (at most what the "
                        "context leaves)")
    parser.add_argument("--prefix-cache-pages", type=int, default=512,
                        help="KV pages of cached prompt prefixes at most (automatic prefix caching, per user); 0: off")
    add_metrics_flags(parser)
    args = parser.parse_args(argv)
    metrics = metrics_endpoint(parser, args)
    if not args.keys_file and not args.insecure_local:
        parser.error("give --keys-file (API keys) or --insecure-local")
    if args.max_n < 1:
        parser.error(f"--max-n must be at least 1, got {args.max_n}")
    if args.prefix_cache_pages < 0:
        parser.error(f"--prefix-cache-pages must be 0 (off) or more, got {args.prefix_cache_pages}")
    try:
        secret = read_secret_file(args.cluster_secret_file) if args.cluster_secret_file else ""
    except CredentialError as error:
        parser.error(str(error))
    return GatewayConfig(host=args.host, port=args.port, scheduler_address=args.scheduler,
                         registry_address=args.registry, cluster_secret=secret, registry_tls_ca=args.registry_tls_ca,
                         keys_path=args.keys_file, spawner_address=args.spawner, spawner_tls_ca=args.spawner_tls_ca,
                         insecure_local=args.insecure_local, max_n=args.max_n,
                         max_requests_per_user=args.max_requests_per_user,
                         max_tokens_default=args.max_tokens_default, prefix_cache_pages=args.prefix_cache_pages,
                         metrics=metrics)


async def serve(config: GatewayConfig) -> None:
    backend = await ClusterBackend.connect(config)
    spawner = SpawnerClient(config.spawner_address, config.spawner_tls_ca) if config.spawner_address else None
    metrics = GatewayMetrics()
    app = create_app(config, backend, Authenticator(config.keys_path, config.insecure_local), spawner, metrics)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                           lifespan="off", access_log=False))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # serve_until_signal's
    task: asyncio.Task[None] | None = None

    async def start() -> None:
        nonlocal task
        start_metrics_server(config.metrics.port, metrics.registry, host=config.metrics.host)
        task = asyncio.create_task(server.serve())
        while not server.started:
            if task.done():
                await task  # raises why it could not start
                raise RuntimeError(f"the gateway could not listen on {config.host}:{config.port}")
            await asyncio.sleep(0.05)
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        print(f"l4m gateway listening on http://{host}:{port}", flush=True)

    async def stop() -> None:
        server.should_exit = True
        if task is not None:
            await task
        await backend.close()
        if spawner is not None:
            await spawner.close()

    await serve_until_signal(start, stop)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = parse_config(argv)
    configure_tracing("l4m.gateway")  # `gateway.request` spans (tracing.py), when OTEL_* asks for them
    try:
        with contextlib.suppress(KeyboardInterrupt):
            eventloop.run(serve(config))
    finally:
        shutdown_tracing()


if __name__ == "__main__":
    main()
