"""Bounds on what one command and one batch may ask for, and the gRPC message limits that follow from them.

One home for both, so that they cannot drift apart: every service sets its gRPC send and receive limits
from the constants here, and validation (the scheduler's `check_command`, the executor's `batch_from_pb`)
bounds commands and batches so that a valid one can never produce a message those limits refuse.

The hops and their limits (each side of a hop uses the same number):

    controller --SessionRequest--> scheduler           MAX_COMMAND_BYTES
    scheduler --SessionResponse--> controller          MAX_RESPONSE_BYTES
    scheduler --ExecuteRequest--> executor             EXECUTOR_MAX_REQUEST_BYTES
    executor --ExecuteResponse--> scheduler            EXECUTOR_MAX_REPLY_BYTES

A reply's size is bounded by what the command asked for, not by data: `reply_bytes` counts the worst-case
protobuf bytes of a command's answer (every varint at its longest), so a sum of them over a batch, plus
`MESSAGE_MARGIN_BYTES` for the envelope, is an upper bound on the batch's reply.
"""

from __future__ import annotations

from collections.abc import Sequence

from l4m.v1 import common_pb2

MIB = 1 << 20
# Room for what a message carries besides its items: the envelope (correlation id, trace context, oneof
# tags), each item's framing in its repeated field, and ids the scheduler rewrites after it counted an
# item (a virtual id of 1 byte may become a physical id of up to 5).
MESSAGE_MARGIN_BYTES = 1 * MIB

# Largest SessionRequest the scheduler accepts from a controller (its receive limit, the SDK's send limit).
MAX_COMMAND_BYTES = 64 * MIB
# Largest SessionResponse the scheduler sends a controller (its send limit, the SDK's receive limit).
MAX_RESPONSE_BYTES = 64 * MIB
# Largest batch the executor accepts (its receive limit, the scheduler's send limit on the executor
# link): one command of MAX_COMMAND_BYTES always fits, with its rewritten ids.
EXECUTOR_MAX_REQUEST_BYTES = MAX_COMMAND_BYTES + MESSAGE_MARGIN_BYTES
# Largest RuntimeService request a controller sends the spawner (a SendToUser message's text, on gRPC or
# as a frame): gRPC's default receive limit, which the runtime socket keeps.
RUNTIME_MAX_REQUEST_BYTES = 4 * MIB
# Largest batch reply the executor sends (its send limit, the scheduler's receive limit on the link).
EXECUTOR_MAX_REPLY_BYTES = 64 * MIB

# Distribution entries (the `distribution_top_k` of every DISTRIBUTION output, the `k` of every
# sample_top_k item) one batch may ask for: 4 Mi entries are at most 36 MiB of reply.
EXECUTOR_MAX_DISTRIBUTION_ENTRIES_PER_BATCH = 4 * MIB
# The scheduler's own bound on one command (GetInfo advertises the smaller of it and the executors'
# per-batch bound): 1 Mi entries are 21 full distributions over a 49,152-token vocabulary, 9 MiB of reply.
DEFAULT_MAX_DISTRIBUTION_ENTRIES_PER_COMMAND = 1 * MIB

_DISTRIBUTION = common_pb2.SAMPLER_KIND_DISTRIBUTION

# BRLE runs one command's masks may carry in all (attention rows and vocabulary masks), the scheduler's
# default: validation reads every run on its event loop (about 30 ms per Mi runs measured on a 2-core
# machine), and the executor decodes them.
DEFAULT_MAX_MASK_RUNS_PER_COMMAND = 1 * MIB

# Worst-case protobuf bytes of the pieces of a reply (tests/unit/executor/test_bounds.py builds them with
# every varint at its longest and checks these against ByteSize()).
# One distribution entry: a token id (uint32 varint, <= 5 bytes) and a probability (float, 4), packed.
DISTRIBUTION_ENTRY_BYTES = 9
# One output in its repeated field: a sampled token with its logprob, or a distribution's framing.
OUTPUT_BYTES = 32
# One item's result in its repeated field (ForwardTextResult, or a sample_top_k Distribution), or the
# SessionResponse around one command's reply.
ITEM_BYTES = 16


def max_brle_runs(num_values: int) -> int:
    """Most runs a BRLE that decodes to `num_values` values may carry: one per value, a zero-length run
    beside each (zero-length runs are legal, see `l4m.v1.Brle`), and the leading zero-length run. More
    runs only cost decoding work: a mask of millions of zero-length runs is refused, not decoded."""
    return 2 * num_values + 1


def reply_cost(kind: str, item: object) -> tuple[int, int]:
    """What one command (or batch item) asks its reply to hold: (distribution entries, bytes at most).

    Entries: outputs x distribution_top_k summed over a forward_text's DISTRIBUTION samplers plus each
    other sampler's top_logprobs per token it returns (continuation steps included), or a
    sample_top_k's `k`; 0 for any other kind. Bytes: the item in a batch reply, or the reply in its
    SessionResponse, with every output at its longest and a token output per continuation step."""
    if kind == "forward_text":
        samplers = item.samplers  # type: ignore[attr-defined]
        num_steps = item.num_continuation_steps  # type: ignore[attr-defined]
        return forward_text_reply_cost(
            num_steps, [(s.kind, s.distribution_top_k, getattr(s, "top_logprobs", 0)) for s in samplers])
    if kind == "sample_top_k":
        k = item.k  # type: ignore[attr-defined]
        return k, ITEM_BYTES + OUTPUT_BYTES + DISTRIBUTION_ENTRY_BYTES * k
    return 0, ITEM_BYTES


def forward_text_reply_cost(num_continuation_steps: int,
                            samplers: Sequence[tuple[int, int, int]]) -> tuple[int, int]:
    """`reply_cost` of a forward_text from plain values: its continuation steps and, per sampler, (kind,
    distribution_top_k, top_logprobs) (the scheduler's validation has them already)."""
    num_entries = 0
    for kind, distribution_top_k, top_logprobs in samplers:
        if kind == _DISTRIBUTION:
            num_entries += distribution_top_k
        else:  # top_logprobs alternatives beside each token: its own and one per continuation step
            num_entries += top_logprobs * (1 + num_continuation_steps)
    num_outputs = len(samplers) + num_continuation_steps
    return num_entries, ITEM_BYTES + OUTPUT_BYTES * num_outputs + DISTRIBUTION_ENTRY_BYTES * num_entries


def distribution_entries(kind: str, item: object) -> int:
    """The entries of `reply_cost`."""
    return reply_cost(kind, item)[0]


def reply_bytes(kind: str, item: object) -> int:
    """The bytes of `reply_cost`."""
    return reply_cost(kind, item)[1]


def grpc_options(max_send_bytes: int, max_receive_bytes: int) -> list[tuple[str, int]]:
    """gRPC channel or server options for these message limits."""
    return [("grpc.max_send_message_length", max_send_bytes), ("grpc.max_receive_message_length", max_receive_bytes)]


# The scheduler -> executor hop's health, both sides of it. An executor host that vanishes without closing
# its connections (power, network, a kernel panic) sends no FIN or RST: the scheduler pings every
# EXECUTOR_KEEPALIVE_TIME_MS, calls open or not, data flowing or not, and a ping unanswered for
# EXECUTOR_KEEPALIVE_TIMEOUT_MS closes the connection, so the loss is seen about 4 s after the host's last
# word. Executors (real and simulated) accept pings that often: gRPC's server default counts a ping less than
# 5 minutes after the last one without data as a strike and, after two, ends the connection ("Too many
# pings"). That key is core's GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, whose string is
# "grpc.http2.min_ping_interval_without_data_ms"; gRPC ignores a misspelt key without a word.
EXECUTOR_KEEPALIVE_TIME_MS = 2000
EXECUTOR_KEEPALIVE_TIMEOUT_MS = 2000
EXECUTOR_KEEPALIVE_CLIENT_OPTIONS = (
    ("grpc.keepalive_time_ms", EXECUTOR_KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", EXECUTOR_KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),  # an idle Execute stream sends no data: keep pinging anyway
)
EXECUTOR_KEEPALIVE_SERVER_OPTIONS = (
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", EXECUTOR_KEEPALIVE_TIME_MS // 2),
)
