"""`python -m l4m.executor`: serve one model on one device over gRPC; prints the bound address."""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import sys
import time
from pathlib import Path

from l4m.executor.openmp import default_wait

os.environ.update(default_wait(os.environ))  # before torch loads libgomp

import torch  # noqa: E402 (after the OpenMP wait)

from l4m import eventloop
from l4m.common.metrics import (
    METRICS_OFF,
    MetricsEndpoint,
    add_metrics_flags,
    metrics_endpoint,
    start_metrics_server,
)
from l4m.common.serving import bound_address, serve_until_signal
from l4m.executor.architectures import UnsupportedModel
from l4m.executor.config import EngineConfigError
from l4m.executor.cpu_kernels import IsaError, requested_isa
from l4m.executor.engine import Engine, EngineConfig
from l4m.executor.metrics import executor_registry
from l4m.executor.server import ExecutorConfig, create_server
from l4m.executor.weights import default_model_path
from l4m.telemetry import configure_tracing, shutdown_tracing
from l4m.wire.credentials import CredentialError, read_secret_file, tls_files


def parse_config(argv: list[str] | None = None) -> tuple[ExecutorConfig, MetricsEndpoint]:
    parser = argparse.ArgumentParser(prog="python -m l4m.executor", description=__doc__)
    parser.add_argument("--listen", default="127.0.0.1:50061", help="host:port (port 0 = any) or unix:/path")
    parser.add_argument(
        "--model", default=None, help="a .gguf file or an HF safetensors directory (default: SmolLM2)"
    )
    parser.add_argument("--model-name", default="", help="what the cluster calls the model (GetInfo, sessions' "
                        "l4m-model); default: the model's own name (HF _name_or_path or directory, GGUF general.name)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda:N")
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
        help="auto: bfloat16 on CUDA, float32 on CPU (bf16 is emulated, hence slow, on CPUs without AMX/AVX512-BF16)",
    )
    parser.add_argument(
        "--weights", default="auto", choices=["auto", "dequantized", "quantized"],
        help="quantized: keep a GGUF's Q4_1/Q8_0 blocks and multiply with them (CPU, float32; ~5x fewer "
        "bytes per decode step); auto: quantized where that applies and its kernel builds",
    )
    parser.add_argument(
        "--quantized-activations", default="float32", choices=["float32", "bfloat16"],
        help="the precision of x in the products with the GGUF blocks: float32 (float32's products to its rounding) "
        "or bfloat16 (x rounded to bf16, then exact products summed in float32: 1.4-1.5x faster linears at 4-64 "
        "tokens; needs quantized weights and AVX-512 BF16)",
    )
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "float16"],
        help="the KV cache's element type: auto (the dtype's) or float16 (K and V rounded to float16 as they are "
        "written, as llama.cpp keeps its cache: half the bytes a decode step's attention reads, twice the tokens "
        "in the same memory; CPU with dtype float32 only)",
    )
    parser.add_argument(
        "--threads", type=int, default=0,
        help="intra-op CPU threads; 0 = torch's default (all cores). On a CPU shared with other busy "
        "processes, 1 avoids ~16 ms stalls of multi-threaded small ops waiting for a descheduled thread",
    )
    parser.add_argument(
        "--decode-kernel", default="on", choices=["on", "off"],
        help="on: batches where every item feeds one token run all layers in one C++ call on the 4-bit "
        "weights (CPU, quantized weights); off: always the torch path",
    )
    parser.add_argument(
        "--decode-graphs", default="on", choices=["on", "off"],
        help="on: on CUDA, batches of single-token items (up to --graph-max-batch) replay a CUDA graph of a "
        "fixed-shape decode step with Triton kernels, one graph per batch/page bucket, captured on first use; "
        "off: the per-op torch path",
    )
    parser.add_argument("--graph-max-batch", type=int, default=64, help="the largest decode batch run as a CUDA graph")
    parser.add_argument(
        "--graph-capture", default="start", choices=["start", "first-use"],
        help="start: capture every batch/page bucket's decode and continuation graphs before serving (startup "
        "takes longer; no batch pays for a capture); first-use: each when a batch first needs it",
    )
    parser.add_argument("--page-size", type=int, default=16, help="token slots per KV page")
    parser.add_argument("--num-pages", type=int, default=0, help="KV pages; 0 = size from free memory")
    parser.add_argument("--swap-space-pages", type=int, default=-1,
                        help="host swap slots (one KV page each) where the scheduler parks the pages of instances it "
                        "preempts under memory pressure; -1 = as many as the KV cache, at most 1 GiB; 0 = none (the "
                        "scheduler then evicts instead)")
    parser.add_argument("--num-embed-slots", type=int, default=1024)
    parser.add_argument("--max-batch-tokens", type=int, default=8192)
    add_metrics_flags(parser)
    parser.add_argument("--cluster-secret-file", type=Path, default=None,
                        help="file (mode 0600) holding the cluster secret: Execute, GetInfo and Reset refuse calls "
                        "without it (UNAUTHENTICATED)")
    parser.add_argument("--listen-framed", default="", metavar="PATH",
                        help="also serve the Execute stream as frames on this Unix socket (mode 0600, the cluster "
                        "secret in its first frame); GetInfo reports it and a scheduler on this host uses it")
    parser.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate chain: TLS on a TCP --listen")
    parser.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    args = parser.parse_args(argv)
    if args.swap_space_pages < -1:
        parser.error(f"--swap-space-pages must be -1 (auto), 0 (none) or more, got {args.swap_space_pages}")
    if args.graph_max_batch < 1:
        parser.error(f"--graph-max-batch must be at least 1, got {args.graph_max_batch}")
    try:
        secret = read_secret_file(args.cluster_secret_file) if args.cluster_secret_file else ""
        tls = tls_files(args.tls_cert, args.tls_key)
    except CredentialError as error:
        parser.error(str(error))
    if not args.device.startswith("cuda"):
        try:
            requested_isa()  # the CPU kernels' instruction set, read when they load: a bad one is refused here
        except IsaError as error:
            parser.error(str(error))
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if args.device.startswith("cuda") else "float32")
    engine = EngineConfig(
        device=args.device,
        dtype=dtype,
        page_size=args.page_size,
        num_pages=args.num_pages,
        num_embed_slots=args.num_embed_slots,
        max_batch_tokens=args.max_batch_tokens,
        weights=args.weights,
        quantized_activations=args.quantized_activations,
        kv_cache_dtype=args.kv_cache_dtype,
        decode_kernel=args.decode_kernel == "on",
        decode_graphs=args.decode_graphs == "on",
        graph_max_batch=args.graph_max_batch,
        capture_graphs_at_start=args.graph_capture == "start",
        swap_space_pages=args.swap_space_pages,
    )
    config = ExecutorConfig(listen=args.listen, model_path=str(args.model or default_model_path()), engine=engine,
                            cluster_secret=secret, tls=tls, listen_framed=args.listen_framed, model_name=args.model_name)
    return config, metrics_endpoint(parser, args)


def graphs_state(engine: Engine) -> str:
    """How decode steps run, for the ready line: "off: <why>", "on", or "on, N captured in S s"."""
    if engine.graphs_off_reason:
        return f"off: {engine.graphs_off_reason}"
    captured, seconds = engine.captured_at_start
    return f"on, {captured} captured in {seconds:.1f} s" if captured else "on"


async def serve(config: ExecutorConfig, metrics: MetricsEndpoint = METRICS_OFF) -> None:
    print(f"l4m executor: loading {config.model_path} on {config.engine.device} ({config.engine.dtype}) ...", flush=True)
    started = time.monotonic()
    server = await create_server(config)
    engine = server.engine
    x_bf16 = ", x in bf16" if engine.bf16_x else ""
    kv16 = ", KV cache in float16" if engine.kv_dtype != engine.dtype else ""
    print(f"l4m executor: model ready in {time.monotonic() - started:.1f} s ({engine.weights} weights{x_bf16}{kv16}, "
          f"decode kernel {'on' if engine.model.has_decode_kernel and config.engine.decode_kernel else 'off'}, "
          f"decode graphs {graphs_state(engine)})",
          flush=True)
    # The model's Python objects live as long as the process: keep the cyclic GC from rescanning them on
    # every full collection (a batch allocates many short-lived objects, which trigger collections).
    gc.collect()
    gc.freeze()
    start_metrics_server(metrics.port, executor_registry(engine), host=metrics.host)

    async def announce() -> None:
        framed = f" and framed:{server.framed_server.path}" if server.framed_server is not None else ""
        print(f"l4m executor listening on {bound_address(config.listen, server.port)}{framed}", flush=True)

    # SIGTERM (how `l4m up` stops it) ends the process through `main`'s finally, flushing its spans.
    await serve_until_signal(announce, lambda: server.stop(1.0))


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    configure_tracing("l4m.executor")
    config, metrics = parse_config(argv)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            eventloop.run(serve(config, metrics))
    except (UnsupportedModel, FileNotFoundError) as error:
        # A model the executor cannot serve right is refused before anything listens: say why, no traceback.
        print(f"l4m executor: cannot serve {config.model_path}: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except (IsaError, EngineConfigError) as error:
        # L4M_CPU_ISA=avx512_bf16 on a CPU without it, flags that contradict each other or this host (say
        # --quantized-activations bfloat16 with dense weights): the same, before anything listens.
        print(f"l4m executor: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    finally:
        shutdown_tracing()


if __name__ == "__main__":
    main()
