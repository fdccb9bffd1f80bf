"""Executor fixtures: the model is loaded once per session (seconds), engines are cheap to build.

`L4M_TEST_DEVICE=cuda:0` runs the engine tests on a GPU (the reference stays a CPU float32 forward);
the tests of the CPU-only paths (the GGUF-block kernels, the C++ decode step) skip themselves there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import pytest
import torch

from l4m.executor.commands import Allocate, DebugQuery, ForwardText, ResourceKind, SamplerKind, SamplerSpec
from l4m.executor.engine import Engine, EngineConfig
from l4m.executor.weights import LoadedModel, default_model_path, load_model

TEST_DEVICE = os.environ.get("L4M_TEST_DEVICE", "cpu")
ON_CPU = torch.device(TEST_DEVICE).type == "cpu"
if ON_CPU:  # the CUDA decode kernels run in Triton's interpreter (read when triton is first imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")
cpu_only = pytest.mark.skipif(not ON_CPU, reason=f"a CPU-only path (L4M_TEST_DEVICE={TEST_DEVICE})")

PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "The quick brown fox jumps over the lazy dog. Then the dog",
    "<|im_start|>user\nList three colors.<|im_end|>\n<|im_start|>assistant\n",
    "In 1492, Columbus sailed",
    "Once upon a time",
]


@pytest.fixture(scope="session")
def loaded() -> LoadedModel:
    return load_model(default_model_path())


@pytest.fixture(scope="session")
def prompts(loaded: LoadedModel) -> list[list[int]]:
    return [loaded.tokenizer.tokenizer.encode(p).ids for p in PROMPTS]


@pytest.fixture
def make_engine(loaded: LoadedModel) -> Callable[..., Engine]:
    def make(
        dtype: str = "float32",
        page_size: int = 4,
        num_pages: int = 256,
        num_embed_slots: int = 64,
        weights: str = "auto",
        max_quantized_rows: int = 128,
        decode_kernel: bool = True,
        quantized_activations: str = "float32",
        kv_cache_dtype: str = "auto",
    ) -> Engine:
        if weights == "quantized" and not ON_CPU:
            pytest.skip(f"quantized weights are a CPU-only path (L4M_TEST_DEVICE={TEST_DEVICE})")
        config = EngineConfig(
            device=TEST_DEVICE,
            dtype=dtype,
            page_size=page_size,
            num_pages=num_pages,
            num_embed_slots=num_embed_slots,
            weights=weights,
            max_quantized_rows=max_quantized_rows,
            decode_kernel=decode_kernel,
            quantized_activations=quantized_activations,
            kv_cache_dtype=kv_cache_dtype,
        )
        return Engine(loaded, config)

    return make


@pytest.fixture
def avx512() -> object:
    """Runs the test with the CPU kernels on their avx512_bf16 code (mark it needs_bf16), whatever L4M_CPU_ISA chose."""
    before = torch.ops.l4m_cpu.isa()
    torch.ops.l4m_cpu.set_isa("avx512_bf16")
    yield
    torch.ops.l4m_cpu.set_isa(before)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> object:
    """Runs the test on 1 and on 2 torch intra-op threads (the CPU kernels' parallel chunks)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def engine_stats(engine: Engine) -> dict:
    return json.loads(engine.debug_query([DebugQuery("stats")])[0])


class LogitsRecorder:
    """Wraps `engine.model.logits` to keep the float32 logits of every forward run op by op. A CUDA graph's
    capture is skipped (a copy to the host cannot be captured, and a replay never calls Python): what a
    graph computes is checked through the tokens it returns."""

    def __init__(self, engine: Engine) -> None:
        self.calls: list[torch.Tensor] = []
        inner = engine.model.logits

        def record(normed: torch.Tensor) -> torch.Tensor:
            out = inner(normed)
            if out.is_cuda and torch.cuda.is_current_stream_capturing():
                return out
            self.calls.append(out.float().cpu())  # a copy: compared on the CPU with the reference
            return out

        engine.model.logits = record  # type: ignore[method-assign]


class PageTables:
    """Minimal scheduler-side bookkeeping for tests: per-sequence page lists and lengths."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.page_size = engine.cache.page_size
        self.next_page = 0
        self.pages: dict[str, list[int]] = {}
        self.length: dict[str, int] = {}

    def grow(self, name: str, num_new: int) -> tuple[tuple[int, ...], int]:
        """Allocate pages so `name` holds `num_new` more tokens; returns (page ids, last page length)."""
        pages = self.pages.setdefault(name, [])
        total = self.length.get(name, 0) + num_new
        needed = -(-total // self.page_size) - len(pages)
        if needed > 0:
            new = list(range(self.next_page, self.next_page + needed))
            self.next_page += needed
            self.engine.allocate([Allocate(ResourceKind.KV_PAGE, tuple(new))])
            pages.extend(new)
        self.length[name] = total
        return tuple(pages), total - self.page_size * (len(pages) - 1)

    def item(
        self,
        name: str,
        tokens: list[int],
        positions: list[int] | None = None,
        mask: tuple[tuple[int, ...], ...] = (),
        outputs: tuple[int, ...] | None = None,
        sampler: SamplerSpec | None = None,
    ) -> ForwardText:
        start = self.length.get(name, 0)
        pages, last = self.grow(name, len(tokens))
        outputs = tuple(range(len(tokens))) if outputs is None else outputs
        sampler = sampler or SamplerSpec(SamplerKind.GREEDY)
        positions = positions if positions is not None else list(range(start, start + len(tokens)))
        return ForwardText(
            pages, last, tuple(tokens), tuple(positions), mask, outputs, (sampler,) * len(outputs)
        )


def smaps_fields(address: int, key: str) -> list[str]:
    """The fields after `key` (say "Rss:" or "VmFlags:") of this process's mapping that holds `address`
    (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(a, 16) for a in head.split("-"))
                inside = start <= address < end
            elif inside and head == key:
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")
