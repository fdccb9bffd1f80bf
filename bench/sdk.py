"""CPU per generated token of the SDK's decode loop and of the scheduler, with no model (issue #19).

One controller (`Context.generate`, Greedy, stop after `--tokens` tokens) in this process, against a
scheduler and a simulated executor (`python -m l4m.scheduler.simulated`, which answers at once, with
SmolLM2's tokenizer and vocabulary) as real processes: what is left of a token's cost is the control
plane's. The modes, interleaved, each over gRPC and over framed sessions (`framed:PATH`, the scheduler's
`--listen-framed`):

  stepwise       `max_continuation_steps=0`, stop on the token count: one round trip per token
  continuation   the SDK's default, up to 9 tokens per round trip
  stop-string    stepwise, plus a stop string that never matches (the SDK decodes the text of every token)
  json-schema    stepwise under `Constraint.json_schema` (an array of integers): a vocabulary mask per token;
                 llguidance's own time (`compute_bitmask`, `consume_token`, `compute_ff_tokens`) is its
                 own column, and the SDK's column is without it

    flock -x /tmp/l4m-bench.lock taskset -c 0,1 .venv/bin/python bench/sdk.py
    .venv/bin/python bench/sdk.py --modes stepwise,json-schema --transports framed --tokens 1000

Beside a real executor the control plane runs in other conditions: its processes sleep through each
forward pass and wake for each token, and on a CPU the executor streams its weights through the caches
meanwhile. `--forward-latency-ms` makes the simulated executor take that long per forward batch, and
`--thrash-mib` runs a process beside the measured ones that reads a buffer of that many MiB over and over
(on the last CPU this process may use), so that the caches hold little of the control plane's memory
when it wakes (docs/benchmarks.md, "Round 8").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from scheduler import start_processes  # noqa: E402 (bench/scheduler.py, beside this file)
from transport import process_cpu_s  # noqa: E402

from l4m import Greedy, eventloop, stop  # noqa: E402
from l4m.constraint import Constraint  # noqa: E402
from l4m.model import Model  # noqa: E402
from l4m.session import Session  # noqa: E402

PROMPT = [5, 6, 7, 8]
MODES = ("stepwise", "continuation", "stop-string", "json-schema")
JSON_SCHEMA = {"type": "array", "items": {"type": "integer"}}  # open-ended: the token count stops it


class TimedMatcher:
    """llguidance's matcher with the CPU time of the calls the SDK makes per token added up."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher
        self.cpu_s = 0.0

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._matcher, name)
        if name not in ("compute_bitmask", "consume_token", "compute_ff_tokens"):
            return attribute

        def timed(*args: Any) -> Any:
            started = time.process_time()
            try:
                return attribute(*args)
            finally:
                self.cpu_s += time.process_time() - started

        return timed


async def generate(address: str, num_tokens: int, mode: str) -> tuple[int, float, float, float]:
    """(tokens, wall s, this process's CPU s, llguidance's CPU s) of one generation, the connection set up
    and the constraint built before the clock starts."""
    session = await Session.connect(address)
    try:
        model = await Model.load(session)
        options: dict[str, Any] = {} if mode == "continuation" else {"max_continuation_steps": 0}
        condition = stop.max_tokens(num_tokens)
        matcher = None
        if mode == "stop-string":
            condition = stop.any_of(condition, stop.on_strings("<never in this text>"))
            _ = model.tokenizer  # built once per controller (~0.15 s): not a per-token cost
        elif mode == "json-schema":
            constraint = Constraint.json_schema(model, JSON_SCHEMA)
            matcher = constraint._matcher = TimedMatcher(constraint._matcher)  # type: ignore[assignment]
            options["constraint"] = constraint
        async with model.new_context() as context:
            context.fill(PROMPT)
            started, cpu_before = time.perf_counter(), time.process_time()
            num_generated = 0
            async for _ in context.generate(Greedy(), stop=condition, **options):
                num_generated += 1
            return (num_generated, time.perf_counter() - started, time.process_time() - cpu_before,
                    matcher.cpu_s if matcher is not None else 0.0)
    finally:
        await session.close()


async def run_all(addresses: dict[str, str], modes: list[str], scheduler_pid: int, num_tokens: int, repeats: int,
                  rows: list[dict[str, object]]) -> None:
    for address in addresses.values():
        for mode in modes:
            await generate(address, 16, mode)  # warm-up: imports, first messages, llguidance's tokenizer
    for _ in range(repeats):
        for mode in modes:
            for transport, address in addresses.items():
                scheduler_before = process_cpu_s(scheduler_pid)
                num_generated, wall_s, cpu_s, guidance_s = await generate(address, num_tokens, mode)
                scheduler_cpu_s = process_cpu_s(scheduler_pid) - scheduler_before
                row = {"mode": mode, "transport": transport, "tokens": num_generated,
                       "wall_ms_per_token": wall_s / num_generated * 1e3,
                       "sdk_cpu_ms_per_token": (cpu_s - guidance_s) / num_generated * 1e3,
                       "llguidance_cpu_ms_per_token": guidance_s / num_generated * 1e3,
                       "scheduler_cpu_ms_per_token": scheduler_cpu_s / num_generated * 1e3}
                rows.append(row)
                print(f"{mode:<14} {transport:<9} {num_generated:>7} {row['wall_ms_per_token']:>13.3f} "
                      f"{row['sdk_cpu_ms_per_token']:>16.3f} {row['llguidance_cpu_ms_per_token']:>16.3f} "
                      f"{row['scheduler_cpu_ms_per_token']:>22.3f}", flush=True)


def write_tokenizer(state: Path) -> Path:
    """SmolLM2's tokenizer (the embedded model's GGUF) as a `tokenizers` JSON file, for the simulated executor."""
    from l4m.executor.gguf_file import read_gguf
    from l4m.executor.tokenizer import tokenizer_from_gguf
    from l4m.executor.weights import default_model_path

    path = state / "tokenizer.json"
    path.write_text(tokenizer_from_gguf(read_gguf(default_model_path()).fields).to_json())
    return path


THRASHER = """
import os, sys
os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
buffer = bytearray(int(sys.argv[1]) << 20)
while True:
    buffer.count(1)  # reads all of it: what the caches held of anyone else is gone
"""


def start_thrasher(mib: int) -> subprocess.Popen[bytes]:
    """A process that reads `mib` MiB over and over until terminated, as an executor streams its weights."""
    return subprocess.Popen([sys.executable, "-c", THRASHER, str(mib)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--transports", default="grpc,framed", help="grpc, framed or both (comma-separated)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"some of {', '.join(MODES)} (comma-separated)")
    parser.add_argument("--executor-transport", default="framed", choices=["framed", "grpc"],
                        help="how the scheduler sends batches to the simulated executor")
    parser.add_argument("--forward-latency-ms", type=float, default=0.0,
                        help="the simulated executor's time per forward batch (default: it answers at once)")
    parser.add_argument("--thrash-mib", type=int, default=0,
                        help="a process beside the measured ones reads a buffer of this many MiB over and over")
    args = parser.parse_args()
    if args.forward_latency_ms < 0 or args.thrash_mib < 0:
        parser.error("--forward-latency-ms and --thrash-mib must be at least 0")
    modes = args.modes.split(",")
    if unknown := sorted(set(modes) - set(MODES)):
        parser.error(f"unknown mode(s) {', '.join(unknown)}; the modes are {', '.join(MODES)}")
    state = Path(tempfile.mkdtemp(prefix="l4m-sdk-bench-"))
    framed_socket = str(state / "scheduler.frames.sock")
    simulated = ["--tokenizer-json", str(write_tokenizer(state)), "--vocab-size", "49152",
                 "--forward-latency-ms", str(args.forward_latency_ms)]
    processes = start_processes(framed_socket, args.executor_transport, simulated)
    if args.thrash_mib:
        processes.processes.append(start_thrasher(args.thrash_mib))
    addresses = {"grpc": processes.address, "framed": f"framed:{framed_socket}"}
    addresses = {name: addresses[name] for name in args.transports.split(",")}
    scheduler_pid = processes.processes[1].pid
    print(f"SDK decode loop against scheduler + simulated executor processes (batches over "
          f"{args.executor_transport}), cpus={len(os.sched_getaffinity(0))}; CPU ms per generated token"
          + (f"; forward batches of {args.forward_latency_ms:g} ms" if args.forward_latency_ms else "")
          + (f"; a {args.thrash_mib} MiB cache thrasher beside it" if args.thrash_mib else ""))
    print(f"{'mode':<14} {'transport':<9} {'tokens':>7} {'ms wall/token':>13} {'SDK CPU':>16} {'llguidance CPU':>16} "
          f"{'scheduler CPU':>22}")
    rows: list[dict[str, object]] = []
    try:
        # One event loop for every run: grpc.aio keeps the first loop it ran on.
        eventloop.run(run_all(addresses, modes, scheduler_pid, args.tokens, args.repeats, rows))
    finally:
        for process in processes.processes:
            process.terminate()
        for process in processes.processes:
            process.wait(timeout=30)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows, "forward_latency_ms": args.forward_latency_ms,
                                        "thrash_mib": args.thrash_mib}, indent=1))


if __name__ == "__main__":
    main()
