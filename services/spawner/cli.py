"""`python -m l4m.spawner`: flags and environment → one `SpawnerConfig`, then serve until a signal.

Tracing is configured by the standard OTEL_* variables only (`l4m.telemetry`); when it is on with an
OTLP exporter, controllers are told to export their spans through the runtime socket and the spawner
forwards them to the same endpoint. SIGTERM or SIGINT stops the spawner cleanly: every running
instance is ended and destroyed in the scheduler before the process exits.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from opentelemetry.util.re import parse_env_headers

from l4m import telemetry
from l4m.common.metrics import (
    METRICS_OFF,
    MetricsEndpoint,
    add_metrics_flags,
    metrics_endpoint,
    start_metrics_server,
)
from l4m.common.serving import bound_address, serve_until_signal
from l4m.spawner.config import MiB, SpawnerConfig
from l4m.spawner.sandbox import CPU_POLICIES, Limits

SERVICE_NAME = "l4m.spawner"
STOP_GRACE_S = 5.0
DEFAULT_OTLP_ENDPOINT = "http://localhost:4317"


def _default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "l4m" / "spawner"


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def non_negative_seconds(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):  # NaN fails the comparison
        raise argparse.ArgumentTypeError(f"must be a number of seconds, 0 or more, not {text}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    defaults, limits = SpawnerConfig(state_dir=Path(), socket_dir=Path()), Limits()
    parser = argparse.ArgumentParser(
        prog="python -m l4m.spawner", description="The l4m spawner: runs controllers in sandboxes."
    )
    add = parser.add_argument
    add("--listen", default="127.0.0.1:7410", help="HOST:PORT for SpawnerService (port 0 picks one)")
    add(
        "--scheduler",
        default="",
        help="the scheduler's InstanceRegistryService, its --registry-listen (e.g. unix:/x/registry.sock); "
        "empty: no scheduler (controllers cannot run L4M commands)",
    )
    add(
        "--socket-dir",
        type=Path,
        default=None,
        help="directory mounted at /run/l4m in sandboxes: the runtime socket is created here and the "
        "scheduler's socket is expected here (default: STATE_DIR/sockets)",
    )
    add(
        "--scheduler-socket-name",
        default=defaults.scheduler_socket_name,
        help="the scheduler's socket file in --socket-dir",
    )
    add(
        "--scheduler-framed-socket-name",
        default=defaults.scheduler_framed_socket_name,
        help="the scheduler's framed-session socket (its --listen-framed) in --socket-dir: controllers speak L4M "
        "over it instead of gRPC (default: none, gRPC)",
    )
    add(
        "--runtime-framed-socket-name",
        default=defaults.runtime_framed_socket_name,
        help="the socket in --socket-dir on which controllers make their runtime calls as frames "
        f"(default {defaults.runtime_framed_socket_name}; empty: not served, they use RuntimeService on gRPC)",
    )
    add("--state-dir", type=Path, default=_default_state_dir(), help="programs are stored under it")
    add("--sandbox", choices=("process", "docker"), default=defaults.sandbox_kind)
    add("--docker-image", default="", help="controller image for --sandbox docker (default: build one)")
    add(
        "--spawner-id",
        default=defaults.spawner_id,
        help="names this spawner's cgroups and containers (orphans are cleaned at start)",
    )
    add_metrics_flags(parser)
    add(
        "--controller-runner",
        default=defaults.controller_runner,
        help="programs run as `python -m RUNNER PROGRAM ARGS`; empty: as plain scripts",
    )
    add(
        "--warm-pool-size",
        type=non_negative_int,
        default=defaults.warm_pool_size,
        help="process sandboxes kept started ahead of demand, each serving one launch "
        "(about 50 MiB each, started on idle CPU only; 0: every launch starts cold)",
    )
    add(
        "--max-instances-per-process",
        type=positive_int,
        default=defaults.max_instances_per_process,
        help="how many instances launched with share_process (`l4m run --share-process`: one user's launches of "
        "one program, same model and limits) may run in one controller process; 1: each runs in its own",
    )
    add(
        "--warm-pool-quiet-wait-s",
        type=non_negative_seconds,
        default=defaults.warm_pool_quiet_wait_s,
        help="the most each round of the warm pool's refill waits for the host to have a CPU core to spare "
        "(read from /proc/stat), so that sandbox starts do not slow an executor decoding on this host's cores; "
        "0: refill at once",
    )
    add(
        "--controller-cpu-policy",
        choices=tuple(CPU_POLICIES),
        default=defaults.controller_cpu_policy,
        help="the CPU scheduling policy launched controllers run under: batch (SCHED_BATCH: the same CPU share, "
        "but a controller that wakes never preempts a running task, so it does not stall an executor decoding "
        "on this host's cores) or normal (SCHED_OTHER); controllers cannot change it",
    )
    add("--wall-time-s", type=float, default=limits.wall_time_s, help="default wall time limit")
    add("--cpu-time-s", type=float, default=limits.cpu_time_s, help="default CPU time limit")
    add("--memory-mib", type=int, default=limits.memory_bytes // MiB, help="default memory limit")
    add("--max-processes", type=int, default=limits.max_processes, help="default process/thread limit")
    add("--max-output-mib", type=int, default=limits.max_output_bytes // MiB, help="default output limit")
    add("--cpu-cores", type=float, default=limits.cpu_cores, help="CPU share per instance (0: unthrottled)")
    add(
        "--max-tokens",
        type=int,
        default=defaults.default_max_tokens,
        help="default token budget per instance (0: unlimited)",
    )
    add("--max-children-per-tree", type=int, default=defaults.max_children_per_tree)
    add("--max-instances", type=int, default=defaults.max_instances, help="instances alive at once")
    add(
        "--max-exited-instances",
        type=non_negative_int,
        default=defaults.max_exited_instances,
        help="exited instances kept for ListInstances/Attach (each its exit and at most 64 KiB of output)",
    )
    add(
        "--max-variable-mib-per-tree",
        type=non_negative_int,
        default=defaults.max_variable_bytes_per_tree // MiB,
        help="a launch tree's shared variables in all (each costs its name, its value and 256 bytes)",
    )
    uploads = parser.add_argument_group("program uploads (validated in bounded child processes)")
    uploads.add_argument("--max-program-mib", type=positive_int, default=defaults.max_program_bytes // MiB,
                         help="the largest program an upload may carry")
    uploads.add_argument("--upload-validation-memory-mib", type=positive_int,
                         default=defaults.upload_validation_memory_bytes // MiB,
                         help="address-space limit of the child process that compiles an upload")
    uploads.add_argument("--upload-validation-timeout-s", type=float, default=defaults.upload_validation_timeout_s,
                         help="wall-time limit of that child process")
    uploads.add_argument("--max-concurrent-upload-validations", type=positive_int,
                         default=defaults.max_concurrent_upload_validations,
                         help="validations running at once; further uploads wait their turn")
    users = parser.add_argument_group("users (every SpawnerService call needs an API key)")
    users.add_argument("--api-keys-file", type=Path, default=None,
                       help="the key store `l4m keys add` writes (re-read when it changes)")
    users.add_argument("--insecure-local", action="store_true",
                       help="let callers without a key in as the admin user 'local': for a one-person "
                       "development machine, and only with a loopback --listen address")
    users.add_argument("--max-instances-per-user", type=non_negative_int,
                       default=defaults.max_instances_per_user,
                       help="instances one user may have alive at once (a key may set its own)")
    users.add_argument("--max-memory-mib-per-user", type=non_negative_int,
                       default=defaults.max_memory_bytes_per_user // MiB,
                       help="the sum of the memory limits of one user's live instances")
    users.add_argument("--max-wall-time-s-per-user", type=float, default=defaults.max_wall_time_s_per_user,
                       help="the sum of the wall time limits of one user's live instances")
    users.add_argument("--max-tokens-per-minute-per-user", type=non_negative_int,
                       default=defaults.max_tokens_per_minute_per_user,
                       help="tokens per minute one user may feed, enforced by the scheduler (0: unlimited)")
    users.add_argument("--unattached-grace-s", type=float, default=defaults.unattached_grace_s,
                       help="a launch that is not detached is terminated when nobody attached this long "
                       "after its start")
    tls = parser.add_argument_group("TLS and the control plane")
    tls.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate chain for --listen")
    tls.add_argument("--tls-key", type=Path, default=None, help="PEM private key for --listen")
    tls.add_argument("--cluster-secret-file", type=Path, default=None,
                     help="the cluster secret the scheduler's registry requires (file, mode 0600)")
    tls.add_argument("--scheduler-tls-ca", type=Path, default=None,
                     help="CA to verify a TLS scheduler registry (a TCP --scheduler)")
    add("--log-level", default="INFO")
    return parser


def controller_spans_target(environ: Mapping[str, str]) -> tuple[str, tuple[tuple[str, str], ...]]:
    """(endpoint, headers) controllers' spans are forwarded to: the spawner's own OTLP exporter's."""
    if not telemetry.tracing_requested(environ):
        return "", ()
    if environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() != "otlp":
        return "", ()
    endpoint = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or DEFAULT_OTLP_ENDPOINT
    )
    raw = environ.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS") or environ.get("OTEL_EXPORTER_OTLP_HEADERS", "")
    headers = tuple((key.lower(), value) for key, value in parse_env_headers(raw, liberal=True).items())
    return endpoint, headers


def parse_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] = os.environ
) -> tuple[SpawnerConfig, argparse.Namespace]:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.metrics = metrics_endpoint(parser, args)
    limits = Limits(
        wall_time_s=args.wall_time_s,
        cpu_time_s=args.cpu_time_s,
        memory_bytes=args.memory_mib * MiB,
        max_processes=args.max_processes,
        max_output_bytes=args.max_output_mib * MiB,
        cpu_cores=args.cpu_cores,
    )
    spans_endpoint, spans_headers = controller_spans_target(environ)
    config = SpawnerConfig(
        state_dir=args.state_dir,
        socket_dir=args.socket_dir or args.state_dir / "sockets",
        listen_address=args.listen,
        spawner_id=args.spawner_id,
        sandbox_kind=args.sandbox,
        docker_image=args.docker_image,
        scheduler_registry_address=args.scheduler,
        scheduler_socket_name=args.scheduler_socket_name,
        scheduler_framed_socket_name=args.scheduler_framed_socket_name,
        runtime_framed_socket_name=args.runtime_framed_socket_name,
        default_limits=limits,
        default_max_tokens=args.max_tokens,
        max_children_per_tree=args.max_children_per_tree,
        max_instances=args.max_instances,
        max_exited_instances=args.max_exited_instances,
        max_variable_bytes_per_tree=args.max_variable_mib_per_tree * MiB,
        max_program_bytes=args.max_program_mib * MiB,
        upload_validation_memory_bytes=args.upload_validation_memory_mib * MiB,
        upload_validation_timeout_s=args.upload_validation_timeout_s,
        max_concurrent_upload_validations=args.max_concurrent_upload_validations,
        controller_runner=args.controller_runner,
        warm_pool_size=args.warm_pool_size,
        max_instances_per_process=args.max_instances_per_process,
        warm_pool_quiet_wait_s=args.warm_pool_quiet_wait_s,
        controller_cpu_policy=args.controller_cpu_policy,
        controller_spans_endpoint=spans_endpoint,
        controller_spans_headers=spans_headers,
        api_keys_file=args.api_keys_file,
        insecure_local=args.insecure_local,
        max_instances_per_user=args.max_instances_per_user,
        max_memory_bytes_per_user=args.max_memory_mib_per_user * MiB,
        max_wall_time_s_per_user=args.max_wall_time_s_per_user,
        max_tokens_per_minute_per_user=args.max_tokens_per_minute_per_user,
        unattached_grace_s=args.unattached_grace_s,
        cluster_secret_file=args.cluster_secret_file,
        scheduler_tls_ca=args.scheduler_tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
    )
    return config, args


async def serve(config: SpawnerConfig, metrics: MetricsEndpoint = METRICS_OFF) -> None:
    from l4m.spawner.server import ConfigError, create_server
    from l4m.wire.credentials import CredentialError

    try:
        server = await create_server(config)
    except (ConfigError, CredentialError) as error:
        raise SystemExit(f"l4m spawner: {error}") from None
    start_metrics_server(metrics.port, server.manager.metrics.registry, host=metrics.host)

    async def start() -> None:
        await server.start()
        print(
            f"l4m spawner listening on {bound_address(config.listen_address, server.port)} (runtime "
            f"unix:{server.runtime_socket}, sandbox {config.sandbox_kind}, "
            f"scheduler {config.scheduler_registry_address or 'none'})",
            flush=True,
        )
        # What enforces the limits here: cgroups v1 or v2, or only rlimits (cgroups.py).
        enforced = server.manager.sandbox.enforcement()
        print(
            f"l4m spawner limits: memory by {enforced['memory_bytes']}; processes by "
            f"{enforced['max_processes']}; cpu cores by {enforced['cpu_cores']}",
            flush=True,
        )

    async def stop() -> None:
        logging.getLogger(__name__).info("stopping: ending every instance")
        await server.stop(STOP_GRACE_S)
        # This process is done with its spawner id: its (now empty) cgroup parents go too.
        remove_cgroup_parents = getattr(server.manager.sandbox, "remove_cgroup_parents", None)
        if remove_cgroup_parents is not None:
            remove_cgroup_parents()

    await serve_until_signal(start, stop)


def main(argv: Sequence[str] | None = None) -> None:
    config, args = parse_config(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    telemetry.configure_tracing(SERVICE_NAME)
    try:
        asyncio.run(serve(config, args.metrics))
    finally:
        telemetry.shutdown_tracing()
