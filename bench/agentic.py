"""Agentic workloads through the whole l4m stack, where keeping KV state next to the model should win:

  (a) branches: 8 branches of 32 tokens from one 512-token prefix (bench/controllers/branches.py):
      fork + shared pages vs recomputing the prefix in every branch;
  (b) agent: a loop with 4 tool calls whose results (128 tokens each) are appended to a 512-token
      conversation, 32 generated tokens per turn (bench/controllers/agent.py): keep the KV vs re-send
      the whole conversation each turn (a fresh context and a full prefill, as over an HTTP API).

    .venv/bin/python bench/agentic.py                          # both, 3 repeats each, interleaved
    .venv/bin/python bench/agentic.py --workloads branches --repeats 1 --branch-tokens 8

Token ids are random (token-exact, seeded). Wall time is measured inside the controller (its `main`,
sandbox start-up excluded) and by the user (launch to exit); speed-ups compare medians of the controller
times. Both variants decode greedily over the same token sequences, so their tokens must be the same:
the table says whether they are. Starts its own cluster (like `l4m up`: --state-dir, ports).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path

import peers
from e2e import LIMITS, stack_config

from l4m.client import Client
from l4m.cluster import Cluster
from l4m.v1 import spawner_pb2

CONTROLLERS = Path(__file__).resolve().parent / "controllers"
WORKLOADS = {  # name -> (program, baseline mode, stateful mode)
    "branches": ("branches.py", "recompute", "fork"),
    "agent": ("agent.py", "resend", "keep"),
}
TARGET_SPEEDUP = {"branches": 4.0, "agent": 2.0}  # issue #8


def random_ids(rng: random.Random, num_tokens: int) -> str:
    return ",".join(str(rng.randrange(100, 40000)) for _ in range(num_tokens))


def workload_args(name: str, args: argparse.Namespace) -> list[str]:
    """The controller's arguments after MODE (the same for both modes)."""
    rng = random.Random(args.seed)
    prefix = random_ids(rng, args.prefix_tokens)
    if name == "branches":
        suffixes = ";".join(random_ids(rng, args.suffix_tokens) for _ in range(args.branches))
        return [prefix, suffixes, str(args.branch_tokens)]
    observations = ";".join(random_ids(rng, args.observation_tokens) for _ in range(args.tool_calls))
    return [prefix, observations, str(args.turn_tokens)]


async def run_controller(client: Client, program: str, args: list[str]) -> dict[str, object]:
    """Launch, wait for the exit; the controller's JSON report plus the user-side wall time."""
    started = time.perf_counter()
    instance_id = await client.launch(program, args, LIMITS)
    report = None
    async for event in client.attach(instance_id):
        kind = event.WhichOneof("event")
        if kind == "message":
            report = json.loads(event.message.text)
        elif kind == "exit" and (event.exit.reason != spawner_pb2.EXIT_REASON_EXITED or event.exit.exit_code):
            reason = spawner_pb2.ExitReason.Name(event.exit.reason)
            raise RuntimeError(f"{program[:12]} ended {reason} ({event.exit.exit_code}): {event.exit.message}")
    if report is None:
        raise RuntimeError(f"controller {instance_id} exited without a report")
    return {**report, "user_wall_s": time.perf_counter() - started}


async def bench(args: argparse.Namespace) -> list[dict[str, object]]:
    config = stack_config(args)
    cluster = Cluster(config, say=lambda line: print(line, flush=True))
    rows = []
    try:
        await cluster.start()
        async with Client(config.spawner_address, api_key=config.admin_key() or None) as client:
            for name in args.workloads.split(","):
                program_file, baseline, stateful = WORKLOADS[name]
                program = await client.upload_file(CONTROLLERS / program_file)
                common = workload_args(name, args)
                await run_controller(client, program, [stateful, *common])  # warm-up
                runs: dict[str, list[dict[str, object]]] = {baseline: [], stateful: []}
                for repeat in range(args.repeats):
                    for mode in (baseline, stateful) if repeat % 2 == 0 else (stateful, baseline):
                        report = await run_controller(client, program, [mode, *common])
                        runs[mode].append(report)
                        print(f"[agentic] {name} {mode}: {report['wall_s']:.2f} s in the controller, "
                              f"{report['user_wall_s']:.2f} s launch to exit, "
                              f"{report['num_forward_tokens']} tokens fed", flush=True)
                rows.append(summarize(name, baseline, stateful, runs))
    finally:
        await cluster.stop()
    return rows


def summarize(name: str, baseline: str, stateful: str, runs: dict[str, list[dict[str, object]]]) -> dict:
    def median(mode: str, key: str) -> float:
        return statistics.median(float(r[key]) for r in runs[mode])

    tokens = {mode: [r["token_ids"] for r in reports] for mode, reports in runs.items()}
    return {
        "workload": name, "baseline": baseline, "stateful": stateful,
        "baseline_wall_s": median(baseline, "wall_s"), "stateful_wall_s": median(stateful, "wall_s"),
        "baseline_user_wall_s": median(baseline, "user_wall_s"),
        "stateful_user_wall_s": median(stateful, "user_wall_s"),
        "speedup": median(baseline, "wall_s") / median(stateful, "wall_s"),
        "speedup_user": median(baseline, "user_wall_s") / median(stateful, "user_wall_s"),
        "target_speedup": TARGET_SPEEDUP[name],
        "baseline_tokens_fed": runs[baseline][0]["num_forward_tokens"],
        "stateful_tokens_fed": runs[stateful][0]["num_forward_tokens"],
        "same_tokens": all(t == tokens[baseline][0] for t in tokens[baseline] + tokens[stateful]),
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="branches,agent")
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant, interleaved; medians")
    parser.add_argument("--prefix-tokens", type=int, default=512, help="shared prefix / conversation start")
    parser.add_argument("--branches", type=int, default=8)
    parser.add_argument("--branch-tokens", type=int, default=32)
    parser.add_argument("--suffix-tokens", type=int, default=4, help="each branch's own instruction")
    parser.add_argument("--tool-calls", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=32, help="generated per agent turn")
    parser.add_argument("--observation-tokens", type=int, default=128, help="each tool result")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--state-dir", default="/tmp/l4m-agentic")
    parser.add_argument("--spawner-port", type=int, default=7520)
    parser.add_argument("--scheduler-port", type=int, default=7521)
    parser.add_argument("--metrics-port-base", type=int, default=9520)
    parser.add_argument("--batching", default="adaptive", help="the l4m scheduler's forward-batch strategy")
    parser.add_argument("--session-transport", default="framed", choices=["framed", "grpc"],
                        help="how the controllers speak L4M (`l4m up --session-transport`)")
    parser.add_argument("--executor-transport", default="framed", choices=["framed", "grpc"],
                        help="how the scheduler sends batches (`l4m up --executor-transport`)")
    parser.add_argument("--warm-pool-size", type=int, default=None, help="the spawner's warm sandboxes (default: its own)")
    parser.add_argument("--out", default="bench/results/agentic.json")
    args = parser.parse_args()
    unknown = set(args.workloads.split(",")) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads {sorted(unknown)}; known: {', '.join(WORKLOADS)}")
    sizes = (args.repeats, args.prefix_tokens, args.branches, args.branch_tokens, args.suffix_tokens,
             args.tool_calls, args.turn_tokens, args.observation_tokens)
    if min(sizes) < 1:
        parser.error("--repeats and every token or count flag must be at least 1")
    load_before = os.getloadavg()
    rows = asyncio.run(bench(args))
    load_after = os.getloadavg()
    print("\n| workload | baseline s | stateful s | speed-up | target | tokens fed (baseline / stateful) "
          "| same tokens |\n|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['workload']} ({r['baseline']} vs {r['stateful']}) | {r['baseline_wall_s']:.2f} | "
              f"{r['stateful_wall_s']:.2f} | {r['speedup']:.2f}x | {r['target_speedup']:.0f}x | "
              f"{r['baseline_tokens_fed']} / {r['stateful_tokens_fed']} | {'yes' if r['same_tokens'] else 'NO'} |")
    print(f"controller wall times, medians of {args.repeats}; load average {load_before[0]:.2f} before, "
          f"{load_after[0]:.2f} after; {peers.cpu_model()}, {os.cpu_count()} CPUs")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "load_average": [load_before, load_after],
                                          "cpu": peers.cpu_model(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
