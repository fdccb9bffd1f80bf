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
"""

from __future__ import annotations

import argparse
import json
import os
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--transports", default="grpc,framed", help="grpc, framed or both (comma-separated)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"some of {', '.join(MODES)} (comma-separated)")
    parser.add_argument("--executor-transport", default="framed", choices=["framed", "grpc"],
                        help="how the scheduler sends batches to the simulated executor")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if unknown := sorted(set(modes) - set(MODES)):
        parser.error(f"unknown mode(s) {', '.join(unknown)}; the modes are {', '.join(MODES)}")
    state = Path(tempfile.mkdtemp(prefix="l4m-sdk-bench-"))
    framed_socket = str(state / "scheduler.frames.sock")
    simulated = ["--tokenizer-json", str(write_tokenizer(state)), "--vocab-size", "49152"]
    processes = start_processes(framed_socket, args.executor_transport, simulated)
    addresses = {"grpc": processes.address, "framed": f"framed:{framed_socket}"}
    addresses = {name: addresses[name] for name in args.transports.split(",")}
    scheduler_pid = processes.processes[1].pid
    print(f"SDK decode loop against scheduler + simulated executor processes (batches over "
          f"{args.executor_transport}), cpus={len(os.sched_getaffinity(0))}; CPU ms per generated token")
    print(f"{'mode':<14} {'transport':<9} {'tokens':>7} {'ms wall/token':>13} {'SDK CPU':>16} {'llguidance CPU':>16} "
          f"{'scheduler CPU':>22}")
    rows: list[dict[str, object]] = []
    try:
        # One event loop for every run: grpc.aio keeps the first loop it ran on.
        eventloop.run(run_all(addresses, modes, scheduler_pid, args.tokens, args.repeats, rows))
    finally:
        for process in processes.processes:
            process.terminate()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
