"""The executor's host work per decode batch: what a batch costs the executor's CPU thread around the model's
kernels (issues #19 and #20).

On a GPU a decode step of SmolLM2 is 1-5 ms of kernels; whatever the executor's thread does in Python per batch
(parse the request, convert it, check every item, lay out the pages, sample on the CPU, build and encode the
reply) adds to every step, and per item. This runs decode batches of B streams through the executor service's
own batch path (`ExecutorServicer._run_batch` on an `ExecuteRequest` parsed from its bytes, the reply encoded
as a frame), on the real model, and times around the kernels:

  convert   parse + `batch_from_pb` (the request's protobuf into the executor's commands)
  prepare   the rest of the batch's host work before and between the kernels: checks, page layouts, tensors,
            the attention plan, the embeddings
  sample    choosing the tokens (`apply_samplers`; on a CPU the greedy kernel, on a GPU device work and a copy)
  reply     `reply_to_pb` and the frame's encoding
  kernels   the model's layers and LM head (`forward_decode`, `logits`), reported apart (`bench/executor.py`
            measures them)

Each row: the median per batch over `--steps` steps (every stream one token per step, greedy; contexts of
`--context` tokens and growing), host = convert + prepare + reply (sample apart), and host per item. CPU only:
the split needs the CPU's decode kernel (`forward_decode`); on a GPU the decode graphs run the step.

    flock -x /tmp/l4m-bench.lock taskset -c 0,1 .venv/bin/python bench/executor_host.py
    .venv/bin/python bench/executor_host.py --batches 16 --steps 20 --context 1000
"""

from __future__ import annotations

import os

from l4m.executor.openmp import default_wait

# The executor service's OpenMP wait, read when torch loads: the first parallel region of each batch wakes
# the other threads as it does there.
os.environ.update(default_wait(os.environ))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import peers  # noqa: E402

from l4m.executor import engine as engine_module  # noqa: E402
from l4m.executor import server  # noqa: E402
from l4m.executor.commands import Allocate, ForwardText, ResourceKind, SamplerKind, SamplerSpec  # noqa: E402
from l4m.executor.engine import Engine, EngineConfig  # noqa: E402
from l4m.executor.server import ExecutorServicer  # noqa: E402
from l4m.executor.weights import LoadedModel, default_model_path, load_model  # noqa: E402
from l4m.v1 import common_pb2, executor_pb2  # noqa: E402
from l4m.wire import frames  # noqa: E402

PAGE_SIZE = 16
PHASES = ("convert", "prepare", "sample", "reply", "kernels")


class Clock:
    """Seconds spent inside the wrapped callables since the last `take`."""

    def __init__(self) -> None:
        self.spent_s = 0.0

    def wrap(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.spent_s += time.perf_counter() - started
        return timed

    def take(self) -> float:
        spent, self.spent_s = self.spent_s, 0.0
        return spent


def request_bytes(correlation_id: int, pages: list[list[int]], totals: list[int], tokens: list[int]) -> bytes:
    """A decode batch as the scheduler sends it: one token per stream at the next position, greedy."""
    greedy = common_pb2.SamplerSpec(kind=common_pb2.SAMPLER_KIND_GREEDY)
    items = []
    for stream_pages, total, token in zip(pages, totals, tokens, strict=True):
        used = stream_pages[: -(-(total + 1) // PAGE_SIZE)]
        items.append(common_pb2.ForwardTextItem(
            kv_page_ids=used, kv_last_page_length=total + 1 - PAGE_SIZE * (len(used) - 1), token_ids=[token],
            position_ids=[total], output_indices=[0], samplers=[greedy]))
    return executor_pb2.ExecuteRequest(correlation_id=correlation_id,
                                       forward_text=executor_pb2.BatchForwardText(items=items)).SerializeToString()


@contextlib.contextmanager
def timed(module: object, name: str, clock: Clock) -> Iterator[None]:
    """`module.name` timed by `clock` while the block runs (the executor's own function, only timed)."""
    function = getattr(module, name)
    setattr(module, name, clock.wrap(function))
    try:
        yield
    finally:
        setattr(module, name, function)


def bench_batch(loaded: LoadedModel, batch: int, context: int, steps: int) -> dict[str, float]:
    """Median seconds per batch of each phase over `steps` decode batches of `batch` streams."""
    pages_per_stream = -(-(context + steps + 1) // PAGE_SIZE)
    engine = Engine(loaded, EngineConfig(page_size=PAGE_SIZE, num_pages=batch * pages_per_stream, num_embed_slots=0))
    engine.allocate([Allocate(ResourceKind.KV_PAGE, tuple(range(batch * pages_per_stream)))])
    pages = [list(range(s * pages_per_stream, (s + 1) * pages_per_stream)) for s in range(batch)]
    greedy = (SamplerSpec(SamplerKind.GREEDY),)
    tokens = []
    for s, prompt in enumerate(peers.make_prompts(batch, context)):  # one at a time: decode batches matter here
        used = tuple(pages[s][: -(-context // PAGE_SIZE)])
        (result,) = engine.forward_text([ForwardText(used, context - PAGE_SIZE * (len(used) - 1), tuple(prompt),
                                                     tuple(range(context)), (), (context - 1,), greedy)])
        tokens.append(result.outputs[0].token_id)
    clocks = {phase: Clock() for phase in ("convert", "reply", "sample", "kernels")}
    model = engine.model
    servicer = ExecutorServicer(engine)
    totals = [context] * batch
    rows: dict[str, list[float]] = {phase: [] for phase in PHASES}
    with (timed(server, "batch_from_pb", clocks["convert"]), timed(server, "reply_to_pb", clocks["reply"]),
          timed(engine_module, "apply_samplers", clocks["sample"]), timed(model, "forward_decode", clocks["kernels"]),
          timed(model, "logits", clocks["kernels"])):
        for step in range(steps):
            payload = request_bytes(step + 1, pages, totals, tokens)
            started = time.perf_counter()
            request = executor_pb2.ExecuteRequest.FromString(payload)
            parsed = time.perf_counter()
            reply = servicer._run_batch(request, servicer._generation)
            ran = time.perf_counter()
            frames.encode(frames.EXECUTED, reply)
            encoded = time.perf_counter()
            if reply is None or reply.WhichOneof("result") != "forward_text":
                raise RuntimeError(f"the executor did not run the decode batch: {reply}")
            spent = {phase: clock.take() for phase, clock in clocks.items()}
            rows["convert"].append(parsed - started + spent["convert"])
            rows["prepare"].append(ran - parsed - sum(spent.values()))
            rows["sample"].append(spent["sample"])
            rows["reply"].append(spent["reply"] + encoded - ran)
            rows["kernels"].append(spent["kernels"])
            tokens = [item.outputs[0].token.token_id for item in reply.forward_text.items]
            totals = [total + 1 for total in totals]
    servicer.close()
    return {phase: statistics.median(values) for phase, values in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,16,64", help="streams per decode batch, comma-separated")
    parser.add_argument("--context", type=int, default=100, help="tokens of context before the first step")
    parser.add_argument("--steps", type=int, default=40, help="decode batches per batch size")
    parser.add_argument("--repeats", type=int, default=1, help="runs per batch size, interleaved; medians shown")
    parser.add_argument("--out", default="bench/results/executor_host.json")
    args = parser.parse_args()
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error(f"--batches: comma-separated integers, not {args.batches!r}")
    if any(b < 1 for b in batches) or args.context < 1 or args.steps < 1 or args.repeats < 1:
        parser.error("--batches, --context, --steps and --repeats must be at least 1")
    loaded = load_model(default_model_path())
    runs: dict[int, list[dict[str, float]]] = {b: [] for b in batches}
    load_before = os.getloadavg()
    for _ in range(args.repeats):
        for b in batches:
            runs[b].append(bench_batch(loaded, b, args.context, args.steps))
    rows = []
    print(f"\nExecutor host work per decode batch (context {args.context}, {args.steps} steps, medians of "
          f"{args.repeats} run(s)); {peers.cpu_model()}, {os.cpu_count()} CPUs\n")
    print("| batch | convert us | prepare us | reply us | host us | host us / item | sample us | kernels ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for b in batches:
        row = {"batch": b, **{phase: statistics.median(run[phase] for run in runs[b]) * 1e6 for phase in PHASES}}
        row["host"] = row["convert"] + row["prepare"] + row["reply"]
        rows.append(row)
        print(f"| {b} | {row['convert']:.0f} | {row['prepare']:.0f} | {row['reply']:.0f} | {row['host']:.0f} | "
              f"{row['host'] / b:.1f} | {row['sample']:.0f} | {row['kernels'] / 1e3:.2f} |")
    load_after = os.getloadavg()
    print(f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "args": vars(args), "cpu": peers.cpu_model(),
                               "load_average": [load_before, load_after]}, indent=1))


if __name__ == "__main__":
    main()
