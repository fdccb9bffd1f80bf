"""The decode attention kernel alone on a GPU: its variants side by side, one layer's call timed.

    python3 bench/decode_attention.py --device cuda:0
    python3 bench/decode_attention.py --device cuda:0 --batches 64 --pages 16,64 --dtypes bf16

The default model's shape (9 query heads over 3 KV heads of 64, pages of 16 slots), random KV pages, every
slot visible, each item's context filling its page bucket. For each (dtype, batch, pages) it times
`TritonOps.decode_attention` under each `--variants` (attention blocked / split, products broadcast /
tl.dot; `auto` is what the executor takes) as microseconds per call (CUDA events over `--iterations`
back-to-back calls after a warm-up), the memory traffic that implies (the KV bytes read), and each
variant's largest difference from the torch reference. Needs CUDA and Triton; no model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from l4m.executor import decode_ops
from l4m.executor.decode_ops import TorchOps, TritonOps

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VARIANTS = {  # name -> (DECODE_ATTENTION, DECODE_SCORES)
    "blocked-broadcast": ("blocked", "broadcast"),
    "split-broadcast": ("split", "broadcast"),
    "auto-broadcast": ("auto", "broadcast"),
    "blocked-dot": ("blocked", "dot"),
    "split-dot": ("split", "dot"),
    "auto-dot": ("auto", "dot"),
}


def _inputs(batch: int, pages: int, dtype: torch.dtype, device: torch.device, heads: int, kv_heads: int,
            head_dim: int, page_size: int):
    gen = torch.Generator(device="cpu").manual_seed(0)
    total_pages = batch * pages + 1
    kv = torch.randn(total_pages, 2, page_size, kv_heads, head_dim, generator=gen).to(device, dtype)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(device, dtype)
    table = (1 + torch.randperm(batch * pages, generator=gen)).reshape(batch, pages).to(device, torch.int32)
    ctx_len = torch.full((batch,), pages * page_size, dtype=torch.int32, device=device)
    page_visible = torch.ones(total_pages, page_size, dtype=torch.bool, device=device)
    row_visible = torch.ones(batch, pages * page_size, dtype=torch.uint8, device=device)
    out = torch.empty(batch, heads * head_dim, dtype=dtype, device=device)
    return q, kv, table, ctx_len, page_visible, row_visible, out


def _time_us(call, iterations: int) -> float:
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iterations):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iterations * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--pages", default="8,16,64", help="page buckets (powers of two)")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--out", default="", help="also write the rows as JSON here")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda" or not torch.cuda.is_available() or not decode_ops.triton_available():
        print("bench/decode_attention.py times Triton kernels on a CUDA device: none here", file=sys.stderr)
        return 2
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    rows = []
    print(f"{torch.cuda.get_device_name(device)}; heads {args.heads}/{args.kv_heads} x {args.head_dim}, "
          f"pages of {args.page_size}; us per call (one layer), mean of {args.iterations} back-to-back calls")
    print("| dtype | batch | pages | " + " | ".join(variants) + " | best GB/s | max |diff| |")
    print("|---|---:|---:|" + "---:|" * len(variants) + "---:|---:|")
    for dtype_name in args.dtypes.split(","):
        dtype = DTYPES[dtype_name]
        for batch in map(int, args.batches.split(",")):
            for pages in map(int, args.pages.split(",")):
                inputs = _inputs(batch, pages, dtype, device, args.heads, args.kv_heads, args.head_dim,
                                 args.page_size)
                q, kv, table, ctx_len, page_visible, row_visible, out = inputs
                want = torch.empty_like(out)
                TorchOps.decode_attention(q, kv, table, ctx_len, page_visible, row_visible, want)
                kv_bytes = batch * pages * args.page_size * 2 * args.kv_heads * args.head_dim * kv.element_size()
                times, worst = {}, 0.0
                for name in variants:
                    decode_ops.DECODE_ATTENTION, decode_ops.DECODE_SCORES = VARIANTS[name]
                    out.fill_(float("nan"))
                    TritonOps.decode_attention(*inputs)
                    worst = max(worst, (out.float() - want.float()).abs().max().item())
                    times[name] = _time_us(lambda inputs=inputs: TritonOps.decode_attention(*inputs), args.iterations)
                best = min(times.values())
                rows.append({"dtype": dtype_name, "batch": batch, "pages": pages, "us": times,
                             "kv_bytes": kv_bytes, "max_abs_diff": worst})
                cells = " | ".join(f"{times[v]:.1f}" for v in variants)
                print(f"| {dtype_name} | {batch} | {pages} | {cells} | {kv_bytes / best / 1e3:.0f} | {worst:.1e} |",
                      flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
