"""One mixed forward batch on the real model: a prefill chunk beside decode steps, padded against ragged.

    .venv/bin/python bench/mixed_batch.py                                  # chunk 2048 beside 16 steps
    .venv/bin/python bench/mixed_batch.py --chunks 2048,256,64,32 --chunk-context 2048 --repeats 3

The executor's engine with its defaults (pages of 16 slots; on a CPU with AVX2 the GGUF's blocks and
the C++ kernels). `--decode-items` streams hold 100-500 tokens each (random, seeded); a long prompt
holds `--chunk-context` tokens and sends its next `CHUNK` tokens beside one decode step of every stream,
in one forward_text batch (what the scheduler's chunked prefill makes). Timed per batch, wall clock:
- **steps**: the decode steps alone (the decode kernel's batch, the streams' step between chunks),
- **chunk**: the chunk alone,
- **ragged** / **padded**: the mixed batch, attended in groups (`attention.CALL_COST_PAIRS` as shipped)
  or as one padded call (`CALL_COST_PAIRS = inf`, the path before ragged groups),
- **unfused**: the mixed batch in groups on per-op torch (`decode_kernel` off: the decode steps attend on
  the `decode_attention` kernel, layer by layer), where ragged runs it as one `mixed_layers` call
  (batches of up to the engine's `max_quantized_rows` tokens: 64 on AVX2, all a batch holds on AVX-512 BF16),
interleaved over `--repeats` after `--warmup` untimed rounds (medians shown; every time in the JSON). Every batch re-runs the same
tokens into the same slots, so each repeat does the same work. The mixed batch's step / steps ratio
is what a stream's inter-token latency grows by while a chunk runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import torch

from l4m.executor import attention
from l4m.executor.commands import Allocate, ForwardText, ResourceKind, SamplerKind, SamplerSpec
from l4m.executor.engine import Engine, EngineConfig
from l4m.executor.weights import default_model_path, load_model

GREEDY = SamplerSpec(SamplerKind.GREEDY)
PAGE_SIZE = 16
MODES = ("steps", "chunk", "ragged", "unfused", "padded")


class Workload:
    """The long prompt's pages (0 ..) and each stream's, and the items of one batch."""

    def __init__(self, engine: Engine, chunk_context: int, max_chunk: int, contexts: list[int]) -> None:
        self.engine = engine
        self.chunk_context = chunk_context
        self.contexts = contexts
        gen = torch.Generator().manual_seed(0)
        self.long_tokens = torch.randint(100, 40000, (chunk_context + max_chunk,), generator=gen).tolist()
        self.stream_tokens = [torch.randint(100, 40000, (c + 1,), generator=gen).tolist() for c in contexts]
        self.pages: list[list[int]] = []
        first = 0
        for total in [chunk_context + max_chunk, *(c + 1 for c in contexts)]:
            count = -(-total // PAGE_SIZE)
            self.pages.append(list(range(first, first + count)))
            first += count
        engine.allocate([Allocate(ResourceKind.KV_PAGE, tuple(range(first)))])

    @staticmethod
    def num_pages(chunk_context: int, max_chunk: int, contexts: list[int]) -> int:
        return sum(-(-t // PAGE_SIZE) for t in [chunk_context + max_chunk, *(c + 1 for c in contexts)])

    def _item(self, seq: int, tokens: list[int], start: int) -> ForwardText:
        total = start + len(tokens)
        pages = tuple(self.pages[seq][: -(-total // PAGE_SIZE)])
        last = total - PAGE_SIZE * (len(pages) - 1)
        return ForwardText(pages, last, tuple(tokens), tuple(range(start, total)), (), (len(tokens) - 1,), (GREEDY,))

    def fill(self) -> None:
        """The context every batch reads: the long prompt's first tokens and every stream's prompt."""
        if self.chunk_context:
            for start in range(0, self.chunk_context, 2048):
                stop = min(self.chunk_context, start + 2048)
                self.engine.forward_text([self._item(0, self.long_tokens[start:stop], start)])
        self.engine.forward_text([self._item(1 + s, t[:-1], 0) for s, t in enumerate(self.stream_tokens)])

    def chunk(self, num_tokens: int, start: int | None = None) -> ForwardText:
        """The long prompt's next `num_tokens` after `start` slots (default: the workload's chunk context)."""
        start = self.chunk_context if start is None else start
        return self._item(0, self.long_tokens[start : start + num_tokens], start)

    def steps(self) -> list[ForwardText]:
        return [self._item(1 + s, t[-1:], len(t) - 1) for s, t in enumerate(self.stream_tokens)]


def time_batch(engine: Engine, items: list[ForwardText], mode: str) -> float:
    shipped, config = attention.CALL_COST_PAIRS, engine.config
    attention.CALL_COST_PAIRS = float("inf") if mode == "padded" else shipped
    if mode == "unfused":
        engine.config = dataclasses.replace(config, decode_kernel=False)
    try:
        t0 = time.perf_counter()
        engine.forward_text(items)
        return time.perf_counter() - t0
    finally:
        attention.CALL_COST_PAIRS, engine.config = shipped, config


def _ratio(medians: dict[str, float], a: str, b: str) -> str:
    return f"{medians[a] / medians[b]:.1f}x" if a in medians and b in medians else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", default="2048", help="chunk sizes in tokens, comma-separated")
    parser.add_argument("--chunk-context", type=int, default=0, help="tokens of the long prompt before the chunk")
    parser.add_argument("--decode-items", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--modes", default=",".join(MODES), help=f"which of {','.join(MODES)}")
    parser.add_argument("--weights", default="auto", choices=["auto", "dequantized", "quantized"])
    parser.add_argument("--out", type=Path, default=None, help="JSON of every time")
    args = parser.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    modes = args.modes.split(",")
    assert set(modes) <= set(MODES), modes
    gen = torch.Generator().manual_seed(1)
    contexts = torch.randint(100, 501, (args.decode_items,), generator=gen).tolist()

    loaded = load_model(default_model_path())
    num_pages = Workload.num_pages(args.chunk_context, max(chunks), contexts)
    engine = Engine(loaded, EngineConfig(page_size=PAGE_SIZE, num_pages=num_pages, num_embed_slots=0,
                                         weights=args.weights))
    work = Workload(engine, args.chunk_context, max(chunks), contexts)
    work.fill()
    print(f"weights {engine.weights}, {torch.get_num_threads()} threads, {args.decode_items} decode items "
          f"(context {min(contexts)}-{max(contexts)}), chunk context {args.chunk_context}, load {os.getloadavg()[0]:.1f}")
    times: dict[str, list[float]] = {}
    for repeat in range(args.warmup + args.repeats):
        for chunk in chunks:
            for mode in modes:
                items = work.steps() if mode == "steps" else [work.chunk(chunk)]
                if mode not in ("steps", "chunk"):
                    items += work.steps()
                elapsed = time_batch(engine, items, mode)
                if repeat >= args.warmup:
                    times.setdefault(f"{chunk}/{mode}", []).append(elapsed)
    print(f"load after {os.getloadavg()[0]:.1f}")
    ratios = [("ragged", "steps"), ("unfused", "steps"), ("padded", "ragged")]
    print("| chunk | " + " | ".join(f"{m} ms" for m in modes) + " | " + " | ".join(f"{a} / {b}" for a, b in ratios) + " |")
    print("|---:|" + "---:|" * (len(modes) + len(ratios)))
    for chunk in chunks:
        med = {m: statistics.median(times[f"{chunk}/{m}"]) * 1e3 for m in modes}
        cells = " | ".join(f"{med[m]:,.0f}" for m in modes)
        print(f"| {chunk:,} | {cells} | " + " | ".join(_ratio(med, a, b) for a, b in ratios) + " |")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "contexts": contexts,
                                        "times_s": times}, indent=1))


if __name__ == "__main__":
    main()
