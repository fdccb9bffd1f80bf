"""Executor throughput: prefill and decode tok/s at several batch sizes, l4m vs HF transformers.

    .venv/bin/python bench/executor.py                       # batches 1,16,64; prompt 100; 128 new
    .venv/bin/python bench/executor.py --batches 1,16 --new-tokens 32 --engines l4m-q4,l4m-fp32 --threads 1

Engines: l4m-q4 (float32 compute on the GGUF's Q4_1/Q8_0 blocks, the CPU default), l4m-q4-xbf16 (the same
with x rounded to bf16 in the blocks' products: `--quantized-activations bfloat16`, AVX-512 BF16 only),
l4m-q4-kv16 (l4m-q4 with a float16 KV cache: `--kv-cache-dtype float16`), l4m-q4-xbf16-kv16 (both),
l4m-fp32 (dense float32 weights), l4m-bf16, hf-fp32, hf-bf16, llama-cpp-f32, llama-cpp-f16 and llama-cpp-q4_1
(llama-cpp-python's batched decode on F32 / F16 GGUF exports of the same weights and on the model's own
Q4_1 file, see bench/peers.py; skipped with a note when llama-cpp-python is not installed:
scripts/bench-setup.sh builds it). Every engine decodes
greedily from the same random 100-token prompts; prefill is one forward over all prompts, decode is the median step time. With
--repeats N each (engine, batch) runs N times, interleaved across engines, and the table shows
medians. Prints one table, the load average, and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import peers
import torch

from l4m.executor import decode_ops
from l4m.executor.commands import Allocate, ForwardText, ResourceKind, SamplerKind, SamplerSpec
from l4m.executor.config import EngineConfigError
from l4m.executor.engine import Engine, EngineConfig
from l4m.executor.weights import default_model_path, load_model

GREEDY = SamplerSpec(SamplerKind.GREEDY)


L4M_ENGINES = {  # name -> (dtype, weights, decode kernel: single-token batches through the C++ stack)
    "l4m-q4": ("float32", "quantized", True),
    "l4m-q4-torch": ("float32", "quantized", False),  # the same weights on the per-op torch path (A/B)
    # x rounded to bf16 in the products with the blocks (quantized_activations="bfloat16"; AVX-512 BF16)
    "l4m-q4-xbf16": ("float32", "quantized", True),
    # K/V stored as float16 (kv_cache_dtype="float16"), alone and with x in bf16
    "l4m-q4-kv16": ("float32", "quantized", True),
    "l4m-q4-xbf16-kv16": ("float32", "quantized", True),
    "l4m-fp32": ("float32", "dequantized", False),
    "l4m-bf16": ("bfloat16", "dequantized", False),
    # On CUDA l4m-fp32 / l4m-bf16 decode through CUDA graphs; these keep the per-op path (A/B).
    "l4m-fp32-eager": ("float32", "dequantized", False),
    "l4m-bf16-eager": ("bfloat16", "dequantized", False),
}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def bench_l4m(
    loaded, name: str, batch: int, prompt_len: int, new_tokens: int, device: str = "cpu",
    decode: str = "steps",
) -> tuple[float, float]:
    dtype, weights, decode_kernel = L4M_ENGINES[name]
    if weights == "quantized" and device != "cpu":
        raise peers.PeerUnavailable(f"{name} multiplies with the GGUF blocks on the CPU only")
    page_size = 16
    pages_per_seq = -(-(prompt_len + new_tokens) // page_size)
    config = EngineConfig(
        device=device,
        dtype=dtype,
        page_size=page_size,
        num_pages=batch * pages_per_seq + 1,
        num_embed_slots=0,
        weights=weights,
        quantized_activations="bfloat16" if "-xbf16" in name else "float32",
        kv_cache_dtype="float16" if name.endswith("-kv16") else "auto",
        decode_kernel=decode_kernel,
        decode_graphs=not name.endswith("-eager"),
        graph_max_batch=max(64, batch),
    )
    try:
        engine = Engine(loaded, config)
    except EngineConfigError as error:  # x in bf16 where the kernels run AVX2
        raise peers.PeerUnavailable(str(error)) from None
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

    # Warm-up (as for HF): the first forward pays one-off set-up (CUDA kernels and cuBLAS handles).
    engine.forward_text([item(0, prompts[0][:8], 0)])
    _sync(device)
    # The prompts in as few forwards as max_batch_tokens allows (whole prompts per forward).
    per_forward = max(1, config.max_batch_tokens // prompt_len)
    t0 = time.perf_counter()
    results = []
    for first in range(0, batch, per_forward):
        results += engine.forward_text([item(b, prompts[b], 0) for b in range(first, min(batch, first + per_forward))])
    prefill_s = time.perf_counter() - t0
    last = [r.outputs[0].token_id for r in results]
    if decode == "continuation":  # one forward_text: the executor feeds each token back itself
        steps_each = new_tokens - 2
        items = [
            dataclasses.replace(
                item(b, [last[b]], prompt_len), num_continuation_steps=steps_each,
                **_pages_for(b, prompt_len + 1 + steps_each, pages_per_seq, page_size),  # every fed token's slot
            )
            for b in range(batch)
        ]
        warm = engine.forward_text(items)  # the same run once untimed: captures its graphs, warms up
        _sync(device)
        t0 = time.perf_counter()
        results = engine.forward_text(items)
        elapsed = time.perf_counter() - t0
        assert all(len(r.outputs) == steps_each + 1 for r in results) and warm
        return batch * prompt_len / prefill_s, batch * (steps_each + 1) / elapsed
    steps = []
    for step in range(new_tokens - 1):
        t0 = time.perf_counter()
        results = engine.forward_text([item(b, [last[b]], prompt_len + step) for b in range(batch)])
        steps.append(time.perf_counter() - t0)
        last = [r.outputs[0].token_id for r in results]
    _print_replay_time(engine, batch)
    return batch * prompt_len / prefill_s, batch / statistics.median(steps)


def _print_replay_time(engine: Engine, batch: int) -> None:
    """On CUDA: the GPU time of one decode step alone (its graph replayed back to back), against which
    the step times above show what the host adds."""
    decoder = engine.static_decoder
    if decoder is None or not decoder.graphs:
        return
    for pages, graph in decoder.decode_graphs(batch).items():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            graph.replay()
        torch.cuda.synchronize()
        print(f"    graph replay, batch {batch} x {pages} pages: {(time.perf_counter() - t0) / 50 * 1e3:.3f} ms/step")


def _pages_for(b: int, total: int, pages_per_seq: int, page_size: int) -> dict:
    pages = tuple(range(b * pages_per_seq, b * pages_per_seq + -(-total // page_size)))
    return {"kv_page_ids": pages, "kv_last_page_length": total - page_size * (len(pages) - 1)}


def bench_hf(dtype: str, batch: int, prompt_len: int, new_tokens: int, device: str = "cpu") -> tuple[float, float]:
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=getattr(torch, dtype)
    ).eval().to(device)
    ids = torch.randint(100, 40000, (batch, prompt_len), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        # Warm-up: the first generate pays one-off setup that would otherwise count as prefill.
        model.generate(
            ids[:1, :8], attention_mask=mask[:1, :8], max_new_tokens=2, do_sample=False, pad_token_id=2
        )
        _sync(device)
        t0 = time.perf_counter()
        model.generate(
            ids, attention_mask=mask, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=2
        )
        _sync(device)
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
        _sync(device)
        total_s = time.perf_counter() - t0
    return batch * prompt_len / prefill_s, batch * (new_tokens - 1) / max(total_s - prefill_s, 1e-9)


def bench_llama_cpp(
    precision: str, batch: int, prompt_len: int, new_tokens: int, device: str = "cpu"
) -> tuple[float, float]:
    if device != "cpu":
        raise peers.PeerUnavailable("llama-cpp-python is built for the CPU here")
    prompts = peers.make_prompts(batch, prompt_len)
    timeline = peers.run_llama_cpp(prompts, new_tokens, precision, torch.get_num_threads())
    return peers.prefill_decode_rates(timeline, prompt_len)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--engines", default="l4m-q4,l4m-fp32,l4m-bf16,hf-fp32,llama-cpp-f32,llama-cpp-f16,llama-cpp-q4_1"
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs per (engine, batch); medians shown")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0 = default")
    parser.add_argument("--device", default="cpu", help="cpu or cuda:N (the CPU-only engines are skipped on CUDA)")
    parser.add_argument(
        "--decode-attention", default="auto", choices=["auto", "blocked", "split"],
        help="on CUDA, the decode graphs' attention kernel (decode_ops.DECODE_ATTENTION): blocked, split "
        "(flash-decoding: the pages split across programs, then a combine) or auto (the default: split "
        "where it gives more than one split per item and head)",
    )
    parser.add_argument(
        "--decode", default="steps", choices=["steps", "continuation"],
        help="steps: one forward_text per generated token (median step); continuation: one forward_text "
        "whose items decode on by themselves (the l4m engines only; total time)",
    )
    parser.add_argument("--out", default="bench/results/executor.json")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    decode_ops.DECODE_ATTENTION = args.decode_attention
    loaded = load_model(default_model_path())
    engines = args.engines.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    runs: dict[tuple[str, int], list[tuple[float, float]]] = {}
    load_before = os.getloadavg()
    for _ in range(args.repeats):
        for batch in batches:
            for engine in engines:
                try:
                    if engine.startswith("l4m"):
                        result = bench_l4m(
                            loaded, engine, batch, args.prompt_tokens, args.new_tokens, args.device, args.decode
                        )
                    elif engine.startswith("llama-cpp-"):
                        precision = engine.rsplit("-", 1)[1]
                        result = bench_llama_cpp(precision, batch, args.prompt_tokens, args.new_tokens, args.device)
                    else:
                        dtype = "float32" if engine.endswith("fp32") else "bfloat16"
                        result = bench_hf(dtype, batch, args.prompt_tokens, args.new_tokens, args.device)
                except (ImportError, peers.PeerUnavailable) as exc:
                    print(f"skipping {engine}: {exc}")
                    continue
                runs.setdefault((engine, batch), []).append(result)
                print(
                    f"{engine:10s} batch {batch:3d}: prefill {result[0]:8.1f} tok/s  decode {result[1]:8.1f} tok/s",
                    flush=True,
                )
    rows = [
        {
            "engine": engine,
            "batch": batch,
            "prefill_tok_s": statistics.median(r[0] for r in results),
            "decode_tok_s": statistics.median(r[1] for r in results),
            "runs": results,
        }
        for (engine, batch), results in sorted(
            runs.items(), key=lambda kv: (kv[0][1], engines.index(kv[0][0]))
        )
    ]
    load_after = os.getloadavg()
    print(
        f"\n{peers.cpu_model() if args.device == 'cpu' else torch.cuda.get_device_name(args.device)}; "
        f"prompt {args.prompt_tokens} tokens, {args.new_tokens} new, {torch.get_num_threads()} threads, "
        f"medians of {args.repeats}; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after"
    )
    print("| engine | batch | prefill tok/s | decode tok/s |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['engine']} | {r['batch']} | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} |")
    out = {
        "args": vars(args),
        "threads": torch.get_num_threads(),
        "device": args.device,
        "load_average": [load_before, load_after],
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
