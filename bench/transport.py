"""What one L4M round trip costs in CPU on each transport (issue #19): a controller's stepwise decode is one
SessionRequest (a one-token forward_text) and one SessionResponse (its sampled token) per token, so the
per-message cost of the transport bounds both the SDK's CPU per token and a scheduler's commands/s.

An echo server (a separate process: it answers every request with a fixed one-token reply) and a client
with N concurrent streams, each a closed loop (the next request when the reply is in), on a Unix socket:

  grpc.aio   L4MService.Session, as the SDK and the scheduler speak it today (`l4m.common.serving`)
  framed     the same messages as framed sessions' frames (`l4m.wire.frames`: a 5-byte header), read by the
             framed sessions' own `FrameProtocol` (an asyncio protocol) on a Unix stream

Each mode runs on the default asyncio loop and, when `uvloop` is installed, on uvloop too. CPU is the
client's process time and the server's utime + stime from /proc, per round trip.

    flock -x /tmp/l4m-bench.lock taskset -c 0,1 .venv/bin/python bench/transport.py
    .venv/bin/python bench/transport.py --streams 1,16 --duration-s 3 --out bench/results/transport.json
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from l4m.v1 import common_pb2, l4m_pb2, l4m_pb2_grpc
from l4m.wire import frames, limits

HAS_UVLOOP = importlib.util.find_spec("uvloop") is not None


def decode_step(request_id: int) -> l4m_pb2.SessionRequest:
    """One stepwise decode command, as `Context.step` sends it: one token on a 3-page context, one greedy output."""
    item = common_pb2.ForwardTextItem(kv_page_ids=[0, 1, 2], kv_last_page_length=5, token_ids=[1234],
                                      position_ids=[36], output_indices=[0],
                                      samplers=[common_pb2.SamplerSpec(kind=common_pb2.SAMPLER_KIND_GREEDY)])
    return l4m_pb2.SessionRequest(stream_id=1, request_id=request_id, forward_text=item)


def reply_to(request: l4m_pb2.SessionRequest) -> l4m_pb2.SessionResponse:
    token = common_pb2.OutputResult(token=common_pb2.SampledToken(token_id=4321, logprob=-0.25))
    return l4m_pb2.SessionResponse(stream_id=request.stream_id, request_id=request.request_id,
                                   forward_text=common_pb2.ForwardTextResult(outputs=[token]))


# ---- the echo server (its own process) ---------------------------------------------------------------


class EchoServicer(l4m_pb2_grpc.L4MServiceServicer):
    async def Session(self, request_iterator: AsyncIterator[l4m_pb2.SessionRequest],  # noqa: N802 (gRPC's name)
                      context: grpc.aio.ServicerContext) -> AsyncIterator[l4m_pb2.SessionResponse]:
        async for request in request_iterator:
            yield reply_to(request)


async def serve_grpc(path: str) -> None:
    from l4m.common.serving import build_server

    server = build_server([(l4m_pb2_grpc.add_L4MServiceServicer_to_server, EchoServicer())], [(f"unix:{path}", None)],
                          reflection=False)
    await server.start()
    print("ready", flush=True)
    await server.server.wait_for_termination()


class EchoProtocol(frames.FrameProtocol):
    """The framed echo server's connection: answers every request frame in the read that brought it."""

    def __init__(self) -> None:
        super().__init__(limits.MAX_COMMAND_BYTES)

    def frame_received(self, kind: int, payload: bytes) -> None:
        self.write(frames.encode(frames.RESPONSE, reply_to(l4m_pb2.SessionRequest.FromString(payload))))

    def stream_ended(self, error: Exception | None) -> None:
        if self.transport is not None:
            self.transport.close()


async def serve_framed(path: str) -> None:
    server = await asyncio.get_running_loop().create_unix_server(EchoProtocol, path)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


def run_server(mode: str, loop: str, path: str) -> None:
    if loop == "uvloop":
        import uvloop

        uvloop.install()
    asyncio.run(serve_grpc(path) if mode == "grpc.aio" else serve_framed(path))


# ---- the client ---------------------------------------------------------------------------------------


async def grpc_streams(path: str, num_streams: int, duration_s: float) -> int:
    channel = grpc.aio.insecure_channel(f"unix:{path}")
    stub = l4m_pb2_grpc.L4MServiceStub(channel)
    stop_at = time.perf_counter() + duration_s
    counts = [0] * num_streams

    async def stream(index: int) -> None:
        call = stub.Session()
        request_id = 0
        while time.perf_counter() < stop_at:
            request_id += 1
            await call.write(decode_step(request_id))
            await call.read()
        counts[index] = request_id
        await call.done_writing()

    await asyncio.gather(*(stream(i) for i in range(num_streams)))
    await channel.close()
    return sum(counts)


class ClientProtocol(frames.FrameProtocol):
    """One framed stream of the client: each reply wakes the stream's waiting future."""

    def __init__(self) -> None:
        super().__init__(limits.MAX_RESPONSE_BYTES)
        self.reply: asyncio.Future[l4m_pb2.SessionResponse] | None = None

    def frame_received(self, kind: int, payload: bytes) -> None:
        assert self.reply is not None
        self.reply.set_result(l4m_pb2.SessionResponse.FromString(payload))

    def stream_ended(self, error: Exception | None) -> None:
        if self.reply is not None and not self.reply.done():
            self.reply.set_exception(ConnectionError(f"the echo server closed the stream ({error})"))


async def framed_streams(path: str, num_streams: int, duration_s: float) -> int:
    loop = asyncio.get_running_loop()
    stop_at = time.perf_counter() + duration_s
    counts = [0] * num_streams

    async def stream(index: int) -> None:
        transport, protocol = await loop.create_unix_connection(ClientProtocol, path)
        request_id = 0
        while time.perf_counter() < stop_at:
            request_id += 1
            protocol.reply = loop.create_future()
            protocol.write(frames.encode(frames.REQUEST, decode_step(request_id)))
            await protocol.reply
        counts[index] = request_id
        transport.close()

    await asyncio.gather(*(stream(i) for i in range(num_streams)))
    return sum(counts)


def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def measure(mode: str, loop: str, num_streams: int, duration_s: float) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="l4m-transport-") as state:
        path = f"{state}/echo.sock"
        server = subprocess.Popen([sys.executable, __file__, "--serve", mode, "--loop", loop, "--socket", path],
                                  stdout=subprocess.PIPE, text=True)
        try:
            if server.stdout is None or server.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the {mode} echo server did not start")
            if loop == "uvloop":
                import uvloop

                uvloop.install()
            run = grpc_streams if mode == "grpc.aio" else framed_streams
            asyncio.run(run(path, num_streams, 0.3))  # warm-up: connections, first messages
            server_before, client_before = process_cpu_s(server.pid), time.process_time()
            started = time.perf_counter()
            num_round_trips = asyncio.run(run(path, num_streams, duration_s))
            elapsed = time.perf_counter() - started
            client_cpu = time.process_time() - client_before
            server_cpu = process_cpu_s(server.pid) - server_before
        finally:
            server.terminate()
            server.wait(10)
            asyncio.set_event_loop_policy(None)
    return {
        "mode": mode, "loop": loop, "streams": num_streams, "round_trips": num_round_trips,
        "round_trips_per_s": num_round_trips / elapsed,
        "client_cpu_us_per_round_trip": client_cpu / num_round_trips * 1e6,
        "server_cpu_us_per_round_trip": server_cpu / num_round_trips * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", default="1,16", help="concurrent streams, comma-separated")
    parser.add_argument("--duration-s", type=float, default=3.0)
    parser.add_argument("--modes", default="grpc.aio,framed")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--loop", default="asyncio", help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        run_server(args.serve, args.loop, args.socket)
        return
    loops = ["asyncio", "uvloop"] if HAS_UVLOOP else ["asyncio"]
    print(f"L4M round trips on a Unix socket, echo server in its own process, cpus={len(os.sched_getaffinity(0))}"
          + ("" if HAS_UVLOOP else " (uvloop not installed: asyncio only)"))
    print(f"{'transport':<10} {'loop':<8} {'streams':>7} {'round trips/s':>13} {'client CPU us':>13} {'server CPU us':>13}")
    rows = []
    for num_streams in (int(s) for s in args.streams.split(",")):
        for mode in args.modes.split(","):
            for loop in loops:
                row = measure(mode, loop, num_streams, args.duration_s)
                rows.append(row)
                print(f"{mode:<10} {loop:<8} {num_streams:>7} {row['round_trips_per_s']:>13,.0f} "
                      f"{row['client_cpu_us_per_round_trip']:>13.1f} {row['server_cpu_us_per_round_trip']:>13.1f}",
                      flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
