"""`l4m up` and `l4m demo`: the cluster on this machine, from the command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import getpass
import signal
import sys
import tempfile
from pathlib import Path

from l4m.cluster import CPU_POLICY_NAMES, ROLES, Cluster, ClusterConfig, ClusterError
from l4m.wire.credentials import is_loopback_host

DEMO_PROMPT = "What is the capital of France, and what is it famous for?"
EXAMPLES_DIR = Path(__file__).resolve().parents[3] / "examples" / "controllers"


def default_state_dir() -> Path:
    # Under /tmp, not $HOME: sandboxes run as an unprivileged user that must reach the socket directory.
    return Path(tempfile.gettempdir()) / f"l4m-{getpass.getuser()}"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def _non_negative_seconds(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):  # NaN fails the comparison
        raise argparse.ArgumentTypeError(f"must be a number of seconds, 0 or more, not {text}")
    return value


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-dir", type=Path, default=None, help="sockets, logs, programs (default /tmp/l4m-$USER)")
    parser.add_argument("--host", default="127.0.0.1", help="address the user-facing services listen on")
    parser.add_argument("--spawner-port", type=int, default=7410)
    parser.add_argument("--scheduler-port", type=int, default=7411)
    parser.add_argument("--gateway-port", type=int, default=7412,
                        help="the OpenAI-compatible HTTP API (http://HOST:PORT/v1); -1: no gateway")
    parser.add_argument("--gateway-prefix-cache-pages", type=int, default=None,
                        help="KV pages the gateway's cached prompt prefixes hold at most (default 512; 0: no cache)")
    parser.add_argument("--metrics-port-base", type=int, default=9410, help="0 disables the metrics endpoints")
    parser.add_argument(
        "--devices", default=None,
        help="one executor per device, comma separated: cpu | cuda:0,cuda:1 ... (default cpu; --role control: "
        "none, only remote --executor ones)",
    )
    parser.add_argument("--num-pages", type=_non_negative_int, default=0,
                        help="KV pages per executor (default 0: sized from the device's free memory)")
    parser.add_argument("--swap-space-pages", type=int, default=None,
                        help="host swap slots per executor for the pages of instances preempted under memory pressure "
                        "(default: the executor's, as many as its KV cache, at most 1 GiB; 0: none, evict instead)")
    parser.add_argument("--quantized-activations", default="float32", choices=["float32", "bfloat16"],
                        help="the CPU executors' precision of x in the products with the GGUF's 4-bit blocks: float32 "
                        "(default, float32's products) or bfloat16 (x rounded to bf16: 1.4-1.5x faster linears at "
                        "4-64 tokens, logits within the bf16 margin; needs AVX-512 BF16, refused at start without)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float16"],
                        help="the CPU executors' KV cache: auto (default, their dtype's: float32) or float16 (K and V "
                        "rounded to float16 as llama.cpp keeps them: twice the tokens in the same memory, faster decode "
                        "at many streams, logits within float16's rounding; needs --dtype float32)")
    hosts = parser.add_argument_group("several hosts (docs/operations.md, Joining hosts)")
    hosts.add_argument("--role", default="all", choices=list(ROLES),
                       help="all: every service here (default); control: scheduler, spawner and gateway, with "
                       "executors on other hosts (--executor) and local ones only if --devices is given; "
                       "executor: executors only, on TCP (--executor-listen) for a control host to join")
    hosts.add_argument("--executor", action="append", default=[], metavar="HOST:PORT",
                       help="an executor on another host (its `l4m up --role executor`) for the scheduler to join; "
                       "repeatable; TLS verified against --tls-ca")
    hosts.add_argument("--executor-listen", default="", metavar="HOST:PORT",
                       help="--role executor: where executor 0 listens (executor i on PORT+i); the address the "
                       "control host dials, which the --tls-cert certificate must name")
    hosts.add_argument("--cluster-secret-file", type=Path, default=None, metavar="PATH",
                       help="the cluster secret (mode 0600) when not STATE_DIR/internal/cluster.secret; an executor "
                       "host needs a copy of the control host's")
    hosts.add_argument("--insecure-executor-links", action="store_true",
                       help="development only: plaintext executor links on non-loopback addresses (whoever can "
                       "reach them reads the prompts and outputs of every instance)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument(
        "--model", action="append", default=[], metavar="[NAME=]PATH",
        help="a GGUF file or safetensors directory to serve (default: SmolLM2-135M); repeat to serve several "
        "models, each on one executor per device, the first the default; NAME overrides the model's own name",
    )
    parser.add_argument(
        "--batching", default="adaptive", help="adaptive | t-only:<ms> | k-only:<k> | k-or-t:<k>:<ms>"
    )
    parser.add_argument("--sandbox", default="process", choices=["process", "docker"])
    parser.add_argument(
        "--warm-pool-size", type=_non_negative_int, default=None,
        help="process sandboxes the spawner keeps started ahead of demand (default: the spawner's, 2); size it "
        "to the bursts of launches you expect (about 50 MiB each)",
    )
    parser.add_argument(
        "--warm-pool-quiet-wait-s", type=_non_negative_seconds, default=None,
        help="the most each round of the warm pool's refill waits for the host to have a CPU core to spare, so "
        "that sandbox starts do not slow an executor decoding on this host's cores (default: the spawner's, 0: "
        "refill at once); on a CPU-only host, say 30",
    )
    parser.add_argument(
        "--max-instances-per-process", type=_positive_int, default=None,
        help="how many launches with share_process (`l4m run --share-process`: one user's, one program, same "
        "model and limits) may run in one controller process (default: the spawner's, 16; 1: never shared)",
    )
    parser.add_argument(
        "--controller-cpu-policy", choices=CPU_POLICY_NAMES, default=None,
        help="the CPU scheduling policy controllers run under (default: the spawner's, batch: a controller that "
        "wakes never preempts a running task, such as an executor decoding on this host's cores; normal: "
        "SCHED_OTHER)",
    )
    parser.add_argument(
        "--control-plane-cpu-policy", choices=CPU_POLICY_NAMES, default="batch",
        help="the CPU scheduling policy of the scheduler, spawner and gateway this starts (default batch: "
        "SCHED_BATCH, a service that wakes never preempts a running task such as an executor decoding on "
        "this host's cores; normal: SCHED_OTHER); executors always run under SCHED_OTHER",
    )
    parser.add_argument(
        "--max-continuation-steps", type=_non_negative_int, default=None,
        help="decode steps one forward_text may ask the executor to run by itself (default: the scheduler's, "
        "64; 0 turns continuation off: one round trip per token)",
    )
    parser.add_argument(
        "--prefill-chunk-tokens", type=_positive_int, default=None,
        help="a prompt longer than this is filled in chunks of this many tokens, each batched beside other "
        "streams' decode steps (default: the scheduler's, half the executors' max_batch_tokens, at most 2048)",
    )
    parser.add_argument(
        "--prefill-chunk-token-slots", type=_positive_int, default=None, metavar="SLOTS",
        help="what one chunk token's own work costs in context slots of attention: chunks then shrink as their "
        "context grows, each costing about what the first chunk of --prefill-chunk-tokens does, so that the "
        "streams beside a long prompt see the same delay from every chunk (default: fixed-size chunks; "
        "docs/operations.md says how to pick it)",
    )
    parser.add_argument("--allow-anonymous", action="store_true", help="dev: L4M sessions without a token")
    parser.add_argument("--session-transport", default="framed", choices=["framed", "grpc"],
                        help="how controllers speak L4M and send their user messages: length-prefixed frames on "
                        "Unix sockets (default; ~4x less CPU per message) or gRPC")
    parser.add_argument("--executor-transport", default="framed", choices=["framed", "grpc"],
                        help="how the scheduler sends batches to the executors: their Execute stream as frames on "
                        "a Unix socket (default) or gRPC")
    security = parser.add_argument_group("users and TLS (docs/security.md)")
    security.add_argument(
        "--insecure-local", action="store_true",
        help="the spawner lets callers without an API key in as an admin: for a one-person development "
        "machine only (default: every call needs a key; `l4m up` writes the admin's to STATE_DIR/admin.key)",
    )
    security.add_argument("--tls-cert", type=Path, default=None,
                          help="PEM certificate chain: TLS on the spawner's and scheduler's TCP listeners (--role "
                          "executor: on the executors')")
    security.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    security.add_argument("--tls-ca", type=Path, default=None,
                          help="CA that signed --tls-cert, for the start-up health checks (default: the "
                          "certificate itself, right for a self-signed one), and the remote --executor ones'")
    parser.add_argument("--quiet", action="store_true", help="do not echo the services' logs")


def _host_port(flag: str, value: str) -> tuple[str, int]:
    """`HOST:PORT` (`[V6]:PORT`) with a port in 1..65535; raises ValueError naming `flag` and `value`."""
    host, _, port = value.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{flag} {value!r} is not HOST:PORT with a port in 1..65535")
    return host, int(port)


def check_hosts(args: argparse.Namespace) -> None:
    """The several-hosts flags fit together and fit the role; raises ValueError saying what does not."""
    role, remote, listen = args.role, args.executor, args.executor_listen
    insecure = args.insecure_executor_links
    for address in remote:
        host, _ = _host_port("--executor", address)
        if not args.tls_ca and not insecure and not is_loopback_host(host):
            raise ValueError(f"--executor {address} is on another host: give --tls-ca (the CA that signed its "
                             f"certificate), or --insecure-executor-links for a plaintext development setup")
    if role == "executor":
        if remote:
            raise ValueError("--executor joins remote executors to this host's scheduler; --role executor runs "
                             "no scheduler (give --executor to the control host's `l4m up --role control`)")
        if not listen:
            raise ValueError("--role executor needs --executor-listen HOST:PORT, the address the control host's "
                             "scheduler dials")
        host, _ = _host_port("--executor-listen", listen)
        if host in ("0.0.0.0", "::"):
            raise ValueError(f"--executor-listen {listen}: give the address the control host dials (and the "
                             f"certificate names), not a wildcard")
        if not args.tls_cert and not insecure and not is_loopback_host(host):
            raise ValueError(f"--executor-listen {listen} is reachable from other hosts: give --tls-cert and "
                             f"--tls-key, or --insecure-executor-links for a plaintext development setup")
        return
    if listen:
        raise ValueError("--executor-listen is for --role executor; executors beside the scheduler listen on Unix "
                         "sockets in STATE_DIR/internal")
    if role == "control" and not remote and args.devices is None:
        raise ValueError("--role control needs executors: --executor HOST:PORT (one per executor on another host) "
                         "and/or --devices (executors on this host)")


def cluster_config(args: argparse.Namespace) -> ClusterConfig:
    from l4m.wire.credentials import CredentialError, tls_files

    command = getattr(args, "command", "up")
    try:
        tls_files(args.tls_cert, args.tls_key)
        check_hosts(args)
    except (CredentialError, ValueError) as error:
        raise SystemExit(f"l4m {command}: {error}") from None
    if args.gateway_prefix_cache_pages is not None and args.gateway_prefix_cache_pages < 0:
        raise SystemExit(f"l4m {command}: --gateway-prefix-cache-pages must be 0 (no cache) "
                         f"or more, got {args.gateway_prefix_cache_pages}")
    devices = args.devices if args.devices is not None else ("" if args.role == "control" else "cpu")
    return ClusterConfig(
        state_dir=args.state_dir or default_state_dir(),
        host=args.host,
        spawner_port=args.spawner_port,
        scheduler_port=args.scheduler_port,
        gateway_port=args.gateway_port,
        gateway_prefix_cache_pages=args.gateway_prefix_cache_pages,
        metrics_port_base=args.metrics_port_base,
        devices=tuple(d.strip() for d in devices.split(",") if d.strip()),
        dtype=args.dtype,
        role=args.role,
        remote_executors=tuple(args.executor),
        executor_listen=args.executor_listen,
        given_cluster_secret_file=args.cluster_secret_file,
        num_kv_pages=args.num_pages,
        swap_space_pages=args.swap_space_pages,
        quantized_activations=args.quantized_activations,
        kv_cache_dtype=args.kv_cache_dtype,
        models=tuple(args.model),
        batching=args.batching,
        sandbox=args.sandbox,
        warm_pool_size=args.warm_pool_size,
        warm_pool_quiet_wait_s=args.warm_pool_quiet_wait_s,
        max_instances_per_process=args.max_instances_per_process,
        controller_cpu_policy=args.controller_cpu_policy,
        control_plane_cpu_policy=args.control_plane_cpu_policy,
        max_continuation_steps=args.max_continuation_steps,
        prefill_chunk_tokens=args.prefill_chunk_tokens,
        prefill_chunk_token_slots=args.prefill_chunk_token_slots,
        allow_anonymous=args.allow_anonymous,
        session_transport=args.session_transport,
        executor_transport=args.executor_transport,
        insecure_local=args.insecure_local,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
        echo_logs=not args.quiet,
    )


async def _up(config: ClusterConfig) -> int:
    cluster = Cluster(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    starting = asyncio.ensure_future(cluster.start())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():  # Ctrl-C while a service is still starting: stop what started, now
        print("l4m up: stopping before it was up ...", file=sys.stderr, flush=True)
        starting.cancel()  # `Cluster.start` stops every service it started before it re-raises
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        return 130
    try:
        starting.result()
    except ClusterError as error:
        print(f"l4m up: {error}", file=sys.stderr)
        return 1
    print("l4m is up:\n  " + "\n  ".join(cluster.endpoints()) + "\nCtrl-C stops it.", flush=True)
    died = asyncio.ensure_future(cluster.wait_for_exit())
    await asyncio.wait({stopped, died}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if died.done():
        print(f"l4m up: {cluster.describe_exit(died.result())}\nstopping the others.", file=sys.stderr)
        code = 1
    else:
        died.cancel()
        print("l4m up: stopping ...", flush=True)
    await cluster.stop()
    return code


def run_up(args: argparse.Namespace) -> int:
    return asyncio.run(_up(cluster_config(args)))


async def _demo(config: ClusterConfig, prompt: str, max_tokens: int) -> int:
    from l4m.client import run_program  # the user client; imported here to keep `l4m up` light

    cluster = Cluster(config)
    try:
        await cluster.start()
        print("[l4m demo] cluster is up; running examples/controllers/text_completion.py", flush=True)
        program = EXAMPLES_DIR / "text_completion.py"
        return await run_program(
            config.spawner_address, program, ["--no-stream", "--max-tokens", str(max_tokens), prompt], echo=True,
            api_key=config.admin_key() or None, tls_ca=config.health_ca if config.tls_cert else None,
        )
    except ClusterError as error:
        print(f"l4m demo: {error}", file=sys.stderr)
        return 1
    finally:
        with contextlib.suppress(Exception):
            await cluster.stop()


def run_demo(args: argparse.Namespace) -> int:
    if args.role != "all":
        raise SystemExit(f"l4m demo: --role {args.role} runs part of a cluster; the demo needs all of it")
    # The services' logs go to their files only; the demo shows progress and the controller's output.
    config = dataclasses.replace(cluster_config(args), echo_logs=False)
    return asyncio.run(_demo(config, args.prompt, args.max_tokens))
