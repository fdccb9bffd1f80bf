"""`python -m l4m.scheduler`: the L4M scheduler service."""

from __future__ import annotations

import argparse
import gc
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from l4m import eventloop
from l4m.common.metrics import (
    METRICS_OFF,
    MetricsEndpoint,
    add_metrics_flags,
    metrics_endpoint,
    start_metrics_server,
)
from l4m.common.serving import bound_address, serve_until_signal
from l4m.scheduler.batcher import parse_strategy
from l4m.scheduler.config import SchedulerConfig
from l4m.scheduler.framed import FramedServer
from l4m.scheduler.links import EXECUTOR_TRANSPORTS
from l4m.scheduler.server import create_registry_server, create_server
from l4m.telemetry import configure_tracing, shutdown_tracing
from l4m.wire.credentials import CredentialError, read_secret_file, tls_files
from l4m.wire.rules import MAX_CONTINUATION_STEPS


def parse_config(argv: Sequence[str] | None = None) -> tuple[SchedulerConfig, MetricsEndpoint]:
    parser = argparse.ArgumentParser(prog="python -m l4m.scheduler", description="The l4m scheduler (L4M service).")
    parser.add_argument("--listen", default="127.0.0.1:50051", help="host:port for gRPC (port 0 picks one)")
    parser.add_argument("--listen-unix", default=None, help="also listen on this Unix socket path")
    parser.add_argument("--listen-framed", default=None,
                        help="also serve L4M sessions over length-prefixed frames on this Unix socket path "
                        "(clients connect to framed:PATH; ~4x less CPU per message than gRPC)")
    parser.add_argument("--registry-listen", default=None,
                        help="address of the InstanceRegistryService (the spawner's control plane), e.g. "
                        "unix:/state/internal/registry.sock; never the --listen addresses. Needs --cluster-secret-file")
    parser.add_argument("--cluster-secret-file", type=Path, default=None,
                        help="file (mode 0600) holding the cluster secret: registry callers must present it, "
                        "and it is sent to the executors")
    parser.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate chain: TLS on the TCP listeners")
    parser.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    parser.add_argument("--executor-tls-ca", type=Path, default=None,
                        help="PEM CA that signed the executors' certificates (connect to them over TLS)")
    parser.add_argument("--max-instances", type=int, default=1024,
                        help="registered instances at most; more registrations answer RESOURCE_EXHAUSTED")
    parser.add_argument("--executor", action="append", default=[], help="executor address host:port (repeatable)")
    parser.add_argument("--executor-transport", default="auto", choices=list(EXECUTOR_TRANSPORTS),
                        help="auto: send batches on an executor's framed Execute socket where it offers one on this "
                        "host (GetInfo's framed_execute_path), else on gRPC; grpc: always gRPC")
    parser.add_argument("--batching", default="adaptive",
                        help="adaptive | adaptive:<max_hold_ms>[:<launch_hold_ms>[:<hold_fraction>]] | t-only:<t_ms> | k-only:<k> | "
                        "k-or-t:<k>:<t_ms> (forward batches)")
    parser.add_argument("--page-budget", type=int, default=0, help="max KV pages per instance (0: executor capacity)")
    parser.add_argument("--slot-budget", type=int, default=0, help="max embed slots per instance (0: executor capacity)")
    parser.add_argument("--allow-anonymous", action="store_true", help="dev only: accept sessions without a token")
    parser.add_argument("--max-continuation-steps", type=int, default=MAX_CONTINUATION_STEPS,
                        help="decode steps one forward_text may ask the executor to run on its own "
                        f"(0..{MAX_CONTINUATION_STEPS}; 0 turns continuation off)")
    parser.add_argument("--prefill-chunk-tokens", type=int, default=0,
                        help="a forward_text with more tokens runs as chunks of at most this many, each batched "
                        "beside other streams' decode steps (0: half the executors' max_batch_tokens, at most 2048)")
    parser.add_argument("--prefill-chunk-token-slots", type=int, default=0,
                        help="what one chunk token's own work (its linears) costs in context slots of attention: "
                        "with > 0, chunks shrink as their context grows so that each costs about what the first "
                        "chunk of --prefill-chunk-tokens does (0: chunks of --prefill-chunk-tokens at any context)")
    parser.add_argument("--max-waiting-instances", type=int, default=256,
                        help="instances that may wait at once for kv pages nobody can free for them (the admission "
                        "queue); one more traps RESOURCE_EXHAUSTED; 0: no queue, such an allocation traps at once")
    parser.add_argument("--admission-timeout-s", type=float, default=60.0,
                        help="how long an instance may wait in the admission queue before it traps RESOURCE_EXHAUSTED")
    parser.add_argument("--max-export-pages-per-user", type=int, default=None,
                        help="distinct KV pages one user's persistent exports may hold together; one more traps the "
                        "export RESOURCE_EXHAUSTED (default: half of the smallest executor's pages; 0: unlimited)")
    add_metrics_flags(parser)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    try:
        parse_strategy(args.batching)
    except ValueError as error:
        parser.error(str(error))
    if not args.executor:
        parser.error("at least one --executor is needed")
    if not 0 <= args.max_continuation_steps <= MAX_CONTINUATION_STEPS:
        parser.error(f"--max-continuation-steps must be in 0..{MAX_CONTINUATION_STEPS}")
    if args.registry_listen and not args.cluster_secret_file:
        parser.error("--registry-listen needs --cluster-secret-file: the registry never runs unauthenticated")
    if args.prefill_chunk_token_slots < 0:
        parser.error("--prefill-chunk-token-slots must be 0 (the default) or more")
    if args.prefill_chunk_tokens < 0:
        parser.error("--prefill-chunk-tokens must be 0 (the default) or more")
    if args.max_instances < 1:
        parser.error("--max-instances must be at least 1")
    if args.max_waiting_instances < 0:
        parser.error(f"--max-waiting-instances must be >= 0 (0: no admission queue), got {args.max_waiting_instances}")
    if not args.admission_timeout_s > 0:
        parser.error(f"--admission-timeout-s must be more than 0, got {args.admission_timeout_s}")
    if args.max_export_pages_per_user is not None and args.max_export_pages_per_user < 0:
        parser.error("--max-export-pages-per-user must be >= 0 (0: unlimited)")
    try:
        secret = read_secret_file(args.cluster_secret_file) if args.cluster_secret_file else ""
        tls = tls_files(args.tls_cert, args.tls_key)
    except CredentialError as error:
        parser.error(str(error))
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = SchedulerConfig(
        listen=args.listen, listen_unix=args.listen_unix, listen_framed=args.listen_framed, executor_addresses=tuple(args.executor),
        executor_transport=args.executor_transport,
        batching=args.batching, max_kv_pages_per_instance=args.page_budget,
        max_embed_slots_per_instance=args.slot_budget, allow_anonymous=args.allow_anonymous,
        max_continuation_steps=args.max_continuation_steps, registry_listen=args.registry_listen,
        cluster_secret=secret, tls=tls, executor_tls_ca=args.executor_tls_ca, max_instances=args.max_instances,
        max_export_pages_per_user=args.max_export_pages_per_user, prefill_chunk_tokens=args.prefill_chunk_tokens,
        prefill_chunk_token_slots=args.prefill_chunk_token_slots,
        max_waiting_instances=args.max_waiting_instances, admission_timeout_s=args.admission_timeout_s,
    )
    return config, metrics_endpoint(parser, args)


async def serve(config: SchedulerConfig, metrics: MetricsEndpoint = METRICS_OFF) -> None:
    server = await create_server(config)
    registry = await create_registry_server(config, server.scheduler) if config.registry_listen else None
    if config.listen_unix:
        # Controllers connect from sandboxes as their own unprivileged uids; the instance token, not the
        # file mode, is what authenticates them.
        os.chmod(config.listen_unix, 0o666)
    framed = FramedServer(server.scheduler, config.listen_framed) if config.listen_framed else None
    if framed is not None:
        await framed.start()
    start_metrics_server(metrics.port, server.scheduler.metrics.registry, host=metrics.host)
    # What start-up built lives as long as the process: keep the cyclic GC's full collections from
    # rescanning it (each one ~10 ms at 256 sessions, a pause every command in flight waits out).
    gc.collect()
    gc.freeze()

    async def announce() -> None:
        print(f"l4m scheduler listening on {bound_address(config.listen, server.port)}"
              + (f" and unix:{config.listen_unix}" if config.listen_unix else "")
              + (f" and framed:{config.listen_framed}" if config.listen_framed else ""), flush=True)
        if registry is not None:
            print(f"l4m scheduler registry listening on {bound_address(config.registry_listen, registry.port)}",  # type: ignore[arg-type]
                  flush=True)

    async def stop() -> None:
        if framed is not None:
            await framed.stop()
        if registry is not None:
            await registry.stop(1.0)
        await server.stop(2.0)
        await server.scheduler.close()

    await serve_until_signal(announce, stop)


def main(argv: Sequence[str] | None = None) -> None:
    # The provider must exist before the scheduler is built: it creates no spans without one.
    configure_tracing("l4m.scheduler")
    config, metrics = parse_config(argv)
    try:
        eventloop.loop_name()
    except ValueError as error:
        raise SystemExit(f"l4m.scheduler: {error}") from None
    try:
        eventloop.run(serve(config, metrics))
    finally:
        shutdown_tracing()


if __name__ == "__main__":
    main()
