"""The spawner's configuration: built once in `main()` from flags and environment, passed down."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from l4m.spawner.sandbox import DEFAULT_CPU_POLICY, Limits

MiB = 1024 * 1024


@dataclass(frozen=True)
class SpawnerConfig:
    state_dir: Path  # programs under state_dir/store
    # Directory mounted at /run/l4m in every sandbox: the runtime socket is created here, and the
    # scheduler's socket (`scheduler_socket_name`) is expected here.
    socket_dir: Path
    listen_address: str = "127.0.0.1:0"  # users' SpawnerService (host:port; port 0 = any)
    spawner_id: str = "default"
    sandbox_kind: str = "process"  # "process" (bubblewrap) or "docker"
    docker_image: str = ""  # empty: build/reuse the controller image
    # The scheduler's InstanceRegistryService (host:port or unix:///...); empty = no scheduler.
    scheduler_registry_address: str = ""
    scheduler_socket_name: str = "scheduler.sock"
    # The scheduler's framed-session socket (its --listen-framed) in socket_dir: when set, controllers
    # speak L4M over it (`framed:` addresses, ~4x less CPU per message than gRPC); empty: over gRPC.
    scheduler_framed_socket_name: str = ""
    runtime_socket_name: str = "runtime.sock"
    # Where controllers make their runtime calls (user messages, user input, variables, children) as frames
    # (spawner.proto, "SendToUser over frames"), in socket_dir beside the runtime socket; empty: not served,
    # they go over RuntimeService on gRPC.
    runtime_framed_socket_name: str = "runtime.frames.sock"
    max_program_bytes: int = 4 * MiB  # per upload; see validate_upload.py for what compiling costs
    # Uploads are validated in child processes, each under this address-space limit and wall time,
    # at most this many at once (see validate_upload.py).
    upload_validation_memory_bytes: int = 1024 * MiB
    upload_validation_timeout_s: float = 30.0
    max_concurrent_upload_validations: int = 2
    default_limits: Limits = field(default_factory=Limits)
    max_limits: Limits = field(
        default_factory=lambda: Limits(
            wall_time_s=3600.0,
            cpu_time_s=3600.0,
            memory_bytes=4096 * MiB,
            max_processes=256,
            max_open_files=1024,
            max_output_bytes=256 * MiB,
        )
    )
    default_max_tokens: int = 0  # per instance; 0 = unlimited
    max_children_per_tree: int = 32
    max_instances: int = 256  # alive at once
    # Exited instances kept for ListInstances/Attach, newest first: each a summary (its exit and at most
    # supervisor.EXITED_REPLAY_BYTES of output tail, 64 KiB), so at most ~64 MiB for the default 1000.
    max_exited_instances: int = 1000
    # Controllers run as `python -m <controller_runner> PROGRAM ARGS` (the SDK's runner, which calls
    # the program's `async def main(ctx)`); empty: `python PROGRAM ARGS`, for plain scripts.
    controller_runner: str = "l4m.controller"
    # Process sandboxes started ahead of demand, each serving one launch (see process_sandbox.py); about
    # 50 MiB of memory each while they wait, started on idle CPU only. 0: every launch starts cold.
    warm_pool_size: int = 2
    # How many instances launched with `share_process` may run in one controller process (spawner/shared.py);
    # 1: every instance has a process of its own. The operator's flag (--max-instances-per-process).
    max_instances_per_process: int = 16
    # The most each round of the warm pool's refill waits for the host to have a CPU core to spare
    # (spawner/host_load.py): so that sandbox starts do not take CPU from an executor that decodes on
    # this host's cores. 0 (default): refill at once. The operator's flag (--warm-pool-quiet-wait-s).
    warm_pool_quiet_wait_s: float = 0.0
    # The CPU scheduling policy launched controllers run under, a name in sandbox.CPU_POLICIES: "batch"
    # (default; they never preempt a running task when they wake, which on a host where an executor
    # decodes on the same cores keeps them from stalling its threads) or "normal". Every backend sets
    # it; the sandbox's seccomp filter keeps a controller from changing it. The operator's flag
    # (--controller-cpu-policy).
    controller_cpu_policy: str = DEFAULT_CPU_POLICY
    # The OTLP/gRPC endpoint controllers' spans are forwarded to through the runtime socket (the
    # spawner's own exporter endpoint); empty: controllers are not asked to export spans.
    controller_spans_endpoint: str = ""
    controller_spans_headers: tuple[tuple[str, str], ...] = ()  # sent with forwarded spans
    # Users: API keys from this file (`l4m keys`, re-read when it changes). `insecure_local` lets a
    # call without a key in as the admin "local" (loopback only; a wrong key is still refused).
    api_keys_file: Path | None = None
    insecure_local: bool = False
    max_instances_per_user: int = 64  # alive at once; a key may set its own
    # Sums over one user's instances alive (or starting): of their memory limits, and of their wall time
    # limits. The defaults admit max_instances_per_user (64) launches at the default memory (512 MiB)
    # and 900 s of wall time each (bench/e2e.py's), and fewer larger ones: 8 at the 4 GiB memory
    # maximum, 16 at the 3600 s wall time maximum.
    max_memory_bytes_per_user: int = 64 * 512 * MiB
    max_wall_time_s_per_user: float = 64 * 900.0
    # The total of one launch tree's shared variables (each costs its name, value and 256 bytes).
    max_variable_bytes_per_tree: int = 64 * MiB
    # Unread messages from users to one instance (each costs its bytes and 64).
    max_inbox_bytes: int = 1 * MiB
    max_args_bytes: int = 64 * 1024  # a launch's arguments in all (kept with the instance's summary)
    max_tokens_per_minute_per_user: int = 0  # given to the scheduler; 0 = unlimited; a key may set its own
    # A launch that is not detached and that no client has attached to this long after it started
    # is terminated (its client went away between Launch and Attach).
    unattached_grace_s: float = 30.0
    # The control plane: the cluster secret sent to the scheduler's registry, and the CA of a TLS one.
    cluster_secret_file: Path | None = None
    scheduler_tls_ca: Path | None = None
    # TLS on the users' listener (both or neither).
    tls_cert: Path | None = None
    tls_key: Path | None = None
