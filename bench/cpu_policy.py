"""What a waking process costs an executor decoding on the same cores, by the waker's CPU policy.

The executor's decode step runs on every core (torch's OpenMP threads, which meet at a barrier after each
parallel region). A process that wakes on one of those cores and preempts a thread stalls the others at
their next barrier, so its CPU time costs the step more than itself. Controllers, the scheduler and the
spawner wake that way, a few times per decode step. This bench decodes N streams greedily in this
process (the service's OpenMP wait, `l4m.executor.openmp`) while W "wakers" run beside it, each waking
every P ms to burn B ms of CPU time, under SCHED_OTHER (`normal`) or SCHED_BATCH (`batch`, the default
for controllers and `l4m up`'s control plane). Phases are interleaved, `none` (no wakers) first in each
round, and each phase prefills its prompts anew and decodes `--steps` steps.

    flock -x /tmp/l4m-bench.lock taskset -c 0,1 .venv/bin/python bench/cpu_policy.py
    .venv/bin/python bench/cpu_policy.py --batch 64 --wakers 64 --period-ms 100 --burn-ms 0.4

Per policy: the median decode step (median over rounds of each phase's median), the wakers' CPU time per
step (during the decode steps, from /proc's schedstat), and the step's growth over `none` per ms of
the wakers' CPU time ("cost ratio"). With 2 busy cores, CPU time taken from one of them alone would
lengthen the step by about half of it (0.5); a ratio above that is the stall the preemption leaves on
the other core. Writes JSON (--out).
"""

from __future__ import annotations

import os

from l4m.executor.openmp import default_wait

os.environ.update(default_wait(os.environ))  # before torch loads: the service's OpenMP wait

import argparse  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import peers  # noqa: E402

from l4m.executor.commands import Allocate, ForwardText, ResourceKind, SamplerKind, SamplerSpec  # noqa: E402
from l4m.executor.engine import Engine, EngineConfig  # noqa: E402
from l4m.executor.weights import default_model_path, load_model  # noqa: E402

POLICIES = {"normal": os.SCHED_OTHER, "batch": os.SCHED_BATCH}
PAGE_SIZE = 16
# One waker: wakes every `period` s (offset by its index so that they spread over the period) and burns
# `burn` s of its own CPU time, until it is told to stop (SIGTERM).
WAKER = """
import os, signal, sys, time
policy, period, burn, index, count = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), \
    int(sys.argv[5])
os.sched_setscheduler(0, policy, os.sched_param(0))
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
print("ready", flush=True)
time.sleep(period * index / count)
while not stop:
    time.sleep(period)
    until = time.thread_time() + burn
    while time.thread_time() < until:
        pass
"""


class Wakers:
    def __init__(self, policy: int, count: int, period_s: float, burn_s: float) -> None:
        self.processes = [
            subprocess.Popen([sys.executable, "-S", "-c", WAKER, str(policy), str(period_s), str(burn_s), str(i),
                              str(count)], stdout=subprocess.PIPE, text=True)
            for i in range(count)
        ]
        for process in self.processes:
            assert process.stdout is not None and process.stdout.readline().strip() == "ready"

    def cpu_s(self) -> float:
        """The CPU time they have used so far, in all (/proc's schedstat: nanoseconds on a CPU)."""
        return sum(int(Path(f"/proc/{p.pid}/schedstat").read_text().split()[0]) for p in self.processes) / 1e9

    def stop(self) -> None:
        for process in self.processes:
            process.send_signal(signal.SIGTERM)
        for process in self.processes:
            process.communicate(timeout=30)


def phase(engine: Engine, prompts: list[list[int]], pages_per_stream: int, steps: int,
          wakers: Wakers | None) -> dict[str, float]:
    greedy = (SamplerSpec(SamplerKind.GREEDY),)

    def item(stream: int, tokens: list[int], start: int) -> ForwardText:
        end = start + len(tokens)
        first = stream * pages_per_stream
        pages = tuple(range(first, first + -(-end // PAGE_SIZE)))
        return ForwardText(pages, end - PAGE_SIZE * (len(pages) - 1), tuple(tokens), tuple(range(start, end)), (),
                           (len(tokens) - 1,), greedy)

    results = engine.forward_text([item(s, p, 0) for s, p in enumerate(prompts)])
    last = [r.outputs[0].token_id for r in results]
    position = len(prompts[0])
    step_s = []
    cpu_before = wakers.cpu_s() if wakers is not None else 0.0
    started = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        results = engine.forward_text([item(s, [last[s]], position) for s in range(len(prompts))])
        step_s.append(time.perf_counter() - t0)
        last = [r.outputs[0].token_id for r in results]
        position += 1
    wall_s = time.perf_counter() - started
    waker_cpu_s = 0.0
    if wakers is not None:
        waker_cpu_s = wakers.cpu_s() - cpu_before
        wakers.stop()
    return {"step_ms": 1000 * statistics.median(step_s), "wall_s": wall_s, "waker_cpu_s": waker_cpu_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16, help="streams decoded together")
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--steps", type=int, default=60, help="decode steps per phase")
    parser.add_argument("--wakers", type=int, default=16, help="processes waking beside the executor")
    parser.add_argument("--period-ms", type=float, default=40.0, help="each waker wakes this often")
    parser.add_argument("--burn-ms", type=float, default=0.5, help="CPU time each wake-up burns")
    parser.add_argument("--policies", default="normal,batch", help=f"of {', '.join(POLICIES)}")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every phase")
    parser.add_argument("--out", default="cpu_policy.json")
    args = parser.parse_args()
    policies = args.policies.split(",")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        parser.error(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    for name in ("batch", "steps", "wakers", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")

    prompts = peers.make_prompts(args.batch, args.prompt_tokens)
    pages_per_stream = -(-(args.prompt_tokens + args.steps + 1) // PAGE_SIZE)
    num_pages = args.batch * pages_per_stream
    engine = Engine(load_model(default_model_path()),
                    EngineConfig(device="cpu", dtype="float32", page_size=PAGE_SIZE, num_pages=num_pages,
                                 num_embed_slots=0))
    engine.allocate([Allocate(ResourceKind.KV_PAGE, tuple(range(num_pages)))])
    phase(engine, prompts[:1], pages_per_stream, 4, None)  # warm-up

    runs: dict[str, list[dict[str, float]]] = {name: [] for name in ["none", *policies]}
    for r in range(args.rounds):
        for name in runs:
            wakers = None if name == "none" else Wakers(POLICIES[name], args.wakers, args.period_ms / 1000,
                                                      args.burn_ms / 1000)
            runs[name].append(phase(engine, prompts, pages_per_stream, args.steps, wakers))
            print(f"[cpu_policy] round {r + 1}/{args.rounds} {name}: step {runs[name][-1]['step_ms']:.2f} ms",
                  file=sys.stderr, flush=True)

    quiet_ms = statistics.median(run["step_ms"] for run in runs["none"])
    print(f"\n{args.batch} streams; {args.wakers} wakers, each {args.burn_ms} ms of CPU every {args.period_ms} ms; "
          f"{args.steps} steps per phase, {args.rounds} rounds")
    print("| wakers' policy | step ms (per round) | median | wakers' CPU ms per step | step growth ms | cost ratio |")
    print("|---|---|---:|---:|---:|---:|")
    rows = {}
    for name, phases in runs.items():
        step_ms = statistics.median(run["step_ms"] for run in phases)
        cpu_per_step = statistics.median(1000 * run["waker_cpu_s"] / args.steps for run in phases)
        growth = step_ms - quiet_ms
        ratio = growth / cpu_per_step if cpu_per_step > 0 else float("nan")
        rows[name] = {"step_ms": step_ms, "waker_cpu_ms_per_step": cpu_per_step, "growth_ms": growth,
                      "cost_ratio": ratio, "runs": phases}
        per_round = ", ".join(f"{run['step_ms']:.1f}" for run in phases)
        cost = "" if name == "none" else f"{ratio:.2f}"
        print(f"| {name} | {per_round} | {step_ms:.2f} | {cpu_per_step:.2f} | {growth:+.2f} | {cost} |")
    print(f"load average {os.getloadavg()[0]:.2f}; {peers.cpu_model()}")
    Path(args.out).write_text(json.dumps({"args": vars(args), "policies": rows}, indent=2))


if __name__ == "__main__":
    main()
