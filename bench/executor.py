"""Executor throughput: prefill and decode tok/s at several batch sizes, l4m vs HF transformers.

    .venv/bin/python bench/executor.py                       # batches 1,16,64; prompt 100; 128 new
    .venv/bin/python bench/executor.py --batches 1,16 --new-tokens 32 --engines l4m-fp32,l4m-bf16

Prints one table and writes JSON (--out). Every engine decodes greedily from the same random
100-token prompts; prefill is one forward over all prompts, decode is the median step time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from l4m.executor.commands import Allocate, ForwardText, ResourceKind, SamplerKind, SamplerSpec
from l4m.executor.engine import Engine, EngineConfig
from l4m.executor.weights import default_model_path, load_model

GREEDY = SamplerSpec(SamplerKind.GREEDY)


def bench_l4m(loaded, dtype: str, batch: int, prompt_len: int, new_tokens: int) -> tuple[float, float]:
    page_size = 16
    pages_per_seq = -(-(prompt_len + new_tokens) // page_size)
    engine = Engine(
        loaded,
        EngineConfig(
            dtype=dtype, page_size=page_size, num_pages=batch * pages_per_seq + 1, num_embed_slots=0
        ),
    )
    engine.allocate([Allocate(ResourceKind.KV_PAGE, tuple(range(batch * pages_per_seq)))])
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 40000, (batch, prompt_len), generator=gen).tolist()

    def item(b: int, tokens: list[int], start: int) -> ForwardText:
        total = start + len(tokens)
        pages = tuple(range(b * pages_per_seq, b * pages_per_seq + -(-total // page_size)))
        last = total - page_size * (len(pages) - 1)
        return ForwardText(
            pages, last, tuple(tokens), tuple(range(start, total)), (), (len(tokens) - 1,), (GREEDY,)
        )

    t0 = time.perf_counter()
    results = engine.forward_text([item(b, prompts[b], 0) for b in range(batch)])
    prefill_s = time.perf_counter() - t0
    last = [r.outputs[0].token_id for r in results]
    steps = []
    for step in range(new_tokens - 1):
        t0 = time.perf_counter()
        results = engine.forward_text([item(b, [last[b]], prompt_len + step) for b in range(batch)])
        steps.append(time.perf_counter() - t0)
        last = [r.outputs[0].token_id for r in results]
    return batch * prompt_len / prefill_s, batch / statistics.median(steps)


def bench_hf(dtype: str, batch: int, prompt_len: int, new_tokens: int) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=getattr(torch, dtype)
    ).eval()
    ids = torch.randint(100, 40000, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        # Warm-up: the first generate pays one-off setup that would otherwise count as prefill.
        model.generate(
            ids[:1, :8], attention_mask=mask[:1, :8], max_new_tokens=2, do_sample=False, pad_token_id=2
        )
        t0 = time.perf_counter()
        model.generate(
            ids, attention_mask=mask, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=2
        )
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=2,
        )
        total_s = time.perf_counter() - t0
    return batch * prompt_len / prefill_s, batch * (new_tokens - 1) / max(total_s - prefill_s, 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--engines", default="l4m-fp32,l4m-bf16,hf-fp32,hf-bf16")
    parser.add_argument("--out", default="bench/executor_results.json")
    args = parser.parse_args()
    loaded = load_model(default_model_path())
    rows = []
    for engine in args.engines.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            dtype = "float32" if engine.endswith("fp32") else "bfloat16"
            try:
                if engine.startswith("l4m"):
                    prefill, decode = bench_l4m(loaded, dtype, batch, args.prompt_tokens, args.new_tokens)
                else:
                    prefill, decode = bench_hf(dtype, batch, args.prompt_tokens, args.new_tokens)
            except ImportError as exc:
                print(f"skipping {engine}: {exc}")
                break
            rows.append({"engine": engine, "batch": batch, "prefill_tok_s": prefill, "decode_tok_s": decode})
            print(
                f"{engine:10s} batch {batch:3d}: prefill {prefill:8.1f} tok/s  decode {decode:8.1f} tok/s",
                flush=True,
            )
    print(f"\nprompt {args.prompt_tokens} tokens, {args.new_tokens} new, {torch.get_num_threads()} threads")
    print("| engine | batch | prefill tok/s | decode tok/s |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['engine']} | {r['batch']} | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
