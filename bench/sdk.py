"""CPU per generated token of the SDK's decode loop and of the scheduler, with no model (issue #19).

One controller (`Context.generate`, Greedy, stop after `--tokens` tokens) in this process, against a
scheduler and a simulated executor (`python -m l4m.scheduler.simulated`, which answers at once) as real
processes over gRPC: what is left of a token's cost is the control plane's. Stepwise
(`max_continuation_steps=0`, one round trip per token: what constraints, custom stops and tool parsing
need) and with continuation (the SDK's default, up to 9 tokens per round trip), over gRPC and over framed
sessions (`framed:PATH`, the scheduler's `--listen-framed`), interleaved.

    flock -x /tmp/l4m-bench.lock taskset -c 0,1 .venv/bin/python bench/sdk.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from scheduler import start_processes  # noqa: E402 (bench/scheduler.py, beside this file)
from transport import process_cpu_s  # noqa: E402

from l4m import Greedy, stop  # noqa: E402
from l4m.model import Model  # noqa: E402
from l4m.session import Session  # noqa: E402

PROMPT = [5, 6, 7, 8]


async def generate(address: str, num_tokens: int, max_continuation_steps: int | None) -> tuple[int, float, float]:
    """(tokens, wall s, this process's CPU s) of one generation, the connection set up before the clock starts."""
    session = await Session.connect(address)
    try:
        model = await Model.load(session)
        steps = {} if max_continuation_steps is None else {"max_continuation_steps": max_continuation_steps}
        async with model.new_context() as context:
            context.fill(PROMPT)
            started, cpu_before = time.perf_counter(), time.process_time()
            num_generated = 0
            async for _ in context.generate(Greedy(), stop=stop.max_tokens(num_tokens), **steps):
                num_generated += 1
            return num_generated, time.perf_counter() - started, time.process_time() - cpu_before
    finally:
        await session.close()


async def run_all(addresses: dict[str, str], scheduler_pid: int, num_tokens: int, repeats: int,
                  rows: list[dict[str, object]]) -> None:
    for address in addresses.values():
        await generate(address, 16, 0)  # warm-up: imports, first messages
    for _ in range(repeats):
        for mode, steps in (("stepwise", 0), ("continuation", None)):
            for transport, address in addresses.items():
                scheduler_before = process_cpu_s(scheduler_pid)
                num_generated, wall_s, cpu_s = await generate(address, num_tokens, steps)
                scheduler_cpu_s = process_cpu_s(scheduler_pid) - scheduler_before
                row = {"mode": mode, "transport": transport, "tokens": num_generated,
                       "wall_ms_per_token": wall_s / num_generated * 1e3,
                       "sdk_cpu_ms_per_token": cpu_s / num_generated * 1e3,
                       "scheduler_cpu_ms_per_token": scheduler_cpu_s / num_generated * 1e3}
                rows.append(row)
                print(f"{mode:<14} {transport:<9} {num_generated:>7} {row['wall_ms_per_token']:>13.3f} "
                      f"{row['sdk_cpu_ms_per_token']:>16.3f} {row['scheduler_cpu_ms_per_token']:>22.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--transports", default="grpc,framed", help="grpc, framed or both (comma-separated)")
    args = parser.parse_args()
    state = Path(tempfile.mkdtemp(prefix="l4m-sdk-bench-"))
    framed_socket = str(state / "scheduler.frames.sock")
    processes = start_processes(framed_socket)
    addresses = {"grpc": processes.address, "framed": f"framed:{framed_socket}"}
    addresses = {name: addresses[name] for name in args.transports.split(",")}
    scheduler_pid = processes.processes[1].pid
    print(f"SDK decode loop against scheduler + simulated executor processes, cpus={len(os.sched_getaffinity(0))}")
    print(f"{'mode':<14} {'transport':<9} {'tokens':>7} {'ms wall/token':>13} {'SDK CPU ms/token':>16} {'scheduler CPU ms/token':>22}")
    rows: list[dict[str, object]] = []
    try:
        # One event loop for every run: grpc.aio keeps the first loop it ran on.
        asyncio.run(run_all(addresses, scheduler_pid, args.tokens, args.repeats, rows))
    finally:
        for process in processes.processes:
            process.terminate()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
