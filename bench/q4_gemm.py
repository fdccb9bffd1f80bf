"""The 4-bit CPU GEMM alone: `torch.ops.l4m_cpu.linear` on SmolLM2-135M's shapes, ms and GFLOP/s.

    .venv/bin/python bench/q4_gemm.py                              # M = 1,16,64; 2 threads; 5 repeats
    .venv/bin/python bench/q4_gemm.py --m 1,8,16,64 --threads 1 --repeats 9 --stat min --compare /tmp/before.cpp
    .venv/bin/python bench/q4_gemm.py --m 1,4 --isa avx2,avx512_bf16 --copies 30   # both paths, cold weights
    .venv/bin/python bench/q4_gemm.py --m 1,16,64 --bf16-x --copies 30   # also x rounded to bf16 (AVX-512 BF16)
    .venv/bin/python bench/q4_gemm.py --m 16,64,512 --isa avx512_bf16,amx --bf16-x   # AMX tiles, both precisions

Weights are random GGUF blocks (Q4_1 for the layers, Q8_0 for the tied embedding used as the LM head)
with the model's shapes; x is random float32 [M, K]. Each (shape, M, kernel) cell is timed over calls
totalling >= --min-ms, and the cells run in turn, `--repeats` times (interleaved, so drift from other
processes spreads over all of them); the table shows medians (`--stat min`: minima). GFLOP/s counts
2 M N K per call (no "peak" line: /proc's clock times a guessed FLOP per cycle read 166 GFLOP/s on a host
whose panels ran 400+). `--compare SOURCE` (repeatable) also builds another cpu_kernels.cpp (say the previous
version) under the op namespace `l4m_cpu_cmp<i>` and times it beside the current one, labelled by its
file name. `--isa` times the current source under each named instruction set (as L4M_CPU_ISA). With
`--copies N` each call takes the next of N weight copies (N = 30: the weights stream from memory, as a
decode step's 30 layers do; 1: they stay in cache). `--bf16-x` also times the current source with x rounded
to bf16 (`bf16_x`, the engine's `quantized_activations="bfloat16"`; AVX-512 BF16 only), checked against
bf16(x) times the blocks. Writes JSON (--out).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from pathlib import Path

import torch

SHAPES = {  # name -> (kind, N, K): SmolLM2-135M, E = 576, 9 + 2 * 3 heads of 64, F = 1536, V = 49152
    "qkv": ("q4_1", 960, 576),
    "o": ("q4_1", 576, 576),
    "gate_up": ("q4_1", 3072, 576),
    "down": ("q4_1", 576, 1536),
    "lm_head": ("q8_0", 49152, 576),
}
LAYERS = 30  # per decode step: every layer's 4 linears, then the head once


def random_blocks(kind: str, n: int, k: int, gen: torch.Generator) -> tuple:
    d = (torch.rand(n, k // 32, generator=gen) * 0.01 + 0.001).half()  # float16, as in a GGUF
    if kind == "q4_1":
        qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        return qs, d, (torch.randn(n, k // 32, generator=gen) * 0.05).half()
    return torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen), d, None


def dequantize(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    scale = d.repeat_interleave(32, dim=1)
    if m is None:
        return qs.float() * scale
    nibbles = qs.view(qs.shape[0], -1, 16)
    values = torch.cat((nibbles & 15, nibbles >> 4), dim=-1).reshape(qs.shape[0], -1).float()
    return scale * values + m.repeat_interleave(32, dim=1)


def build_compare(source: Path, namespace: str):
    """Builds `source` with its op namespace renamed, so several versions live in this process."""
    from torch.utils.cpp_extension import load_inline

    text = source.read_text()
    if "TORCH_LIBRARY(l4m_cpu," not in text:
        raise SystemExit(f"{source}: no TORCH_LIBRARY(l4m_cpu, ...) block to rename")
    text = text.replace("TORCH_LIBRARY(l4m_cpu,", f"TORCH_LIBRARY({namespace},")
    load_inline(namespace, cpp_sources=[text], no_implicit_headers=True, is_python_module=False,
                extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"], extra_ldflags=["-fopenmp"])
    op = getattr(torch.ops, namespace).linear
    if "at::kHalf" in text:
        return op
    # Sources before 2026-11-27 take float32 scales: converted once per weight, outside the timing.
    as_float: dict[int, tuple] = {}

    def linear(x, qs, d, m):
        if id(d) not in as_float:
            as_float[id(d)] = (d, d.float(), None if m is None else m.float())
        _, d32, m32 = as_float[id(d)]
        return op(x, qs, d32, m32)

    return linear


def time_call(fn, min_ms: float) -> float:
    """Milliseconds per call, over calls totalling >= min_ms (after one warm-up call)."""
    fn()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed * 1e3 >= min_ms:
            return elapsed * 1e3 / calls


def cpu_mhz() -> float | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next(float(line.split(":")[1]) for line in f if line.startswith("cpu MHz"))
    except (OSError, StopIteration, ValueError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", default="1,16,64", help="rows of x (batch sizes), comma-separated")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--min-ms", type=float, default=60.0, help="time per cell per repeat")
    parser.add_argument("--compare", type=Path, action="append", default=[],
                        help="another cpu_kernels.cpp to time beside the current one (repeatable)")
    parser.add_argument("--copies", type=int, default=1,
                        help="weight tensors per shape, used in turn (30: from memory, as in a decode step)")
    parser.add_argument("--isa", default="",
                        help="time the current kernels under each of these ISAs (comma-separated, as L4M_CPU_ISA: "
                             "avx2, avx512_bf16), each as its own kernel; default: the one loaded")
    parser.add_argument("--bf16-x", action="store_true",
                        help="also time the current source with x rounded to bf16 (label cur-x-bf16)")
    parser.add_argument("--stat", choices=("median", "min"), default="median",
                        help="of the repeats (min: the least disturbed run, for A/B on a busy machine)")
    parser.add_argument("--out", default="bench/results/q4_gemm.json")
    args = parser.parse_args()
    ms = [int(v) for v in args.m.split(",")]
    names = args.shapes.split(",")
    for name in names:
        if name not in SHAPES:
            parser.error(f"unknown shape {name!r}: expected some of {', '.join(SHAPES)}")
    if any(m < 1 for m in ms) or args.repeats < 1 or args.threads < 1 or args.copies < 1:
        parser.error("--m values, --repeats, --threads and --copies must be >= 1")

    from l4m.executor.cpu_kernels import AVX512_BF16_ISAS, load_kernels

    torch.set_num_threads(args.threads)
    load_kernels()
    isas = [v for v in args.isa.split(",") if v]
    # label -> (op, the ISA to select before it runs, or None; whether it rounds x to bf16)
    kernels = {f"cur-{isa.removeprefix('avx512_')}": (torch.ops.l4m_cpu.linear, isa, False) for isa in isas} or {
        "current": (torch.ops.l4m_cpu.linear, None, False)}
    for i, source in enumerate(args.compare):
        label = source.stem[:12]
        kernels[label if label not in kernels else f"{label[:10]}-{i}"] = (
            build_compare(source, f"l4m_cpu_cmp{i}"), None, False)
    if args.bf16_x:  # under each --isa that runs it (avx512_bf16, amx), else avx512_bf16
        for isa in [v for v in isas if v in AVX512_BF16_ISAS] or ["avx512_bf16"]:
            label = "cur-x-bf16" if isa == "avx512_bf16" else f"cur-x-{isa}"
            kernels[label] = (lambda x, qs, d, m: torch.ops.l4m_cpu.linear(x, qs, d, m, True), isa, True)

    gen = torch.Generator().manual_seed(0)
    weights = {name: random_blocks(*SHAPES[name], gen) for name in names}
    # --copies: distinct weight tensors per shape, called in turn, so that they come from memory as the
    # 30 layers' do in a decode step rather than from the cache (the head, 31 MB, at most 2 copies).
    copies = {
        name: [weights[name]]
        + [random_blocks(*SHAPES[name], gen) for _ in range((min(args.copies, 2) if name == "lm_head" else args.copies) - 1)]
        for name in names
    }
    xs = {(name, m): torch.randn(m, SHAPES[name][2], generator=gen) for name in names for m in ms}
    for (name, m), x in xs.items():  # every kernel agrees with the dense product before it is timed
        qs, d, mins = weights[name]
        w = dequantize(qs, d, mins).double().T
        for label, (op, isa, bf16_x) in kernels.items():
            if isa:
                torch.ops.l4m_cpu.set_isa(isa)
            want = (x.bfloat16() if bf16_x else x).double() @ w
            err = (op(x, qs, d, mins).double() - want).abs().max().item()
            if err > 1e-4 * want.abs().max().item():
                raise SystemExit(f"{label} is wrong on {name} at M = {m}: max error {err:.3g}")

    times: dict[tuple[str, int, str], list[float]] = {}
    load_before = os.getloadavg()
    for _ in range(args.repeats):
        for name in names:
            ws = itertools.cycle(copies[name])
            for m in ms:
                x = xs[(name, m)]
                for label, (op, isa, _) in kernels.items():
                    if isa:
                        torch.ops.l4m_cpu.set_isa(isa)
                    t = time_call(lambda op=op, x=x, ws=ws: op(x, *next(ws)), args.min_ms)
                    times.setdefault((name, m, label), []).append(t)
    load_after = os.getloadavg()

    stat = min if args.stat == "min" else statistics.median
    mhz = cpu_mhz()
    print(f"threads {args.threads}, {args.stat} of {args.repeats} interleaved repeats; load average "
          f"{load_before[0]:.2f} before, {load_after[0]:.2f} after")
    print(f"{'shape':<8} {'kernel':<12} {'M':>4} {'N':>6} {'K':>5} {'ms':>8} {'GFLOP/s':>8}")
    rows = []
    for name in names:
        kind, n, k = SHAPES[name]
        for m in ms:
            for label in kernels:
                t = stat(times[(name, m, label)])
                gflops = 2 * m * n * k / t / 1e6
                rows.append({"shape": name, "kind": kind, "kernel": label, "m": m, "n": n, "k": k, "ms": t,
                             "gflops": gflops, "all_ms": times[(name, m, label)]})
                print(f"{name:<8} {label:<12} {m:>4} {n:>6} {k:>5} {t:>8.3f} {gflops:>8.1f}")
    # A decode step's linears: 30 layers x 4, then the head.
    for label in kernels:
        if set(names) != set(SHAPES):
            break
        for m in ms:
            step = sum(stat(times[(s, m, label)]) * (1 if s == "lm_head" else LAYERS) for s in SHAPES)
            print(f"step linears ({label}), M = {m}: {step:.1f} ms -> {m / step * 1e3:.0f} tok/s bound")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": args.threads, "repeats": args.repeats, "stat": args.stat, "mhz": mhz,
                               "load_before": load_before, "load_after": load_after, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
