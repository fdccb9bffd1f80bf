"""A prefill chunk's attention per layer, as `mixed_layers` runs it: the C++ kernel reading K/V from the
pages (`torch.ops.l4m_cpu.group_attention`) against the torch path (the K/V gather + SDPA of
`attention.py`, what `mixed_layers` called before).

    .venv/bin/python bench/group_attention.py                       # chunks 16, 32 at 2,048 and 4,000 slots
    .venv/bin/python bench/group_attention.py --contexts 4000 --chunks 16 --repeats 9

SmolLM2-135M's attention shape (9 query heads over 3 KV heads of 64), pages of 16 slots, one item of
CHUNK new tokens after CONTEXT tokens, causal. Each round runs `--layers` layers, each with a cache of its
own (random values; 30 layers of 4,000 slots are ~180 MB, so K/V come from memory as in the model, not
from a warm cache), and reports the time per layer; the variants are interleaved round by round
(medians shown, every round in the JSON).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from l4m.executor import attention
from l4m.executor.attention import ItemLayout, PaddedGroup
from l4m.executor.cpu_kernels import load_kernels

PAGE_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 9, 3, 64


def kernel(q: torch.Tensor, cache: torch.Tensor, group: PaddedGroup) -> torch.Tensor:
    return torch.ops.l4m_cpu.group_attention(q, cache, group.kv_index, group.mask, NUM_HEADS)


def time_round(fn: Callable[[torch.Tensor], torch.Tensor], caches: list[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for cache in caches:
        fn(cache)
    return (time.perf_counter() - t0) / len(caches)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", default="2048,4000", help="slots before the chunk, comma-separated")
    parser.add_argument("--chunks", default="16,32", help="chunk sizes in tokens, comma-separated")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="JSON of every time")
    args = parser.parse_args()
    load_kernels()
    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {}
    print(f"{torch.get_num_threads()} threads, {args.layers} layers, load {os.getloadavg()[0]:.1f}")
    for context in (int(c) for c in args.contexts.split(",")):
        for chunk in (int(c) for c in args.chunks.split(",")):
            num_pages = -(-(context + chunk) // PAGE_SIZE)
            item = ItemLayout(tuple(range(num_pages)), context, chunk, ())
            plan = attention.build_plan(
                [item], PAGE_SIZE, torch.ones(num_pages, PAGE_SIZE, dtype=torch.bool), torch.float32
            )
            (group,) = plan.groups
            assert isinstance(group, PaddedGroup)
            caches = [
                torch.randn(num_pages, 2, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
                for _ in range(args.layers)
            ]
            q = torch.randn(chunk, NUM_HEADS, HEAD_DIM, generator=gen)
            variants = {
                "torch": functools.partial(attention._padded_attention, q, group=group),
                "kernel": functools.partial(kernel, q.reshape(chunk, -1), group=group),
            }
            for fn in variants.values():  # warm up
                time_round(fn, caches[:2])
            for _ in range(args.repeats):
                for name, fn in variants.items():
                    times.setdefault(f"{context}/{chunk}/{name}", []).append(time_round(fn, caches))
    print(f"load after {os.getloadavg()[0]:.1f}")
    print("| context | chunk | torch ms/layer | kernel ms/layer | torch / kernel |")
    print("|---:|---:|---:|---:|---:|")
    for key in sorted({k.rsplit("/", 1)[0] for k in times}, key=lambda k: tuple(map(int, k.split("/")))):
        med = {name: statistics.median(times[f"{key}/{name}"]) * 1e3 for name in ("torch", "kernel")}
        context, chunk = key.split("/")
        print(
            f"| {int(context):,} | {chunk} | {med['torch']:.2f} | {med['kernel']:.2f} | "
            f"{med['torch'] / med['kernel']:.2f}x |"
        )
    if args.out:
        args.out.write_text(
            json.dumps({"args": vars(args) | {"out": str(args.out)}, "times_s": times}, indent=1)
        )


if __name__ == "__main__":
    main()
