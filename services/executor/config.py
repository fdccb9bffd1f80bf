"""The engine's configuration (`EngineConfig`, built once by `__main__` from flags) and the weight mode
it resolves to for a loaded model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from l4m.executor.cpu_kernels import AVX512_BF16_ISAS, AVX512_ISAS
from l4m.executor.quant import kernels_available, load_kernels
from l4m.executor.weights import LoadedModel


class EngineConfigError(ValueError):
    """Settings that contradict each other or this host (the executor refuses them before it listens)."""


WEIGHT_MODES = ("auto", "dequantized", "quantized")
ACTIVATION_MODES = ("float32", "bfloat16")
KV_CACHE_DTYPES = ("auto", "float16")
MAX_AUTO_SWAP_BYTES = 1 << 30  # the automatic swap space's host memory at most (untouched slots cost none on CPU)


@dataclass(frozen=True)
class EngineConfig:
    device: str = "cpu"  # "cpu" or "cuda:N"
    dtype: str = "float32"  # "float32" or "bfloat16"
    page_size: int = 16
    num_pages: int = 0  # 0: size from free memory (memory_fraction of it)
    num_embed_slots: int = 1024
    memory_fraction: float = 0.25
    max_batch_tokens: int = 8192  # new tokens in one forward batch
    # "dequantized": dense weights of `dtype`. "quantized": keep GGUF Q4_1 / Q8_0 blocks and multiply
    # with them for calls of at most `max_quantized_rows` tokens (CPU, float32). "auto": quantized
    # when that applies and the kernel builds, else dequantized.
    weights: str = "auto"
    # 0 ("auto"): every call a batch can hold where the kernels run AVX-512 BF16 (prefill of 100 tokens
    # on 2 threads: blocks 903-1,002 tok/s vs dense 511-633; 16 x 100: 1,242 vs 794-838), else 64 (AVX2, under
    # L4M_CPU_ISA=avx2 on that host: blocks ahead up to ~16 x 100 tokens, behind at 64 x 100). See resolve_max_quantized_rows.
    max_quantized_rows: int = 0
    # The precision of x in the products with the GGUF blocks. "float32": float32's products to its
    # rounding (the default, what the tests hold to the reference). "bfloat16": x rounded to bf16 first,
    # then exact products summed in float32, as llama.cpp rounds x for its own 4-bit dot products (to 8
    # bits per block for Q4_1): 1.4-1.5x faster linears at 4-64 rows (docs/benchmarks.md); needs quantized
    # weights and the kernels' avx512_bf16 instruction set. The operator's choice (executor flag).
    quantized_activations: str = "float32"
    # The KV cache's element type. "auto": the engine's `dtype` (the default, what the tests hold to the
    # reference). "float16": K and V rounded to float16 as they are written (values beyond +-65504 clamped),
    # read back as float32 by the attention, as llama.cpp keeps its cache (F16 by default): half the bytes a
    # decode step's attention reads and twice the tokens in the same memory; CPU and dtype float32 only.
    # The operator's choice (executor flag).
    kv_cache_dtype: str = "auto"
    # With quantized weights, run batches of single-token items (decode steps) through the whole layer
    # stack in one C++ call (`cpu_kernels.decode_layers`); False keeps them on the torch path.
    decode_kernel: bool = True
    # On CUDA, run batches of single-token items of up to `graph_max_batch` items as CUDA graphs of
    # the static decode step (`decode_graphs.py`); False keeps them on the per-op torch path.
    decode_graphs: bool = True
    graph_max_batch: int = 64
    # Capture every bucket's decode and continuation graphs when the engine is built (`StaticDecoder.
    # capture_all`) rather than the first time a batch needs one: a capture takes the device for tens of
    # milliseconds (the first of a shape compiles its Triton kernels: seconds), which a serving executor
    # should pay before it takes traffic, not in some batch's step. The executor service turns it on.
    capture_graphs_at_start: bool = False
    # Host swap slots for the pages of instances the scheduler preempts (one KV page each). -1: as many as
    # the device cache holds, at most what `MAX_AUTO_SWAP_BYTES` of host memory holds; 0: no swap space.
    swap_space_pages: int = -1


AVX2_MAX_QUANTIZED_ROWS = 64


def resolve_max_quantized_rows(config: EngineConfig, isa: str) -> int:
    """`config.max_quantized_rows`, with 0 ("auto") resolved for the kernels' instruction set `isa`."""
    if config.max_quantized_rows < 0:
        raise ValueError(f"max_quantized_rows must be 0 (auto) or more, got {config.max_quantized_rows}")
    if config.max_quantized_rows:
        return config.max_quantized_rows
    return config.max_batch_tokens if isa in AVX512_ISAS else AVX2_MAX_QUANTIZED_ROWS


def resolve_bf16_x(config: EngineConfig, weights: str, isa: str) -> bool:
    """Whether the blocks' products take x rounded to bf16 (`config.quantized_activations`), for an
    engine of weight mode `weights` whose kernels run `isa`; EngineConfigError where it cannot run."""
    mode = config.quantized_activations
    if mode not in ACTIVATION_MODES:
        raise EngineConfigError(f"quantized_activations must be one of {ACTIVATION_MODES}, got {mode!r}")
    if mode == "float32":
        return False
    if weights != "quantized":
        raise EngineConfigError("quantized_activations=bfloat16 needs quantized weights (a GGUF with Q4_1 / Q8_0 "
                                f"blocks, device cpu, dtype float32); this engine's weights are {weights}")
    if isa not in AVX512_BF16_ISAS:
        raise EngineConfigError("quantized_activations=bfloat16 needs the CPU kernels' avx512_bf16 instruction "
                                f"set; they run {isa} (L4M_CPU_ISA)")
    return True


def resolve_kv_cache_dtype(config: EngineConfig, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for an engine of `dtype` (`config.kv_cache_dtype`); EngineConfigError
    where it cannot run."""
    mode = config.kv_cache_dtype
    if mode not in KV_CACHE_DTYPES:
        raise EngineConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {mode!r}")
    if mode == "auto":
        return dtype
    if torch.device(config.device).type != "cpu" or dtype != torch.float32:
        raise EngineConfigError(f"kv_cache_dtype=float16 is implemented for device cpu with dtype float32; this "
                                f"engine's are {config.device} and {config.dtype} (there the cache is the dtype's)")
    return torch.float16


def resolve_weights(config: EngineConfig, loaded: LoadedModel) -> str:
    """The weight mode an engine with `config` uses: "dequantized" or "quantized"."""
    if config.weights not in WEIGHT_MODES:
        raise EngineConfigError(f"weights must be one of {WEIGHT_MODES}, got {config.weights!r}")
    fits = torch.device(config.device).type == "cpu" and config.dtype == "float32"
    if config.weights == "quantized":
        if not fits:
            raise EngineConfigError("weights=quantized needs device cpu and dtype float32")
        if not loaded.quantized:
            raise EngineConfigError("weights=quantized needs a GGUF model with Q4_1 / Q8_0 tensors")
        load_kernels()
        return "quantized"
    if config.weights == "auto" and fits and loaded.quantized and kernels_available():
        return "quantized"
    return "dequantized"
