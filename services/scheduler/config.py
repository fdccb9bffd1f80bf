"""The scheduler's configuration: one frozen dataclass, built once in `main()` from flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from l4m.wire.credentials import TlsFiles
from l4m.wire.rules import MAX_CONTINUATION_STEPS


@dataclass(frozen=True)
class SchedulerConfig:
    """Everything the scheduler process is told at start.

    `batching` is the forward/forward_text strategy: "adaptive" (= "adaptive:250:150:1"),
    "adaptive:<max_hold_ms>[:<launch_hold_ms>[:<hold_fraction>]]", "t-only:<t_ms>", "k-only:<k>" or "k-or-t:<k>:<t_ms>"
    (switchable live with debug_query "batching:...", by an admin instance).
    """

    # The data plane (L4MService, health, reflection): what controllers and sandboxes reach.
    listen: str = "127.0.0.1:0"
    listen_unix: str | None = None
    # L4M sessions over length-prefixed frames on this Unix socket path (framed.py), beside gRPC.
    listen_framed: str | None = None
    # The control plane (InstanceRegistryService): the spawner's alone, e.g. "unix:<state>/internal/
    # registry.sock". None: no registry is served (a scheduler of anonymous sessions only).
    registry_listen: str | None = None
    # The cluster secret: every registry call must present it, and it is sent to the executors.
    cluster_secret: str = ""
    # TLS on the TCP listeners; the CA that signed the executors' certificates (None: plaintext).
    tls: TlsFiles | None = None
    executor_tls_ca: Path | None = None
    # Registered instances at most (each holds a token and tables); past it RegisterInstance answers
    # RESOURCE_EXHAUSTED, so a flood of registrations cannot grow the scheduler without bound.
    max_instances: int = 1024
    executor_addresses: tuple[str, ...] = ()
    # "auto": the framed Execute stream where an executor on this host offers one (GetInfo); "grpc": never.
    executor_transport: str = "auto"
    batching: str = "adaptive"
    # KV pages one instance may hold at most; 0 = one executor's whole capacity.
    max_kv_pages_per_instance: int = 0
    # Embedding slots one instance may hold at most; 0 = one executor's whole capacity.
    max_embed_slots_per_instance: int = 0
    allow_anonymous: bool = False
    # Continuation steps one forward_text may ask for (0 turns continuation off): each step makes the
    # batch carrying it, and so every instance in that batch, wait one more decode step for its reply.
    max_continuation_steps: int = MAX_CONTINUATION_STEPS
    # Tokens one chunk of a long forward_text carries at most (prefill.py): a forward_text with more runs
    # as consecutive chunks, each batched beside other streams' decode steps. 0: half the executors'
    # max_batch_tokens, at most 2048; never more than max_batch_tokens.
    prefill_chunk_tokens: int = 0
    # What one chunk token's own work (its linears) costs, in context slots of attention. With > 0 the
    # chunks of a long forward_text shrink as their context grows, each costing about what its first
    # chunk of prefill_chunk_tokens does (prefill.chunk_sizes); 0: every chunk prefill_chunk_tokens.
    prefill_chunk_token_slots: int = 0
    max_export_name_bytes: int = 256
    # Distinct KV pages one user's persistent exports may hold together (they outlive the user's
    # instances, so nothing else bounds them); past it export_kv_pages traps RESOURCE_EXHAUSTED.
    # None: half of the smallest connected executor's pages; 0: unlimited.
    max_export_pages_per_user: int | None = None
    max_export_metadata_bytes: int = 1 << 20
    # Under memory pressure (contention.py): instances whose allocation of kv pages cannot be met, even by
    # preempting instances ranked after them, wait in the admission queue, at most this many at once (one
    # more traps RESOURCE_EXHAUSTED; 0: no queue, such an allocation traps at once) ...
    max_waiting_instances: int = 256
    # ... and for at most this long, from their first failed allocation until one gets through (then they
    # trap RESOURCE_EXHAUSTED, saying so).
    admission_timeout_s: float = 60.0
    # Executor reconnect backoff: first delay, doubled per failure up to the max.
    reconnect_initial_s: float = 0.1
    reconnect_max_s: float = 5.0
    # Deadline of the executor GetInfo call made on (re)connect.
    executor_rpc_timeout_s: float = 10.0
    extra_labels: dict[str, str] = field(default_factory=dict)
