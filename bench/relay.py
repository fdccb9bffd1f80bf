"""What relaying a controller's messages to its user costs (issue #19: the spawner's CPU per streamed
message): `ctx.send` in the controller (RuntimeService.SendToUser over the spawner's runtime socket), the
spawner, and the user's `Attach` stream, on a cluster started like `l4m up`.

N controllers (`bench/controllers/relay.py`) each send `--messages` messages of `--bytes` bytes, one after
the other, while this process attaches to every one and counts what arrives. CPU per message: the
spawner's process time (from /proc) over every message relayed, the controllers' own (each reports its
process time over its sends), and this process's (the user side: N Attach streams). The spawner's share of
launching the N controllers (measured by the same launches sending no messages, just before) is taken off
and printed apart.

Modes (`--modes`, each a cluster of its own, interleaved over `--repeats`): TRANSPORT/ATTACH, where
TRANSPORT is how controllers send (`framed`: frames on /run/l4m/runtime.frames.sock, the default since
issue #19; `grpc`: one RuntimeService.SendToUser call per message, `l4m up --session-transport grpc`) and
ATTACH how the user's Attach stream carries them (`batched`: the events ready together in one response,
`AttachRequest.batch_events`, what `l4m.client` asks for; `single`: one response per event).

    flock -x /tmp/l4m-bench.lock taskset -c 0,1 .venv/bin/python bench/relay.py
    .venv/bin/python bench/relay.py --streams 1,16 --messages 2000 --bytes 24 --modes framed/batched,grpc/single
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


from l4m.client import Client  # noqa: E402
from l4m.cluster import Cluster, ClusterConfig  # noqa: E402
from l4m.spawner.cpu_priority import descendants, thread_schedstat_ns  # noqa: E402
from l4m.v1 import spawner_pb2  # noqa: E402

CONTROLLER = Path(__file__).parent / "controllers" / "relay.py"
LIMITS = spawner_pb2.Limits(wall_time_ms=600_000, cpu_time_ms=300_000)


def spawner_pid() -> int:
    for pid in descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"l4m.spawner" in f.read():
                    return pid
        except OSError:
            continue
    raise RuntimeError("no spawner process under this one")


async def relay(client: Client, program: str, num_messages: int, num_bytes: int, batch_events: bool
                ) -> dict[str, float]:
    """One controller: (messages received, the controller's CPU s over its sends)."""
    instance_id = await client.launch(program, [str(num_messages), str(num_bytes)], LIMITS)
    received, report = 0, None
    async for event in client.attach(instance_id, batch_events):
        kind = event.WhichOneof("event")
        if kind == "message":
            if event.message.text.startswith("{"):
                report = json.loads(event.message.text)
            else:
                received += 1
        elif kind == "exit" and (event.exit.reason != spawner_pb2.EXIT_REASON_EXITED or event.exit.exit_code):
            raise RuntimeError(f"controller {instance_id} ended {spawner_pb2.ExitReason.Name(event.exit.reason)}: "
                               f"{event.exit.message}")
    if report is None or received != num_messages:
        raise RuntimeError(f"controller {instance_id}: {received} of {num_messages} messages, report {report}")
    return {"received": received, "controller_cpu_s": report["cpu_s"]}


def threads_cpu_s(pid: int) -> float:
    """CPU seconds of a process's live threads, to the nanosecond (their /proc schedstat): its stat's
    utime + stime count whole 10 ms ticks, and two launches may cost the spawner less than one."""
    return sum(thread_schedstat_ns([pid], 0).values()) / 1e9


async def measure(client: Client, program: str, pid: int, num_streams: int, num_messages: int,
                  num_bytes: int, batch_events: bool) -> dict[str, float]:
    spawner_before, own_before = threads_cpu_s(pid), time.process_time()
    started = time.perf_counter()
    results = await asyncio.gather(*(relay(client, program, num_messages, num_bytes, batch_events)
                                     for _ in range(num_streams)))
    elapsed = time.perf_counter() - started
    total = max(sum(r["received"] for r in results), 1)  # (a launch with no messages: per launch)
    return {
        "streams": num_streams, "messages": total, "messages_per_s": total / elapsed,
        "spawner_cpu_us_per_message": (threads_cpu_s(pid) - spawner_before) / total * 1e6,
        "controller_cpu_us_per_message": sum(r["controller_cpu_s"] for r in results) / total * 1e6,
        "user_cpu_us_per_message": (time.process_time() - own_before) / total * 1e6,
    }


async def bench_mode(args: argparse.Namespace, mode: str) -> list[dict[str, float]]:
    """Every `--streams` count on a cluster of its own, started for `mode`."""
    transport, attach = mode.split("/")
    batch_events = attach == "batched"
    config = ClusterConfig(state_dir=Path(args.state_dir), spawner_port=args.spawner_port, gateway_port=-1,
                           scheduler_port=args.scheduler_port, metrics_port_base=0, echo_logs=False,
                           session_transport=transport, models=(args.model,) if args.model else ())
    cluster = Cluster(config, say=lambda line: None)
    rows = []
    try:
        await cluster.start()
        pid = spawner_pid()
        async with Client(config.spawner_address, api_key=config.admin_key() or None) as client:
            program = await client.upload_file(CONTROLLER)
            await relay(client, program, 10, args.bytes, batch_events)  # warm-up
            for num_streams in (int(n) for n in args.streams.split(",")):
                # Launches cost the spawner too: the same launches sending nothing but their report,
                # measured just before, are taken off its CPU.
                launches = await measure(client, program, pid, num_streams, 0, args.bytes, batch_events)
                row = await measure(client, program, pid, num_streams, args.messages, args.bytes, batch_events)
                launch_cpu_us = launches["spawner_cpu_us_per_message"] * launches["messages"]
                row["spawner_cpu_us_per_message"] -= launch_cpu_us / row["messages"]
                row["spawner_launch_cpu_ms"] = launch_cpu_us / num_streams / 1000
                row["mode"] = mode  # type: ignore[assignment]
                rows.append(row)
                print(f"{mode:<15} {row['streams']:>7} {row['messages']:>9} {row['messages_per_s']:>12,.0f} "
                      f"{row['spawner_cpu_us_per_message']:>12.1f} {row['controller_cpu_us_per_message']:>15.1f} "
                      f"{row['user_cpu_us_per_message']:>9.1f} {row['spawner_launch_cpu_ms']:>22.1f}", flush=True)
    finally:
        await cluster.stop()
    return rows


async def bench(args: argparse.Namespace) -> list[dict[str, float]]:
    rows = []
    for _ in range(args.repeats):
        for mode in args.modes.split(","):
            rows += await bench_mode(args, mode)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", default="1,16", help="concurrent controllers, comma-separated")
    parser.add_argument("--messages", type=int, default=2000, help="messages per controller")
    parser.add_argument("--bytes", type=int, default=24, help="bytes per message (a token's text and framing)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over the modes, interleaved")
    parser.add_argument("--modes", default="framed/batched",
                        help="TRANSPORT/ATTACH, comma-separated: framed or grpc / batched or single")
    parser.add_argument("--state-dir", default="/tmp/l4m-relay-bench")
    parser.add_argument("--spawner-port", type=int, default=7610)
    parser.add_argument("--scheduler-port", type=int, default=7611)
    parser.add_argument("--model", default="", help="what the cluster's executor serves (`l4m up --model`; default "
                        "SmolLM2): the relay never uses it, a tiny one just starts sooner")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()
    try:
        streams = [int(n) for n in args.streams.split(",")]
    except ValueError:
        parser.error("--streams must be comma-separated integers")
    if min(streams) < 1 or args.messages < 1 or args.bytes < 1 or args.repeats < 1:
        parser.error("--streams, --messages, --bytes and --repeats must be at least 1")
    known = {f"{t}/{a}" for t in ("framed", "grpc") for a in ("batched", "single")}
    unknown = [mode for mode in args.modes.split(",") if mode not in known]
    if unknown:
        parser.error(f"unknown modes {unknown}; known: {', '.join(sorted(known))}")
    print(f"relay of controller messages to attached users, cpus={len(os.sched_getaffinity(0))}; CPU µs per message")
    print(f"{'mode':<15} {'streams':>7} {'messages':>9} {'messages/s':>12} {'spawner CPU':>12} {'controller CPU':>15} "
          f"{'user CPU':>9} {'spawner ms per launch':>22}")
    rows = asyncio.run(bench(args))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
