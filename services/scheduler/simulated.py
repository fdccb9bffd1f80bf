"""A simulated executor (like Pie's simulator): the ExecutorService interface with no model.

`SimulatedExecutor` runs batches in order against its own allocation state (it rejects, with a
BatchError, any physical id that is not allocated, or allocated twice: a scheduler bug would show)
and keeps what each page holds (the token written at each slot), which swap_out / swap_in move to host
swap slots and back, as the real executor does with K/V (so tests see a preempted instance's pages return
intact)
and answers with deterministic fake results: the token after input `j` is a function of that token
and its position only, so an instance gets the same tokens whatever else is in its batch.
Latency per batch = base latency of its kind + per-token latency x tokens.

Three ways to use it: `SimulatedLink` (in-process, the same interface as the gRPC link: unit tests
and the benchmark), `SimulatedExecutorServicer` (grpc.aio), and
`python -m l4m.scheduler.simulated --listen 127.0.0.1:50061` (integration tests).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from grpc_health.v1 import health_pb2

from l4m import eventloop
from l4m.common.framed_execute import FramedExecuteServer
from l4m.common.serving import bound_address, build_server, serve_until_signal
from l4m.scheduler.executors import OnConnected, OnLost, OnResponse
from l4m.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from l4m.wire import limits

KV_PAGE = common_pb2.RESOURCE_KIND_KV_PAGE


@dataclass(frozen=True)
class SimulatedExecutorConfig:
    num_kv_pages: int = 1024
    num_embed_slots: int = 1024
    kv_page_size: int = 16
    vocab_size: int = 1000
    max_context_tokens: int = 4096
    max_batch_tokens: int = 8192
    # Advertised in GetInfo; a forward_text or sample_top_k batch asking for more entries is rejected.
    max_distribution_entries_per_batch: int = limits.EXECUTOR_MAX_DISTRIBUTION_ENTRIES_PER_BATCH
    max_reply_bytes: int = limits.EXECUTOR_MAX_REPLY_BYTES
    # Base latency of one batch, per kind (seconds); kinds not listed take `default_latency_s`.
    latency_s: dict[str, float] = field(default_factory=dict)
    default_latency_s: float = 0.0
    per_token_latency_s: float = 0.0
    capabilities: tuple[str, ...] = ("text",)
    tokenizer_json: str = ""  # served as is in ModelInfo (the simulator never tokenizes)
    model_name: str = "simulated"
    num_swap_slots: int = 0  # host swap slots (GetInfo's num_swap_slots)


class BatchRejected(Exception):
    def __init__(self, item_index: int, reason: str) -> None:
        super().__init__(reason)
        self.item_index = item_index
        self.reason = reason


def next_token(token_id: int, position_id: int, vocab_size: int) -> int:
    """The simulator's "model": a fixed function of the last token and its position."""
    return (token_id * 31 + position_id * 17 + 7) % vocab_size


def _first_allowed(runs: Sequence[int], preferred: int) -> int:
    """`preferred` if the vocabulary mask allows it, else the lowest allowed id."""
    start, first_allowed = 0, None
    for index, run in enumerate(runs):
        if index % 2 == 0 and run:
            if start <= preferred < start + run:
                return preferred
            if first_allowed is None:
                first_allowed = start
        start += run
    return preferred if first_allowed is None else first_allowed


class SimulatedExecutor:
    """The executor's state machine without a model (see the module docstring)."""

    def __init__(self, config: SimulatedExecutorConfig | None = None) -> None:
        self.config = config or SimulatedExecutorConfig()
        self.allocated_pages: set[int] = set()
        self.allocated_slots: set[int] = set()
        self.slot_values: dict[int, int] = {}
        # What each page holds: slot -> token written there (forward_text); swap slots hold a page's copy.
        self.page_contents: dict[int, dict[int, int]] = {}
        self.swap_contents: dict[int, dict[int, int]] = {}
        self.num_batches = 0
        self.num_errors = 0
        self.batch_sizes: list[tuple[str, int]] = []

    def info(self) -> executor_pb2.ExecutorServiceGetInfoResponse:
        c = self.config
        model = common_pb2.ModelInfo(
            name=c.model_name, architecture="none", vocab_size=c.vocab_size, num_layers=1, hidden_size=8,
            num_attention_heads=1, num_kv_heads=1, head_dim=8, max_context_tokens=c.max_context_tokens,
            stop_token_ids=[0], capabilities=list(c.capabilities), tokenizer_json=c.tokenizer_json,
        )
        return executor_pb2.ExecutorServiceGetInfoResponse(
            model=model, device="simulated", dtype="float32", kv_page_size=c.kv_page_size,
            num_kv_pages=c.num_kv_pages, num_embed_slots=c.num_embed_slots, max_batch_tokens=c.max_batch_tokens,
            max_request_bytes=limits.EXECUTOR_MAX_REQUEST_BYTES, max_reply_bytes=c.max_reply_bytes,
            max_distribution_entries_per_batch=c.max_distribution_entries_per_batch,
            num_swap_slots=c.num_swap_slots,
        )

    def latency_s(self, request: executor_pb2.ExecuteRequest) -> float:
        kind = request.WhichOneof("batch")
        c = self.config
        latency = c.latency_s.get(kind, c.default_latency_s)  # type: ignore[arg-type]
        if c.per_token_latency_s and kind == "forward_text":
            latency += c.per_token_latency_s * sum(len(i.token_ids) for i in request.forward_text.items)
        return latency

    def execute(self, request: executor_pb2.ExecuteRequest) -> executor_pb2.ExecuteResponse | None:
        """Run one batch; the response, or None for a fire-and-forget batch that succeeded."""
        kind = request.WhichOneof("batch")
        if kind == "debug_query":  # the scheduler's barrier ping
            self.num_batches += 1
            self.batch_sizes.append((kind, len(request.debug_query.queries)))
            response = executor_pb2.ExecuteResponse(correlation_id=request.correlation_id)
            response.debug_query.responses.extend("pong" for _ in request.debug_query.queries)
            return response
        items = getattr(request, kind).items if kind else ()  # type: ignore[arg-type]
        self.num_batches += 1
        self.batch_sizes.append((kind or "", len(items)))
        response = executor_pb2.ExecuteResponse(correlation_id=request.correlation_id)
        try:
            num_entries = sum(limits.distribution_entries(kind, item) for item in items)  # type: ignore[arg-type]
            if num_entries > self.config.max_distribution_entries_per_batch:
                raise BatchRejected(0, f"the batch asks for {num_entries} distribution entries, more than "
                                       f"{self.config.max_distribution_entries_per_batch}")
            for index, item in enumerate(items):
                self._check(kind, index, item)  # type: ignore[arg-type]
            return self._apply(kind, items, response)  # type: ignore[arg-type]
        except BatchRejected as rejected:
            self.num_errors += 1
            response.error.item_index = rejected.item_index
            response.error.has_item_index = True
            response.error.reason = rejected.reason
            return response

    def _need(self, index: int, ids: Sequence[int], held: set[int], what: str) -> None:
        for physical_id in ids:
            if physical_id not in held:
                raise BatchRejected(index, f"{what} {physical_id} is not allocated")

    def _check(self, kind: str, index: int, item: object) -> None:
        pages, slots = self.allocated_pages, self.allocated_slots
        if kind in ("allocate", "deallocate"):
            is_kv = item.kind == KV_PAGE  # type: ignore[attr-defined]
            held = pages if is_kv else slots
            capacity = self.config.num_kv_pages if is_kv else self.config.num_embed_slots
            for physical_id in item.ids:  # type: ignore[attr-defined]
                if physical_id >= capacity:
                    raise BatchRejected(index, f"id {physical_id} out of range")
                if (physical_id in held) == (kind == "allocate"):
                    raise BatchRejected(index, f"{kind} of id {physical_id}: wrong state")
        elif kind == "forward_text":
            self._need(index, item.kv_page_ids, pages, "page")  # type: ignore[attr-defined]
        elif kind == "forward":
            self._need(index, item.kv_page_ids, pages, "page")  # type: ignore[attr-defined]
            self._need(index, item.input_embed_slot_ids, slots, "slot")  # type: ignore[attr-defined]
            self._need(index, item.output_embed_slot_ids, slots, "slot")  # type: ignore[attr-defined]
        elif kind in ("embed_text", "embed_image"):
            self._need(index, item.embed_slot_ids, slots, "slot")  # type: ignore[attr-defined]
        elif kind == "sample_top_k":
            self._need(index, [item.embed_slot_id], slots, "slot")  # type: ignore[attr-defined]
        elif kind == "copy_kv_page":
            self._need(index, [item.source_kv_page_id, item.destination_kv_page_id], pages, "page")  # type: ignore[attr-defined]
        elif kind == "mask_kv_page":
            self._need(index, [item.kv_page_id], pages, "page")  # type: ignore[attr-defined]
        elif kind in ("swap_out", "swap_in"):
            page_ids, slot_ids = item.kv_page_ids, item.swap_slot_ids  # type: ignore[attr-defined]
            if len(page_ids) != len(slot_ids) or any(s >= self.config.num_swap_slots for s in slot_ids):
                raise BatchRejected(index, f"{kind}: bad swap slots {list(slot_ids)} for pages {list(page_ids)}")
            for physical_id in page_ids:
                if physical_id >= self.config.num_kv_pages or (physical_id in pages) != (kind == "swap_out"):
                    raise BatchRejected(index, f"{kind} of page {physical_id}: wrong state")

    def _apply(self, kind: str, items: Sequence, response: executor_pb2.ExecuteResponse) -> executor_pb2.ExecuteResponse | None:  # type: ignore[type-arg]
        vocab_size = self.config.vocab_size
        if kind in ("allocate", "deallocate"):
            for item in items:
                held = self.allocated_pages if item.kind == KV_PAGE else self.allocated_slots
                (held.update if kind == "allocate" else held.difference_update)(item.ids)
                if item.kind == KV_PAGE:
                    for page in item.ids:  # allocation zeroes a page
                        self.page_contents.pop(page, None)
            return None
        if kind in ("swap_out", "swap_in"):
            for item in items:
                for page, slot in zip(item.kv_page_ids, item.swap_slot_ids, strict=True):
                    if kind == "swap_out":
                        self.swap_contents[slot] = self.page_contents.pop(page, {})
                        self.allocated_pages.discard(page)
                    else:
                        self.page_contents[page] = dict(self.swap_contents.get(slot, {}))
                        self.allocated_pages.add(page)
            return None
        if kind == "embed_text":
            for item in items:
                for slot, token, position in zip(item.embed_slot_ids, item.token_ids, item.position_ids, strict=True):
                    self.slot_values[slot] = next_token(token, position, vocab_size)
            return None
        if kind == "forward_text":  # answered with or without outputs, like the real executor
            for item in items:
                self._write(item)
                result = response.forward_text.items.add()
                for index, sampler in zip(item.output_indices, item.samplers, strict=True):
                    token = next_token(item.token_ids[index], item.position_ids[index], vocab_size)
                    if sampler.vocabulary_mask.run_lengths:
                        token = _first_allowed(sampler.vocabulary_mask.run_lengths, token)
                    output = result.outputs.add()
                    if sampler.kind == common_pb2.SAMPLER_KIND_DISTRIBUTION:
                        k = sampler.distribution_top_k
                        output.distribution.token_ids.extend((token + i) % vocab_size for i in range(k))
                        output.distribution.probabilities.extend(0.5 ** (i + 1) for i in range(k))
                    else:
                        output.token.token_id = token
                        output.token.logprob = -0.5
                        output.token.top_token_ids.extend((token + i) % vocab_size for i in range(sampler.top_logprobs))
                        output.token.top_logprobs.extend(-0.5 - i for i in range(sampler.top_logprobs))
                # Continuation: the sampled token is fed back at the next position, as on the executor.
                position = item.position_ids[-1] if item.position_ids else 0
                stops = set(item.continuation_stop_token_ids)
                for step in range(1, item.num_continuation_steps + 1):
                    if not result.outputs or result.outputs[-1].token.token_id in stops:
                        break
                    token = next_token(result.outputs[-1].token.token_id, position + step, vocab_size)
                    result.outputs.add(token=common_pb2.SampledToken(token_id=token, logprob=-0.5))
            return response
        if kind == "forward":
            for item in items:
                for index, slot in zip(item.output_indices, item.output_embed_slot_ids, strict=True):
                    self.slot_values[slot] = self.slot_values.get(item.input_embed_slot_ids[index], 0)
            response.forward.num_items = len(items)
            return response
        if kind == "sample_top_k":
            for item in items:
                base = self.slot_values.get(item.embed_slot_id, 0)
                distribution = response.sample_top_k.items.add()
                distribution.token_ids.extend((base + i) % vocab_size for i in range(item.k))
                distribution.probabilities.extend(0.5 ** (i + 1) for i in range(item.k))
            return response
        return None  # copy, mask, embed_image: nothing to compute

    def _write(self, item: common_pb2.ForwardTextItem) -> None:
        """Record the item's input tokens at their page slots (the LENGTH RULE: the new tokens, then its
        continuation steps, fill the last slots of its context)."""
        size = self.config.kv_page_size
        total = (len(item.kv_page_ids) - 1) * size + item.kv_last_page_length
        first = total - len(item.token_ids) - item.num_continuation_steps
        for offset, token in enumerate(item.token_ids):
            slot = first + offset
            self.page_contents.setdefault(item.kv_page_ids[slot // size], {})[slot % size] = token

    def contents(self, pages: Sequence[int]) -> list[dict[int, int]]:
        """What the pages hold (slot -> token), in order."""
        return [dict(self.page_contents.get(page, {})) for page in pages]


class Pacer:
    """Replies of a simulated executor that runs one batch at a time: each `latency` after the later of
    now and the previous one's (at once, in the next turn of the loop, without latency)."""

    def __init__(self) -> None:
        self._busy_until = 0.0

    def call_after(self, latency: float, callback: Callable[..., object], *args: object) -> None:
        loop = asyncio.get_running_loop()
        if latency <= 0:
            loop.call_soon(callback, *args)
            return
        self._busy_until = max(loop.time(), self._busy_until) + latency
        loop.call_at(self._busy_until, callback, *args)


class SimulatedLink:
    """In-process link to a `SimulatedExecutor`: same interface as `GrpcExecutorLink`. Batches run in
    order, each finishing `latency_s` after the previous one (or at once, latency 0)."""

    def __init__(self, executor: SimulatedExecutor | None = None, address: str = "simulated") -> None:
        self.executor = executor or SimulatedExecutor()
        self.address = address
        self._on_response: OnResponse | None = None
        self._on_lost: OnLost | None = None
        self._on_connected: OnConnected | None = None
        self._pacer = Pacer()
        self.is_connected = False
        self.sent: list[executor_pb2.ExecuteRequest] = []
        self.keep_sent = False

    def start(self, on_connected: OnConnected, on_response: OnResponse, on_lost: OnLost) -> None:
        self._on_connected, self._on_response, self._on_lost = on_connected, on_response, on_lost
        self.reconnect()

    def reconnect(self) -> None:
        """(Re)connect with a fresh executor state, as a restarted executor would."""
        self.executor = SimulatedExecutor(self.executor.config)
        self.is_connected = True
        self._on_connected(self.executor.info())  # type: ignore[misc]

    def lose(self, reason: str = "simulated loss") -> None:
        self.is_connected = False
        self._on_lost(reason)  # type: ignore[misc]

    def send(self, request: executor_pb2.ExecuteRequest) -> None:
        if not self.is_connected:
            return
        if self.keep_sent:
            self.sent.append(request)
        response = self.executor.execute(request)
        if response is None:
            return
        self._pacer.call_after(self.executor.latency_s(request), self._deliver, response)

    def _deliver(self, response: executor_pb2.ExecuteResponse) -> None:
        if self.is_connected:
            self._on_response(response)  # type: ignore[misc]

    async def close(self) -> None:
        self.is_connected = False


class SimulatedExecutorServicer(executor_pb2_grpc.ExecutorServiceServicer):
    """ExecutorService over gRPC, backed by one `SimulatedExecutor` per Execute stream (framed ones too:
    `open_framed_stream`)."""

    def __init__(self, config: SimulatedExecutorConfig, framed_execute_path: str = "") -> None:
        self.config = config
        self.framed_execute_path = framed_execute_path

    async def GetInfo(self, request, context):  # type: ignore[no-untyped-def]
        info = SimulatedExecutor(self.config).info()
        info.framed_execute_path = self.framed_execute_path
        return info

    async def Reset(self, request, context):  # type: ignore[no-untyped-def]
        # Each Execute stream has a state of its own, fresh when it opens: nothing outlives a stream.
        return executor_pb2.ExecutorServiceResetResponse()

    async def Execute(self, request_iterator, context):  # type: ignore[no-untyped-def]
        executor = SimulatedExecutor(self.config)
        async for request in request_iterator:
            latency = executor.latency_s(request)
            if latency > 0:
                await asyncio.sleep(latency)
            response = executor.execute(request)
            if response is not None:
                yield response

    def open_framed_stream(self) -> SimulatedFramedStream:
        return SimulatedFramedStream(SimulatedExecutor(self.config))


class SimulatedFramedStream:
    """A framed Execute stream's batches on a fresh `SimulatedExecutor`, each reply after its latency
    (one batch at a time, as on the gRPC stream)."""

    is_retired = False  # each stream has a state of its own: Reset retires nothing

    def __init__(self, executor: SimulatedExecutor) -> None:
        self.executor = executor
        self._pacer = Pacer()

    def run(self, request: executor_pb2.ExecuteRequest) -> asyncio.Future[executor_pb2.ExecuteResponse | None]:
        reply: asyncio.Future[executor_pb2.ExecuteResponse | None] = asyncio.get_running_loop().create_future()
        latency = self.executor.latency_s(request)
        self._pacer.call_after(latency, reply.set_result, self.executor.execute(request))
        return reply


async def serve(listen: str, config: SimulatedExecutorConfig, listen_framed: str = "") -> None:
    """Serves until SIGINT or SIGTERM, on the services' one front door (health and reflection included),
    and the framed Execute stream on `listen_framed` when given."""
    servicer = SimulatedExecutorServicer(config, os.path.abspath(listen_framed) if listen_framed else "")
    server = build_server([(executor_pb2_grpc.add_ExecutorServiceServicer_to_server, servicer)],
                          [(listen, None)], options=limits.EXECUTOR_KEEPALIVE_SERVER_OPTIONS,  # the scheduler's pings
                          health_names=[executor_pb2.DESCRIPTOR.services_by_name["ExecutorService"].full_name])
    framed = FramedExecuteServer(servicer.framed_execute_path, servicer.open_framed_stream) if listen_framed else None

    async def start() -> None:
        await server.start()
        if framed is not None:
            await framed.start()
        await server.set_health(health_pb2.HealthCheckResponse.SERVING)
        print(f"simulated executor listening on {bound_address(listen, server.port)}", flush=True)

    async def stop() -> None:
        if framed is not None:
            await framed.stop()
        await server.stop(1.0)

    await serve_until_signal(start, stop)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m l4m.scheduler.simulated", description=__doc__.split("\n")[0])
    parser.add_argument("--listen", default="127.0.0.1:0", help="host:port (port 0 picks one)")
    parser.add_argument("--num-kv-pages", type=int, default=1024)
    parser.add_argument("--num-embed-slots", type=int, default=1024)
    parser.add_argument("--kv-page-size", type=int, default=16)
    parser.add_argument("--vocab-size", type=int, default=1000)
    parser.add_argument("--forward-latency-ms", type=float, default=0.0, help="base latency of a forward batch")
    parser.add_argument("--per-token-latency-us", type=float, default=0.0)
    parser.add_argument("--listen-framed", default="", metavar="PATH", help="also serve Execute as frames here")
    parser.add_argument("--num-swap-slots", type=int, default=0, help="host swap slots for preempted pages")
    parser.add_argument("--tokenizer-json", type=Path, default=None,
                        help="a `tokenizers` JSON file that GetInfo hands out (with a matching --vocab-size)")
    args = parser.parse_args(argv)
    config = SimulatedExecutorConfig(
        num_kv_pages=args.num_kv_pages, num_embed_slots=args.num_embed_slots, kv_page_size=args.kv_page_size,
        vocab_size=args.vocab_size,
        latency_s={"forward_text": args.forward_latency_ms / 1000, "forward": args.forward_latency_ms / 1000},
        per_token_latency_s=args.per_token_latency_us / 1e6,
        tokenizer_json=args.tokenizer_json.read_text() if args.tokenizer_json else "",
        num_swap_slots=args.num_swap_slots,
    )
    logging.basicConfig(level=logging.INFO)
    eventloop.run(serve(args.listen, config, args.listen_framed))


if __name__ == "__main__":
    main()
