"""What a prefill chunk costs beside decode steps, as the scheduler's `--prefill-chunk-token-slots` wants it.

    .venv/bin/python bench/chunk_slots.py                          # chunk 32 at contexts 256 and 3072
    .venv/bin/python bench/chunk_slots.py --chunk 16 --contexts 256,2048 --repeats 7

On the executor's engine with its defaults (as `bench/mixed_batch.py`, whose workload it reuses):
`--decode-items` streams at 100-500 tokens of context take one decode step (**steps**), then the same
steps beside a chunk of a long prompt (**mixed**): `--chunk` tokens at each of two contexts, and half
as many at the first, interleaved over `--repeats`. The chunk's extra time over the steps alone is
fitted to the scheduler's model of a chunk's cost (`l4m.scheduler.prefill.chunk_cost`) plus a constant:
t tokens after c slots add k + a * t + b * (t * c + t(t+1)/2), k per mixed batch (its plan, the
group's attention call), a per token, b per slot a token reads. Then

- L = a / b, the context slots that cost as much as one token's own work: `--prefill-chunk-token-slots`;
- for a target ratio R (`--ratio`, 2: "a stream's inter-token gap at most R times its step"), the chunk
  T whose extra time at no context stays within (R - 1) x the steps less `--headroom`:
  `--prefill-chunk-tokens` (every later chunk then costs about the same, by the scheduler's sizing).

The fitted figures hold for this host, this model and this many decode streams: an executor with more
streams has a longer step and so room for a larger T.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
from mixed_batch import PAGE_SIZE, Workload, time_batch

from l4m.executor.engine import Engine, EngineConfig
from l4m.executor.weights import default_model_path, load_model
from l4m.scheduler.prefill import chunk_cost


def fit(chunk: int, contexts: tuple[int, int], extra_s: tuple[float, float, float]) -> tuple[float, float, float]:
    """(k, a, b): seconds per mixed batch, per chunk token and per slot a chunk token reads, from the extra
    time of `chunk` tokens at both contexts and of `chunk // 2` at the first:
    extra = k + a * t + b * chunk_cost(t, c, 0)."""
    (c1, c2), (e1, e2, e_half) = contexts, extra_s
    half = chunk // 2
    b = (e2 - e1) / (chunk_cost(chunk, c2, 0) - chunk_cost(chunk, c1, 0))
    # The two sizes at c1: (e1 - e_half) = a (chunk - half) + b (their slots' difference).
    a = (e1 - e_half - b * (chunk_cost(chunk, c1, 0) - chunk_cost(half, c1, 0))) / (chunk - half)
    k = e1 - a * chunk - b * chunk_cost(chunk, c1, 0)
    return k, a, b


def best_chunk(k: float, a: float, b: float, room_s: float, most: int) -> int:
    """The most tokens (1 .. most) a chunk at no context may carry with its extra time within `room_s`."""
    for size in range(most, 0, -1):
        if k + a * size + b * chunk_cost(size, 0, 0) <= room_s:
            return size
    return 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunk", type=int, default=32, help="tokens of the timed chunk")
    parser.add_argument("--contexts", default="256,3072", help="the two contexts of the chunk, in tokens")
    parser.add_argument("--decode-items", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--ratio", type=float, default=2.0, help="the inter-token gap a chunk may cause, in steps")
    parser.add_argument("--headroom", type=float, default=0.2,
                        help="the share of the room left for the rest of the round trip and the machine's noise")
    parser.add_argument("--max-rows", type=int, default=0,
                        help="the executor's max_quantized_rows: decode steps + chunk tokens that keep the fused path "
                             "(0: the executor's own, as it resolves it on this CPU)")
    parser.add_argument("--out", type=Path, default=None, help="JSON of every time")
    args = parser.parse_args()
    try:
        c1, c2 = (int(c) for c in args.contexts.split(","))
    except ValueError:
        parser.error(f"--contexts takes two comma-separated token counts, got {args.contexts!r}")
    if not 0 <= c1 < c2 or args.chunk < 2 or args.repeats < 1 or args.ratio <= 1 or not 0 <= args.headroom < 1:
        parser.error("need 0 <= first context < second, --chunk >= 2, --repeats >= 1, --ratio > 1, 0 <= --headroom < 1")
    gen = torch.Generator().manual_seed(1)
    contexts = torch.randint(100, 501, (args.decode_items,), generator=gen).tolist()
    loaded = load_model(default_model_path())
    engine = Engine(loaded, EngineConfig(page_size=PAGE_SIZE, num_pages=Workload.num_pages(c2, args.chunk, contexts),
                                         num_embed_slots=0))
    work = Workload(engine, c2, args.chunk, contexts)
    work.fill()
    print(f"weights {engine.weights}, {torch.get_num_threads()} threads, {args.decode_items} decode items "
          f"(context {min(contexts)}-{max(contexts)}), chunk {args.chunk} at contexts {c1} and {c2}, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    half = args.chunk // 2
    batches = {"steps": (0, 0), f"{args.chunk}@{c1}": (args.chunk, c1), f"{args.chunk}@{c2}": (args.chunk, c2),
               f"{half}@{c1}": (half, c1)}
    times: dict[str, list[float]] = {name: [] for name in batches}
    for repeat in range(args.warmup + args.repeats):
        for name, (size, start) in batches.items():
            items = work.steps()
            if size:
                items = [work.chunk(size, start), *items]
            elapsed = time_batch(engine, items, "ragged")
            if repeat >= args.warmup:
                times[name].append(elapsed)
    medians = {name: statistics.median(values) for name, values in times.items()}
    steps = medians["steps"]
    extra = tuple(medians[name] - steps for name in list(batches)[1:])
    k, a, b = fit(args.chunk, (c1, c2), extra)  # type: ignore[arg-type]
    print(f"load after {os.getloadavg()[0]:.1f}")
    print("| batch (chunk tokens @ context) | median ms | extra over the steps ms |\n|---|---:|---:|")
    for name, value in medians.items():
        print(f"| {name} | {1e3 * value:.1f} | {'' if name == 'steps' else f'{1e3 * (value - steps):.1f}'} |")
    if b <= 0 or a <= 0:
        print("the fit is not usable (the chunk cost less deeper in, or nothing per token): rerun quieter or with "
              "contexts further apart")
        return
    token_slots = round(a / b)
    room = (args.ratio - 1) * steps * (1 - args.headroom)
    max_rows = args.max_rows or engine.max_quantized_rows
    chunk_tokens = best_chunk(k, a, b, room, max(1, max_rows - args.decode_items))
    print(f"per mixed batch {1e3 * k:.2f} ms, per chunk token {1e3 * a:.3f} ms, per slot it reads {1e6 * b:.3f} us: "
          f"--prefill-chunk-token-slots {token_slots}")
    print(f"a gap within {args.ratio:g}x the {1e3 * steps:.1f} ms step ({1e3 * room:.1f} ms for the chunk after "
          f"{100 * args.headroom:.0f} % headroom): --prefill-chunk-tokens {chunk_tokens}")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "times_s": times,
                                        "seconds_per_batch": k, "seconds_per_token": a, "seconds_per_slot": b, "token_slots": token_slots,
                                        "chunk_tokens": chunk_tokens}, indent=1))


if __name__ == "__main__":
    main()
