"""`l4m up`: run a whole cluster (executors, scheduler, spawner) as child processes on this machine, or this
host's part of one spread over several (`role`: a control host joins executor hosts over TCP with TLS).

The supervisor starts each service with `python -m l4m.<service>`, waits for its grpc.health.v1 check to
answer SERVING (showing the executors' progress while the model loads), prints the endpoints, and then
watches: Ctrl-C, SIGTERM, or any child dying stops everything, the dead child's log tail printed first.

Internal hops use Unix sockets in the state directory; the user-facing services (spawner, scheduler)
also listen on loopback TCP (TLS with `--tls-cert/--tls-key`). The planes (docs/security.md):
- `<state>/sockets/` (mounted into every sandbox as /run/l4m) holds only the scheduler's L4M sockets
  (gRPC and framed) and the spawner's runtime sockets (gRPC, and the framed one for user messages);
- `<state>/internal/` (0700: the operator's only) holds the executors' sockets, the scheduler's
  registry socket and the cluster secret (`cluster.secret`) that every control-plane call presents;
- `<state>/api-keys.json` is the spawner's key store; `<state>/admin.key` the local admin's key, which
  `l4m run` reads when it is given no key.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import signal
import stat
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from l4m.keys import ADMIN_KEY_FILE_NAME, KEYS_FILE_NAME, KeyStoreError, ensure_admin_key
from l4m.wire.credentials import CredentialError, open_channel, read_secret_file, write_secret_file

STOP_GRACE_S = 10.0
# Which services one `l4m up` runs (docs/operations.md "Joining hosts"): all of them; the control role
# (scheduler, spawner, gateway, and local executors only where `devices` are given) beside executors on
# other hosts; or the executor role, executors alone on TCP for a control host's scheduler to dial.
ROLES = ("all", "control", "executor")
LOCK_FILE_NAME = "cluster.lock"  # in the state directory: see `lock_state_dir`
LOG_TAIL_LINES = 40
# The health channel is refused until the service binds (minutes, while a model loads); gRPC's default
# reconnect backoff would by then wait up to tens of seconds before trying again.
_HEALTH_CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 500),
                           ("grpc.min_reconnect_backoff_ms", 200))


# The CPU policies `l4m up` knows, for its services (`control_plane_cpu_policy`) and the spawner's
# controllers (its --controller-cpu-policy): SCHED_BATCH, SCHED_OTHER.
CPU_POLICY_NAMES = ("batch", "normal")


class ClusterError(RuntimeError):
    """The cluster could not start or a service died."""


@dataclass(frozen=True)
class ClusterConfig:
    """Everything `l4m up` needs, built once from the command line."""

    state_dir: Path
    host: str = "127.0.0.1"
    spawner_port: int = 7410
    scheduler_port: int = 7411
    gateway_port: int = 7412  # the OpenAI-compatible HTTP API (l4m.gateway); -1: no gateway
    gateway_prefix_cache_pages: int | None = None  # the gateway's --prefix-cache-pages (None: its default; 0: off)
    metrics_port_base: int = 9410  # spawner +0, scheduler +1, gateway +2, executor i +10+i; 0 = no metrics
    devices: tuple[str, ...] = ("cpu",)
    dtype: str = "auto"
    role: str = "all"  # one of ROLES
    # Executors on other hosts (`host:port`, each a host's `l4m up --role executor`) the scheduler joins
    # beside the local ones; over TLS verified against `tls_ca` when it is given.
    remote_executors: tuple[str, ...] = ()
    # Role "executor": `host:port` executor 0 listens on over TCP (executor i on port + i), the address
    # the control host dials and the executors' certificates name.
    executor_listen: str = ""
    # The cluster secret's file when not `<state>/internal/cluster.secret`: a copy of the control host's on
    # an executor host. Every host of one cluster holds the same secret.
    given_cluster_secret_file: Path | None = None
    num_kv_pages: int = 0  # each executor's KV pages (its --num-pages); 0: sized from free memory
    swap_space_pages: int | None = None  # each executor's host swap slots (--swap-space-pages); None: its default
    # The CPU executors' precision of x in the products with the GGUF blocks (--quantized-activations):
    # "float32" (their default) or "bfloat16" (faster, logits within the bf16 margin; AVX-512 BF16 only).
    quantized_activations: str = "float32"
    # The CPU executors' KV cache element type (--kv-cache-dtype): "auto" (their dtype's) or "float16" (half
    # the bytes per token; logits within float16's rounding of K and V).
    kv_cache_dtype: str = "auto"
    # The models to serve, each `PATH` or `NAME=PATH` (NAME: what sessions and GetInfo call it; default: the
    # model's own name). Empty: the embedded default (SmolLM2-135M-Instruct). Every model gets one
    # executor per device; the first model is the default a session gets when it names none.
    models: tuple[str, ...] = ()
    batching: str = "adaptive"
    sandbox: str = "process"
    warm_pool_size: int | None = None  # process sandboxes started ahead of demand; None: the spawner's default
    # The most a round of the warm pool's refill waits for a CPU core to spare (the spawner's
    # --warm-pool-quiet-wait-s); None: the spawner's default (0, refill at once).
    warm_pool_quiet_wait_s: float | None = None
    # Launches with share_process that may run in one controller process (the spawner's
    # --max-instances-per-process); None: the spawner's default (16).
    max_instances_per_process: int | None = None
    # The CPU policy launched controllers run under (the spawner's --controller-cpu-policy: batch or
    # normal); None: the spawner's default (batch).
    controller_cpu_policy: str | None = None
    # The CPU policy of the control plane's services (scheduler, spawner, gateway), started under
    # `chrt`: "batch" (SCHED_BATCH, default: a service that wakes never preempts a running task, such
    # as an executor decoding on the same cores) or "normal". Executors always run under SCHED_OTHER.
    control_plane_cpu_policy: str = "batch"
    max_continuation_steps: int | None = None  # per forward_text (0: off); None: the scheduler's default
    # A forward_text longer than this is filled in chunks of this many tokens, each sharing a batch with other
    # streams' decode steps; None: the scheduler's default (half the executors' max_batch_tokens, at most 2048).
    prefill_chunk_tokens: int | None = None
    # With a value, chunks shrink as their context grows, each costing about what the first does: one
    # token's own work in context slots of attention (the scheduler's --prefill-chunk-token-slots).
    prefill_chunk_token_slots: int | None = None
    allow_anonymous: bool = False
    # How sandboxed controllers speak L4M and send their user messages: "framed" (length-prefixed frames on
    # Unix sockets, ~4x less CPU per message) or "grpc"; users' own sessions use the scheduler's gRPC
    # listeners either way.
    session_transport: str = "framed"
    # How the scheduler sends batches to the executors: "framed" (each executor also serves its Execute
    # stream as frames on a socket beside its gRPC one) or "grpc".
    executor_transport: str = "framed"
    insecure_local: bool = False  # the spawner lets callers without a key in as an admin: one-person machines only
    tls_cert: Path | None = None  # TLS on the spawner's and scheduler's TCP listeners (with tls_key)
    tls_key: Path | None = None
    tls_ca: Path | None = None  # what the health checks trust; None: tls_cert itself (a self-signed one)
    start_timeout_s: float = 300.0
    echo_logs: bool = True

    @property
    def socket_dir(self) -> Path:
        return self.state_dir / "sockets"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def spawner_id(self) -> str:
        """Names the spawner's cgroups and containers, whose leftovers it removes at start: one per state
        directory, so two clusters on one machine never clean up each other's instances."""
        digest = hashlib.sha256(str(self.state_dir.resolve()).encode()).hexdigest()[:12]
        return f"up-{digest}"

    @property
    def spawner_address(self) -> str:
        return f"{self.host}:{self.spawner_port}"

    @property
    def gateway_url(self) -> str:
        return f"http://{self.host}:{self.gateway_port}"

    @property
    def scheduler_address(self) -> str:
        return f"{self.host}:{self.scheduler_port}"

    @property
    def internal_socket_dir(self) -> Path:
        """Sockets only the services use (executors). Never the sandboxes' directory: a controller that
        could reach an executor would bypass the scheduler's validation and tables."""
        return self.state_dir / "internal"

    def executor_socket(self, index: int) -> Path:
        return self.internal_socket_dir / f"executor-{index}.sock"

    def executor_framed_socket(self, index: int) -> Path:
        """The executor's framed Execute socket (`--listen-framed`), beside its gRPC one (mode 0600)."""
        return self.internal_socket_dir / f"executor-{index}.frames.sock"

    @property
    def scheduler_socket(self) -> Path:
        """The data plane's L4M socket, the one the sandboxes see as /run/l4m/scheduler.sock."""
        return self.socket_dir / "scheduler.sock"

    @property
    def scheduler_framed_socket(self) -> Path:
        """The scheduler's framed-session socket (`--listen-framed`), /run/l4m/scheduler.frames.sock in a sandbox."""
        return self.socket_dir / "scheduler.frames.sock"

    @property
    def registry_socket(self) -> Path:
        """The scheduler's InstanceRegistryService: the spawner's alone, beside the other internal sockets."""
        return self.internal_socket_dir / "registry.sock"

    @property
    def cluster_secret_file(self) -> Path:
        return self.given_cluster_secret_file or self.internal_socket_dir / "cluster.secret"

    def executor_tcp_address(self, index: int) -> str:
        """Role "executor": where executor `index` listens (`executor_listen`'s port + index)."""
        host, _, port = self.executor_listen.rpartition(":")
        return f"{host}:{int(port) + index}"

    @property
    def api_keys_file(self) -> Path:
        return self.state_dir / KEYS_FILE_NAME

    @property
    def admin_key_file(self) -> Path:
        return self.state_dir / ADMIN_KEY_FILE_NAME

    def admin_key(self) -> str:
        """The local admin's API key (`l4m up` writes it at start); empty with `insecure_local`."""
        return "" if self.insecure_local else self.admin_key_file.read_text().strip()

    @property
    def health_ca(self) -> Path | None:
        """The CA the health checks of TLS listeners verify against."""
        return self.tls_ca or self.tls_cert

    def metrics_port(self, offset: int) -> int:
        return self.metrics_port_base + offset if self.metrics_port_base else 0


@dataclass(frozen=True)
class ServiceSpec:
    """One child process: its name, command line, and the gRPC address its health check answers on."""

    name: str
    argv: tuple[str, ...]
    health_address: str
    metrics_port: int = 0
    tls_ca: Path | None = None  # the health check's TLS trust; None: a plain channel
    model: str = ""  # an executor's `--model` as given to `l4m up` ("" = the embedded default)
    # "grpc": grpc.health.v1 on `health_address`; "http": GET `health_address` answers 200 (the gateway)
    health_check: str = "grpc"
    cpu_policy: str = "normal"  # "batch": started under `chrt --batch 0` (ClusterConfig.control_plane_cpu_policy)

    def command(self) -> tuple[str, ...]:
        """What runs: `argv`, under `chrt` unless the policy is "normal"."""
        return self.argv if self.cpu_policy == "normal" else ("chrt", f"--{self.cpu_policy}", "0", *self.argv)


@dataclass
class RunningService:
    spec: ServiceSpec
    process: asyncio.subprocess.Process
    log_path: Path
    log_tail: list[str] = field(default_factory=list)
    pump: asyncio.Task[None] | None = None  # copies its output to the log file (and the terminal)


async def _is_healthy(spec: ServiceSpec, stub: health_pb2_grpc.HealthStub | None) -> bool:
    if stub is None:  # an HTTP service
        def get() -> bool:
            with urllib.request.urlopen(spec.health_address, timeout=1.0) as response:
                return response.status == 200

        try:
            return await asyncio.to_thread(get)
        except OSError:
            return False
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
    except grpc.aio.AioRpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def executor_specs(config: ClusterConfig) -> list[ServiceSpec]:
    """This host's executors, one per model and device: on Unix sockets in `internal/` beside a scheduler
    here, on TCP (`executor_listen`, TLS with `tls_cert`) for the executor role."""
    specs = []
    is_remote = config.role == "executor"
    placements = [(model, device) for model in (config.models or ("",)) for device in config.devices]
    for index, (model, device) in enumerate(placements):
        address = config.executor_tcp_address(index) if is_remote else f"unix:{config.executor_socket(index)}"
        argv = [sys.executable, "-m", "l4m.executor", "--listen", address, "--device", device]
        argv += ["--dtype", config.dtype, "--cluster-secret-file", str(config.cluster_secret_file)]
        argv += ["--metrics-port", str(config.metrics_port(10 + index))]
        if is_remote and config.tls_cert:
            argv += ["--tls-cert", str(config.tls_cert), "--tls-key", str(config.tls_key)]
        if config.executor_transport == "framed" and not is_remote:  # frames are for a scheduler on this host
            argv += ["--listen-framed", str(config.executor_framed_socket(index))]
        if config.num_kv_pages:
            argv += ["--num-pages", str(config.num_kv_pages)]
        if config.swap_space_pages is not None:
            argv += ["--swap-space-pages", str(config.swap_space_pages)]
        if config.quantized_activations != "float32" and device == "cpu":  # the CPU kernels' setting
            argv += ["--quantized-activations", config.quantized_activations]
        if config.kv_cache_dtype != "auto" and device == "cpu":  # the CPU executors' setting
            argv += ["--kv-cache-dtype", config.kv_cache_dtype]
        name, _, path = model.rpartition("=")
        if path:
            argv += ["--model", path]
        if name:
            argv += ["--model-name", name]
        tls_ca = config.health_ca if is_remote and config.tls_cert else None
        specs.append(ServiceSpec(f"executor-{index}", tuple(argv), address, config.metrics_port(10 + index),
                                 tls_ca=tls_ca, model=model))
    return specs


def service_specs(config: ClusterConfig) -> list[ServiceSpec]:
    """The services of this host's role, in start order (executors first: the scheduler connects to them)."""
    python = sys.executable
    for name, policy in (("control_plane_cpu_policy", config.control_plane_cpu_policy),
                         ("controller_cpu_policy", config.controller_cpu_policy)):
        if policy is not None and policy not in CPU_POLICY_NAMES:  # None: the spawner's default
            raise ClusterError(f"{name}: unknown CPU policy {policy!r} (expected one of {', '.join(CPU_POLICY_NAMES)})")
    specs = executor_specs(config)
    if config.role == "executor":
        return specs
    executor_addresses = [spec.health_address for spec in specs] + list(config.remote_executors)
    secret = ["--cluster-secret-file", str(config.cluster_secret_file)]
    tls = ["--tls-cert", str(config.tls_cert), "--tls-key", str(config.tls_key)] if config.tls_cert else []
    argv = [python, "-m", "l4m.scheduler", "--listen", config.scheduler_address]
    argv += ["--listen-unix", str(config.scheduler_socket), "--batching", config.batching]
    framed = config.session_transport == "framed"
    if framed:
        argv += ["--listen-framed", str(config.scheduler_framed_socket)]
    argv += ["--registry-listen", f"unix:{config.registry_socket}", *secret, *tls]
    argv += ["--metrics-port", str(config.metrics_port(1))]
    for address in executor_addresses:
        argv += ["--executor", address]
    if config.remote_executors and config.tls_ca:
        argv += ["--executor-tls-ca", str(config.tls_ca)]
    if config.allow_anonymous:
        argv.append("--allow-anonymous")
    if config.executor_transport == "grpc":
        argv += ["--executor-transport", "grpc"]
    if config.max_continuation_steps is not None:
        argv += ["--max-continuation-steps", str(config.max_continuation_steps)]
    if config.prefill_chunk_tokens is not None:
        argv += ["--prefill-chunk-tokens", str(config.prefill_chunk_tokens)]
    if config.prefill_chunk_token_slots is not None:
        argv += ["--prefill-chunk-token-slots", str(config.prefill_chunk_token_slots)]
    # Its health is checked on the L4M socket: plain (a Unix socket), whatever the TCP listener's TLS.
    specs.append(ServiceSpec("scheduler", tuple(argv), f"unix:{config.scheduler_socket}", config.metrics_port(1),
                             cpu_policy=config.control_plane_cpu_policy))
    if config.gateway_port >= 0:
        sessions = f"framed:{config.scheduler_framed_socket}" if framed else f"unix:{config.scheduler_socket}"
        argv = [python, "-m", "l4m.gateway", "--host", config.host, "--port", str(config.gateway_port)]
        argv += ["--scheduler", sessions, "--registry", f"unix:{config.registry_socket}", *secret]
        argv += ["--insecure-local"] if config.insecure_local else ["--keys-file", str(config.api_keys_file)]
        argv += ["--spawner", config.spawner_address]  # `l4m/<program>` requests (gateway/programs.py)
        if config.gateway_prefix_cache_pages is not None:
            argv += ["--prefix-cache-pages", str(config.gateway_prefix_cache_pages)]
        argv += ["--spawner-tls-ca", str(config.health_ca)] if config.tls_cert and config.health_ca else []
        argv += ["--metrics-port", str(config.metrics_port(2))]
        specs.append(ServiceSpec("gateway", tuple(argv), f"{config.gateway_url}/health", config.metrics_port(2),
                                 health_check="http", cpu_policy=config.control_plane_cpu_policy))
    argv = [python, "-m", "l4m.spawner", "--listen", config.spawner_address, *tls]
    argv += ["--scheduler", f"unix:{config.registry_socket}", *secret, "--socket-dir", str(config.socket_dir)]
    argv += ["--state-dir", str(config.state_dir / "spawner"), "--sandbox", config.sandbox]
    argv += ["--metrics-port", str(config.metrics_port(0)), "--spawner-id", config.spawner_id]
    if framed:
        argv += ["--scheduler-framed-socket-name", config.scheduler_framed_socket.name]
    else:
        argv += ["--runtime-framed-socket-name", ""]  # user messages over RuntimeService too
    argv += ["--insecure-local"] if config.insecure_local else ["--api-keys-file", str(config.api_keys_file)]
    if config.warm_pool_size is not None:
        argv += ["--warm-pool-size", str(config.warm_pool_size)]
    if config.warm_pool_quiet_wait_s is not None:
        argv += ["--warm-pool-quiet-wait-s", str(config.warm_pool_quiet_wait_s)]
    if config.max_instances_per_process is not None:
        argv += ["--max-instances-per-process", str(config.max_instances_per_process)]
    if config.controller_cpu_policy is not None:
        argv += ["--controller-cpu-policy", config.controller_cpu_policy]
    specs.append(ServiceSpec("spawner", tuple(argv), config.spawner_address, config.metrics_port(0),
                             tls_ca=config.health_ca if config.tls_cert else None,
                             cpu_policy=config.control_plane_cpu_policy))
    return specs


def prepare_state_dir(config: ClusterConfig) -> str:
    """The directories, the cluster secret and the local admin key (each made once, kept across restarts);
    returns the admin key. `internal/` is the operator's only (0700), whatever an older run left.
    An executor host serves no users (no key) and never makes a secret: a new one would not be the
    control host's, and its scheduler would be refused. It must hold a copy of that host's."""
    config.state_dir.mkdir(parents=True, exist_ok=True)
    for directory in (config.socket_dir, config.log_dir):
        directory.mkdir(parents=True, exist_ok=True)
    config.internal_socket_dir.mkdir(mode=0o700, exist_ok=True)
    config.internal_socket_dir.chmod(0o700)
    if config.role == "executor":
        if not config.cluster_secret_file.exists():
            raise CredentialError(
                f"no cluster secret at {config.cluster_secret_file}: an executor host uses the control host's; "
                f"copy its STATE_DIR/internal/cluster.secret here (mode 0600) or name the copy with "
                f"--cluster-secret-file")
        read_secret_file(config.cluster_secret_file)  # refuses one others may read, or a short one
        return ""
    write_secret_file(config.cluster_secret_file)
    return ensure_admin_key(config.state_dir)


def lock_state_dir(config: ClusterConfig) -> int:
    """Claims the state directory for one cluster: an `flock` on `<state>/cluster.lock`, held by the
    supervisor and inherited by every service it starts, so the claim lasts while any of them lives
    (services outlive a killed supervisor: they run in sessions of their own) and ends with the last.
    Returns the lock's descriptor; a second cluster on the same directory is refused, not allowed to
    take over its sockets."""
    config.state_dir.mkdir(parents=True, exist_ok=True)
    path = config.state_dir / LOCK_FILE_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ClusterError(
            f"the state directory {config.state_dir} is in use by another l4m cluster (its processes hold "
            f"{path}: `fuser -v {path}` names them); stop it, or give this one another --state-dir"
        ) from None
    return fd


def remove_stale_sockets(config: ClusterConfig) -> list[Path]:
    """Removes the socket files a cluster that ended without cleaning up (a crash, a kill) left behind.
    Call it only while holding the state directory's lock: no live service of this directory owns one."""
    removed = []
    for directory in (config.socket_dir, config.internal_socket_dir):
        if not directory.is_dir():
            continue
        for path in directory.iterdir():
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(path.lstat().st_mode):
                    path.unlink()
                    removed.append(path)
    return removed


class Cluster:
    """Starts, watches and stops the services of `service_specs(config)`."""

    def __init__(self, config: ClusterConfig, say: Callable[[str], None] = print) -> None:
        self.config = config
        self._say = say
        self._services: list[RunningService] = []
        self._pumps: list[asyncio.Task[None]] = []
        self._lock_fd: int | None = None

    async def start(self) -> None:
        """Claim the state directory, then start every service in order and wait for each to be healthy;
        on any failure stop all and raise."""
        self._lock_fd = lock_state_dir(self.config)
        try:
            stale = remove_stale_sockets(self.config)
            if stale:
                self._say(f"removed {len(stale)} socket file(s) an earlier run left: "
                          + ", ".join(str(p) for p in stale))
            prepare_state_dir(self.config)
        except (CredentialError, KeyStoreError) as error:  # e.g. a secret file others may read
            self._unlock()
            raise ClusterError(str(error)) from error
        try:
            for spec in service_specs(self.config):
                service = await self._spawn(spec)
                await self._wait_healthy(service)
        except BaseException:
            await self.stop()
            raise

    def endpoints(self) -> list[str]:
        scheme = " (TLS)" if self.config.tls_cert else ""
        if self.config.role == "executor":
            return self._executor_host_endpoints(scheme)
        lines = [
            f"spawner    {self.config.spawner_address}{scheme}   (users: l4m run --spawner {self.config.spawner_address} FILE)",
            f"scheduler  {self.config.scheduler_address}{scheme}   (L4M sessions; unix:{self.config.scheduler_socket})",
            f"registry   unix:{self.config.registry_socket}   (the spawner's only; cluster secret "
            f"{self.config.cluster_secret_file})",
        ]
        if self.config.gateway_port >= 0:
            lines.append(f"gateway    {self.config.gateway_url}/v1   (the OpenAI API: base_url, with an API key)")
        lines += [f"{s.spec.name} {s.spec.health_address}   (model {s.spec.model or 'SmolLM2-135M-Instruct'}"
                  f"{', the default' if i == 0 else ''})"
                  for i, s in enumerate(e for e in self._services if e.spec.name.startswith("executor"))]
        lines += [f"executor   {address}   (on another host{', TLS' if self.config.tls_ca else ''}; the scheduler "
                  f"reconnects while it is away)" for address in self.config.remote_executors]
        lines += [
            f"metrics    http://{self.config.host}:{s.spec.metrics_port}/metrics ({s.spec.name})"
            for s in self._services
            if s.spec.metrics_port
        ]
        if self.config.insecure_local:
            lines.append("api keys   none needed: --insecure-local lets every local caller in as an admin")
        else:
            lines.append(f"admin key  {self.config.admin_key_file}   (l4m run reads it; more users: l4m keys "
                         f"--keys-file {self.config.api_keys_file} add NAME)")
        lines.append(f"logs       {self.config.log_dir}")
        return lines

    def _executor_host_endpoints(self, scheme: str) -> list[str]:
        lines = [f"{s.spec.name} {s.spec.health_address}{scheme}   (the control host joins it: l4m up --role control "
                 f"--executor {s.spec.health_address})" for s in self._services]
        lines += [f"metrics    http://127.0.0.1:{s.spec.metrics_port}/metrics ({s.spec.name})"
                  for s in self._services if s.spec.metrics_port]
        return [*lines, f"secret     {self.config.cluster_secret_file}", f"logs       {self.config.log_dir}"]

    async def wait_for_exit(self) -> RunningService:
        """Block until some service exits; return it (the caller decides what to do)."""
        waits = {asyncio.ensure_future(s.process.wait()): s for s in self._services}
        done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        service = waits[next(iter(done))]
        if service.pump is not None:  # its last lines, the reason it died included, are still in the pipe
            await asyncio.wait({service.pump}, timeout=2.0)
        return service

    async def stop(self) -> None:
        """Stop the services one by one, newest first (spawner, scheduler, executors): each goes before what
        it depends on, so none sees its peer vanish mid-call. SIGTERM, then SIGKILL after the grace period."""
        for service in reversed(self._services):
            if service.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    service.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(service.process.wait(), STOP_GRACE_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    service.process.kill()
                await service.process.wait()
        if self._pumps:  # the services' last lines (e.g. why one stopped) are still in their pipes
            await asyncio.wait(self._pumps, timeout=2.0)
        for pump in self._pumps:
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        self._pumps.clear()
        if self._lock_fd is not None and all(s.process.returncode is not None for s in self._services):
            remove_stale_sockets(self.config)  # a service killed after the grace period leaves its own
            self._unlock()

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def describe_exit(self, service: RunningService) -> str:
        tail = "\n".join(f"  | {line}" for line in service.log_tail[-LOG_TAIL_LINES:])
        return f"{service.spec.name} exited with code {service.process.returncode}; last log lines:\n{tail}"

    async def _spawn(self, spec: ServiceSpec) -> RunningService:
        log_path = self.config.log_dir / f"{spec.name}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # Each service names itself (l4m.executor, l4m.scheduler, l4m.spawner); one name for all would
        # merge them in a trace UI. The other OTEL_* variables (exporter, endpoint) pass through.
        env.pop("OTEL_SERVICE_NAME", None)
        command = spec.command()
        try:
            process = await asyncio.create_subprocess_exec(
                *command,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                start_new_session=True,  # Ctrl-C reaches the supervisor only; it stops children in order
                pass_fds=() if self._lock_fd is None else (self._lock_fd,),  # the state directory's claim
            )
        except OSError as error:
            hint = " (util-linux's chrt runs the control plane under SCHED_BATCH; without it, pass " \
                "--control-plane-cpu-policy normal)" if command[0] == "chrt" else ""
            raise ClusterError(f"could not start the {spec.name}: {command[0]}: {error.strerror}{hint}") from error
        service = RunningService(spec, process, log_path)
        self._services.append(service)
        service.pump = asyncio.create_task(self._pump_log(service))
        self._pumps.append(service.pump)
        return service

    async def _pump_log(self, service: RunningService) -> None:
        assert service.process.stdout is not None
        with service.log_path.open("a", encoding="utf-8") as log:
            async for raw in service.process.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                log.write(line + "\n")
                log.flush()
                service.log_tail.append(line)
                del service.log_tail[:-LOG_TAIL_LINES]
                if self.config.echo_logs:
                    self._say(f"[{service.spec.name}] {line}")

    async def _wait_healthy(self, service: RunningService) -> None:
        started = time.monotonic()
        deadline = started + self.config.start_timeout_s
        next_note = started + 5.0
        async with contextlib.AsyncExitStack() as stack:
            stub = None
            if service.spec.health_check == "grpc":
                channel = await stack.enter_async_context(
                    open_channel(service.spec.health_address, service.spec.tls_ca, _HEALTH_CHANNEL_OPTIONS))
                stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if service.process.returncode is not None:
                    await asyncio.sleep(0.2)  # let the log pump drain the last lines
                    raise ClusterError(self.describe_exit(service))
                if await _is_healthy(service.spec, stub):
                    self._say(f"[l4m up] {service.spec.name} is healthy after {time.monotonic() - started:.1f} s")
                    return
                now = time.monotonic()
                if now > deadline:
                    raise ClusterError(
                        f"{service.spec.name} was not healthy within {self.config.start_timeout_s:.0f} s; "
                        f"see {service.log_path}"
                    )
                if now > next_note:
                    self._say(f"[l4m up] waiting for {service.spec.name} ({now - started:.0f} s) ...")
                    next_note = now + 5.0
                await asyncio.sleep(0.2)
