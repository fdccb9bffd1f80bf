"""The executor engine: one model on one device, a paged KV cache, and batched L4M commands.

Every public command method takes one batch (a sequence of items of one command class), validates
the WHOLE batch first and raises a typed `ExecutorError` before touching any state, then applies it.
Batches must be executed one at a time in arrival order (the server runs them on a single worker
thread); fire-and-forget commands from the scheduler rely on that order.

This module is the dispatch: it drives the tensors. The checks are pure functions in `checks.py`, the
continuation decode loop is `continuation.py`, and the configuration is `config.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from opentelemetry import trace
from opentelemetry.context import Context

from l4m.common.metrics import DurationsByKind
from l4m.executor.attention import ItemLayout, build_decode_plan, build_plan, is_decode_batch, split_mixed
from l4m.executor.checks import (
    PreparedItem,
    blame_item,
    check_batch_tokens,
    check_copy,
    check_embed_text_item,
    check_forward_item,
    check_forward_text_item,
    check_no_write_collision,
    check_page_mask,
    check_resource_batch,
    check_sample_top_k_item,
    decode_batch_vocab_masks,
    decode_page_masks,
)
from l4m.executor.commands import (
    Allocate,
    CopyKvPage,
    Deallocate,
    DebugQuery,
    Distribution,
    EmbedImage,
    EmbedText,
    ExecutorInfo,
    Forward,
    ForwardText,
    ForwardTextResult,
    MaskKvPage,
    ResourceKind,
    SampleTopK,
    SwapIn,
    SwapOut,
)
from l4m.executor.config import (
    MAX_AUTO_SWAP_BYTES,
    EngineConfig,
    resolve_bf16_x,
    resolve_kv_cache_dtype,
    resolve_max_quantized_rows,
    resolve_weights,
)
from l4m.executor.continuation import (
    Continuation,
    plan_continuations,
    run_continuations,
    run_continuations_on_device,
)
from l4m.executor.decode_graphs import StaticDecoder
from l4m.executor.decode_ops import TritonOps, supports, triton_available
from l4m.executor.errors import CapabilityError, InvalidCommand, UnknownResource
from l4m.executor.kv_cache import KvCache
from l4m.executor.model import LlamaModel
from l4m.executor.sampler import apply_samplers
from l4m.executor.weights import LoadedModel
from l4m.telemetry import tracing_enabled
from l4m.wire import rules

_tracer = trace.get_tracer("l4m.executor")
_NO_SPAN = contextlib.nullcontext()


def _span(name: str, **kwargs: Any) -> contextlib.AbstractContextManager[object]:
    """`_tracer.start_as_current_span(name, ...)`, or nothing while no tracer provider records spans (the
    module's tracer is the API's proxy, and no real provider is installed): a no-op span still costs its
    context set-up, ~4 us, and a batch of every decode step opens four."""
    if isinstance(_tracer, trace.ProxyTracer) and not tracing_enabled():
        return _NO_SPAN
    return _tracer.start_as_current_span(name, **kwargs)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MAX_AUTO_PAGES = 65536


def _free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, static_ops: type | None = None) -> None:
        """`static_ops` runs decode batches through the static step with those ops on any device,
        eagerly off CUDA (the CPU tests pass `decode_ops.TorchOps`); by default that path is CUDA's,
        with `decode_ops.TritonOps` and graphs."""
        if config.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {config.dtype!r}")
        if config.page_size < 1 or config.num_embed_slots < 0 or config.num_pages < 0:
            raise ValueError("page_size must be >= 1, num_pages and num_embed_slots >= 0")
        if config.swap_space_pages < -1:
            raise ValueError(f"swap_space_pages must be -1 (auto), 0 (off) or more, got {config.swap_space_pages}")
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = _DTYPES[config.dtype]
        # K/V as the dtype, or float16 (the operator's opt-in, `kv_cache_dtype`); checked before the weights load.
        self.kv_dtype = resolve_kv_cache_dtype(config, self.dtype)
        self.weights = resolve_weights(config, loaded)
        quantized = self.weights == "quantized"
        isa = torch.ops.l4m_cpu.isa() if quantized else ""  # the CPU kernels' instruction set (loaded with the blocks)
        # Calls of up to this many tokens multiply with the GGUF blocks (the rest with dense weights).
        self.max_quantized_rows = resolve_max_quantized_rows(config, isa) if quantized else 0
        # The blocks' products on x rounded to bf16 (the operator's opt-in, `quantized_activations`).
        self.bf16_x = resolve_bf16_x(config, self.weights, isa)
        # Where the blocks serve every batch this engine accepts, the linears keep no dense copy.
        self.dense_linears = not quantized or self.max_quantized_rows < config.max_batch_tokens
        self.model = LlamaModel(
            loaded, self.dtype, self.device, quantized, self.max_quantized_rows, self.dense_linears, self.bf16_x
        )
        # The model holds what it uses (the blocks on huge pages, the weights it multiplies with): neither
        # the loaded blocks nor the loaded float32 tensors are kept here.
        self.loaded = dataclasses.replace(loaded, quantized={}, tensors={})
        # Plain greedy batches sample in one call of the CPU kernels (loaded with the quantized weights).
        self._greedy = torch.ops.l4m_cpu.greedy if quantized else None
        cfg = loaded.config
        self.graphs_off_reason = None if static_ops else self._graphs_off_reason(config, cfg)
        num_pages = config.num_pages
        per_page = KvCache.bytes_per_page(cfg.num_layers, config.page_size, cfg.num_kv_heads, cfg.head_dim,
                                          self.kv_dtype)
        if num_pages == 0:
            num_pages = max(
                1,
                min(
                    MAX_AUTO_PAGES, int(_free_memory_bytes(self.device) * config.memory_fraction) // per_page
                ),
            )
        self.cache = KvCache(
            cfg.num_layers,
            num_pages,
            config.page_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            config.num_embed_slots,
            cfg.hidden_size,
            self.dtype,
            self.device,
            scratch_pages=0 if self.graphs_off_reason else 1,
            num_swap_slots=(min(num_pages, MAX_AUTO_SWAP_BYTES // per_page) if config.swap_space_pages == -1
                            else config.swap_space_pages),
            kv_dtype=self.kv_dtype,
        )
        self.static_decoder = (
            None
            if self.graphs_off_reason
            else StaticDecoder(self.model, self.cache, static_ops or TritonOps, config.graph_max_batch, graphs=True)
        )
        self._handlers: dict[type, Callable[[Sequence], object]] = {
            Allocate: self.allocate,
            Deallocate: self.deallocate,
            EmbedText: self.embed_text,
            Forward: self.forward,
            ForwardText: self.forward_text,
            SampleTopK: self.sample_top_k,
            CopyKvPage: self.copy_kv_page,
            MaskKvPage: self.mask_kv_page,
            EmbedImage: self.embed_image,
            DebugQuery: self.debug_query,
            SwapOut: self.swap_out,
            SwapIn: self.swap_in,
        }
        self._num_batches = 0
        self._num_forward_tokens = 0
        # (graphs, seconds) captured while the engine was built (EngineConfig.capture_graphs_at_start).
        self.captured_at_start = self.capture_decode_graphs() if config.capture_graphs_at_start else (0, 0.0)
        self._num_decode_kernel_batches = 0
        self._num_mixed_kernel_batches = 0
        self._num_graph_batches = 0
        self._num_device_continuation_steps = 0
        # Seconds each batch took in `execute`, by command kind (its class name); read by the metrics.
        self.batch_seconds = DurationsByKind()

    def capture_decode_graphs(self) -> tuple[int, float]:
        """Capture every decode-graph bucket now (`StaticDecoder.capture_all`): (graphs captured, seconds);
        (0, 0.0) where decode steps do not run as graphs."""
        if self.static_decoder is None:
            return 0, 0.0
        with torch.inference_mode():
            return self.static_decoder.capture_all(rules.MAX_CONTINUATION_STEPS)

    def _graphs_off_reason(self, config: EngineConfig, cfg) -> str | None:
        """Why decode steps do not run as CUDA graphs here, or None when they do."""
        if self.device.type != "cuda":
            return f"device {self.device} is not CUDA"
        if not config.decode_graphs:
            return "decode_graphs is off"
        if not triton_available():
            return "Triton is not installed"
        return supports(config.page_size, cfg.head_dim)

    # ---- dispatch -------------------------------------------------------------------------------

    def execute(self, items: Sequence[object], parent: Context | None = None) -> object:
        """Run one batch under an `executor.batch` span (child of `parent`, the batch's trace context)."""
        if not items:
            raise InvalidCommand("empty batch")
        kind = type(items[0])
        if kind not in self._handlers or any(type(it) is not kind for it in items):
            raise InvalidCommand("a batch holds items of exactly one command kind")
        attributes = {"l4m.batch.kind": kind.__name__, "l4m.batch.size": len(items)}
        started = time.perf_counter()
        with _span("executor.batch", context=parent, attributes=attributes):
            result = self._handlers[kind](items)
        self._num_batches += 1
        self.batch_seconds.observe(kind.__name__, time.perf_counter() - started)
        return result

    # ---- resources ------------------------------------------------------------------------------

    def _resource_ids(self, items: Sequence[Allocate | Deallocate], kind: ResourceKind) -> np.ndarray:
        ids = [i for it in items if it.kind == kind for i in it.ids]
        return np.asarray(ids, dtype=np.int64)

    def reset(self) -> tuple[int, int]:
        """Free every KV page and embedding slot (the scheduler reconnected with empty tables); returns
        how many of each were allocated."""
        return self.cache.free_all()

    def allocate(self, items: Sequence[Allocate]) -> None:
        check_resource_batch(items, self.cache, should_be_allocated=False)
        self.cache.allocate_pages(self._resource_ids(items, ResourceKind.KV_PAGE))
        self.cache.allocate_slots(self._resource_ids(items, ResourceKind.EMBED_SLOT))

    def deallocate(self, items: Sequence[Deallocate]) -> None:
        check_resource_batch(items, self.cache, should_be_allocated=True)
        self.cache.deallocate_pages(self._resource_ids(items, ResourceKind.KV_PAGE))
        self.cache.deallocate_slots(self._resource_ids(items, ResourceKind.EMBED_SLOT))

    def swap_out(self, items: Sequence[SwapOut]) -> None:
        """Preemption: copy allocated pages to host swap slots and free them."""
        pages, slots = self._check_swap(items, "swap_out", pages_allocated=True)
        with torch.inference_mode():
            self.cache.swap_out(pages, slots)

    def swap_in(self, items: Sequence[SwapIn]) -> None:
        """Resumption: allocate free pages and fill them from host swap slots."""
        pages, slots = self._check_swap(items, "swap_in", pages_allocated=False)
        with torch.inference_mode():
            self.cache.swap_in(pages, slots)

    def _check_swap(
        self, items: Sequence[SwapOut | SwapIn], verb: str, pages_allocated: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """The batch's (pages, slots), after checking every id before anything is copied: pages and slots
        pair up, are in range, appear once, and the pages are allocated (swap_out) or free (swap_in)."""
        cache, seen_pages, seen_slots = self.cache, set(), set()
        for n, item in enumerate(items):
            where = f"{verb} item {n}"
            if len(item.page_ids) != len(item.swap_slot_ids):
                raise InvalidCommand(f"{where}: {len(item.page_ids)} kv pages but {len(item.swap_slot_ids)} swap "
                                     f"slots; they pair up by position", item_index=n)
            for page, slot in zip(item.page_ids, item.swap_slot_ids, strict=True):
                if not 0 <= page < cache.num_pages:
                    raise UnknownResource(f"{where}: kv page {page} is out of range (0..{cache.num_pages - 1})",
                                          item_index=n)
                if not 0 <= slot < cache.num_swap_slots:
                    raise UnknownResource(f"{where}: swap slot {slot} is out of range "
                                          f"({cache.num_swap_slots} swap slots)", item_index=n)
                if bool(cache.is_page_allocated[page]) != pages_allocated:
                    state = "not allocated" if pages_allocated else "allocated"
                    raise InvalidCommand(f"{where}: kv page {page} is {state}", item_index=n)
                if page in seen_pages or slot in seen_slots:
                    raise InvalidCommand(f"{where}: kv page {page} or swap slot {slot} appears twice in the batch",
                                         item_index=n)
                seen_pages.add(page)
                seen_slots.add(slot)
        pages = np.asarray([p for item in items for p in item.page_ids], dtype=np.int64)
        slots = np.asarray([s for item in items for s in item.swap_slot_ids], dtype=np.int64)
        return pages, slots

    # ---- the model paths ------------------------------------------------------------------------

    def _run_model(
        self,
        prepared: Sequence[PreparedItem],
        hidden: torch.Tensor,
        positions: torch.Tensor,
        output_rows: Sequence[int],
    ) -> torch.Tensor:
        """Plan attention and run the model; `[M, hidden]` normed outputs."""
        layouts = [p.layout for p in prepared]
        self._num_forward_tokens += hidden.shape[0]
        rows = torch.tensor(list(output_rows), dtype=torch.long, device=self.device)
        if (
            self.static_decoder is not None
            and is_decode_batch(layouts)
            and self.static_decoder.bucket(layouts) is not None
        ):
            self._num_graph_batches += 1
            return self.static_decoder.run(layouts, hidden, positions, rows)
        positions = positions.to(self.device)
        window = self.model.config.sliding_window
        if self._takes_decode_kernel(layouts):
            self._num_decode_kernel_batches += 1
            plan = build_decode_plan(layouts, self.cache.page_size, self.cache.page_visible, window)
            return self.model.forward_decode(hidden, positions, plan, self.cache, rows)
        kernels = self._kernels_serve(hidden.shape[0])
        plan = build_plan(layouts, self.cache.page_size, self.cache.page_visible, self.dtype, window,
                          decode_apart=kernels)
        split = split_mixed(plan) if kernels else None
        if split is not None:
            self._num_mixed_kernel_batches += 1
            return self.model.forward_mixed(hidden, positions, plan, split, self.cache, rows)
        return self.model.forward(hidden, positions, plan, self.cache, rows)

    def _takes_decode_kernel(self, layouts: Sequence[ItemLayout]) -> bool:
        """Single-token items, few enough that the quantized weights serve them (like `Linear`)."""
        return self._kernels_serve(len(layouts)) and is_decode_batch(layouts)

    def _kernels_serve(self, num_tokens: int) -> bool:
        """Few enough tokens that the quantized weights serve them (like `Linear`): the C++ stack can
        run the batch, all of it or its decode steps beside one prefill chunk (`attention.split_mixed`)."""
        return (
            self.config.decode_kernel
            and self.model.has_decode_kernel
            and num_tokens <= self.max_quantized_rows
        )

    def forward_text(self, items: Sequence[ForwardText]) -> list[ForwardTextResult]:
        """One forward pass over every item; items with continuation steps then decode on, all of them
        together, one batched step at a time, until each has run its steps or sampled a stop token."""
        if not any(item.num_continuation_steps for item in items):
            return self._forward_text_once(items)
        plans = plan_continuations(items, self.cache, self.loaded.config)
        if self._continues_on_device(plans):
            return run_continuations_on_device(plans, self._forward_text_once, self._continue_greedy)
        return run_continuations(plans, self._forward_text_once)

    def _continuation_layouts(self, plans: Sequence[Continuation]) -> list[ItemLayout]:
        return [ItemLayout(plan.item.kv_page_ids, plan.first_total, 1, ()) for plan in plans]

    def _continues_on_device(self, plans: Sequence[Continuation]) -> bool:
        """Greedy continuation of a batch that fits the decode graphs' buckets runs on the device."""
        going = [plan for plan in plans if plan.num_steps]
        return (
            self.static_decoder is not None
            and all(plan.greedy for plan in going)
            and self.static_decoder.bucket(self._continuation_layouts(going)) is not None
        )

    def _continue_greedy(self, plans: Sequence[Continuation], tokens: Sequence[int]) -> list[list[tuple[int, float]]]:
        assert self.static_decoder is not None
        with torch.inference_mode():
            steps = self.static_decoder.continue_greedy(
                self._continuation_layouts(plans),
                tokens,
                [rules.continuation_position(plan.item.position_ids[-1], 1) for plan in plans],
                [plan.num_steps for plan in plans],
                [plan.item.continuation_stop_token_ids for plan in plans],
                rules.MAX_CONTINUATION_STEPS,
            )
        ran = sum(len(s) for s in steps)
        self._num_device_continuation_steps += ran
        self._num_forward_tokens += ran
        return steps

    def _forward_text_once(self, items: Sequence[ForwardText]) -> list[ForwardTextResult]:
        with torch.inference_mode():
            with _span("prepare"):
                prepared, output_rows, specs = [], [], []
                offset = 0
                for n, item in enumerate(items):
                    with blame_item(n):
                        p = check_forward_text_item(item, self.cache, self.loaded.config, f"forward_text item {n}")
                    prepared.append(p)
                    output_rows.extend(offset + j for j in item.output_indices)
                    specs.extend(item.samplers)
                    offset += len(item.token_ids)
                check_batch_tokens(offset, self.config.max_batch_tokens)
                check_no_write_collision(prepared, self.cache.page_size, "forward_text")
                allowed = decode_batch_vocab_masks(items, specs, self.loaded.config.vocab_size)
                tokens = torch.tensor(
                    [t for it in items for t in it.token_ids], dtype=torch.long, device=self.device
                )
                # On the host: the static decoder reads them there, the per-op path moves them.
                positions = torch.tensor([p for it in items for p in it.position_ids], dtype=torch.long)
            with _span("forward"):
                normed = self._run_model(prepared, self.model.embed_tokens(tokens), positions, output_rows)
                logits = self.model.logits(normed) if specs else None
            with _span("sample"):
                outputs = apply_samplers(logits, specs, allowed, self._greedy) if specs else []
        results, start = [], 0
        for item in items:
            results.append(ForwardTextResult(tuple(outputs[start : start + len(item.output_indices)])))
            start += len(item.output_indices)
        return results

    def forward(self, items: Sequence[Forward]) -> None:
        with torch.inference_mode():
            with _span("prepare"):
                prepared, output_rows, output_slots, offset = [], [], [], 0
                for n, item in enumerate(items):
                    where = f"forward item {n}"
                    with blame_item(n):
                        p = check_forward_item(item, self.cache, where)
                    prepared.append(p)
                    output_rows.extend(offset + j for j in item.output_indices)
                    output_slots.extend(item.output_slot_ids)
                    offset += len(item.input_slot_ids)
                check_batch_tokens(offset, self.config.max_batch_tokens)
                check_no_write_collision(prepared, self.cache.page_size, "forward")
                inputs = torch.tensor(
                    [s for it in items for s in it.input_slot_ids], dtype=torch.long, device=self.device
                )
                hidden = self.cache.embeds[inputs]
                positions = self.cache.embed_positions[inputs]
            with _span("forward"):
                normed = self._run_model(prepared, hidden, positions, output_rows)
                if output_slots:
                    self.cache.embeds[torch.tensor(output_slots, device=self.device)] = normed

    def embed_text(self, items: Sequence[EmbedText]) -> None:
        for n, item in enumerate(items):
            with blame_item(n):
                check_embed_text_item(item, self.cache, self.loaded.config, f"embed_text item {n}")
        slots = torch.tensor([s for it in items for s in it.slot_ids], dtype=torch.long, device=self.device)
        tokens = torch.tensor([t for it in items for t in it.token_ids], dtype=torch.long, device=self.device)
        positions = torch.tensor(
            [p for it in items for p in it.position_ids], dtype=torch.long, device=self.device
        )
        with torch.inference_mode():
            self.cache.embeds[slots] = self.model.embed_tokens(tokens)
            self.cache.embed_positions[slots] = positions

    def sample_top_k(self, items: Sequence[SampleTopK]) -> list[Distribution]:
        vocab = self.loaded.config.vocab_size
        for n, item in enumerate(items):
            with blame_item(n):
                check_sample_top_k_item(item, self.cache, vocab, f"sample_top_k item {n}")
        with torch.inference_mode():
            slots = torch.tensor([it.slot_id for it in items], dtype=torch.long, device=self.device)
            probs = torch.softmax(self.model.logits(self.cache.embeds[slots]), dim=-1)
            top_probs, top_ids = probs.topk(max(it.k for it in items), dim=-1, sorted=True)
            top_probs, top_ids = top_probs.cpu().tolist(), top_ids.cpu().tolist()
        return [
            Distribution(tuple(top_ids[r][: it.k]), tuple(top_probs[r][: it.k])) for r, it in enumerate(items)
        ]

    # ---- page surgery ---------------------------------------------------------------------------

    def copy_kv_page(self, items: Sequence[CopyKvPage]) -> None:
        for n, item in enumerate(items):
            with blame_item(n):
                check_copy(item, self.cache, f"copy_kv_page item {n}")
        with torch.inference_mode():
            for item in items:  # in order: a later copy may read what an earlier one wrote
                self.cache.copy_slots(
                    item.src_page_id, item.dst_page_id, item.src_offset, item.dst_offset, item.length
                )

    def mask_kv_page(self, items: Sequence[MaskKvPage]) -> None:
        """Set each page's slot visibility to its BRLE (first run visible); later attention ANDs it in."""
        for n, item in enumerate(items):
            with blame_item(n):
                check_page_mask(item, self.cache, f"mask_kv_page item {n}")
        rows = torch.from_numpy(decode_page_masks(items, self.cache.page_size)).to(self.device)
        for item, row in zip(items, rows, strict=True):  # in order: the last mask of a page wins
            self.cache.page_visible[item.page_id] = row

    def debug_query(self, items: Sequence[DebugQuery]) -> list[str]:
        answers = []
        for item in items:
            if item.query == "ping":
                answers.append("pong")
            elif item.query == "stats":
                stats = {
                    "num_batches": self._num_batches,
                    "num_forward_tokens": self._num_forward_tokens,
                    "num_decode_kernel_batches": self._num_decode_kernel_batches,
                    "num_mixed_kernel_batches": self._num_mixed_kernel_batches,
                    "num_graph_batches": self._num_graph_batches,
                    "num_device_continuation_steps": self._num_device_continuation_steps,
                    "num_decode_graphs": self.static_decoder.num_graphs if self.static_decoder else 0,
                    "decode_graphs_off": self.graphs_off_reason,
                    "num_kv_pages_allocated": self.cache.num_pages - self.cache.num_free_pages,
                    "num_embed_slots_allocated": self.cache.num_embed_slots - self.cache.num_free_slots,
                    "device": str(self.device),
                    "weights": self.weights,
                    # The products with the GGUF blocks: x as float32, or rounded to bf16 (the operator's flag)
                    "quantized_activations": "bfloat16" if self.bf16_x else "float32",
                    # The KV cache's element type: the dtype's, or float16 (the operator's flag)
                    "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
                }
                if self.device.type == "cuda":
                    stats["device_memory_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
                answers.append(json.dumps(stats))
            else:
                answers.append(f"unknown query {item.query!r}; known: ping, stats")
        return answers

    def embed_image(self, items: Sequence[EmbedImage]) -> None:
        raise CapabilityError(
            f"embed_image: model {self.loaded.config.name!r} is text-only (no vision encoder)"
        )

    # ---- info -----------------------------------------------------------------------------------

    def get_info(self) -> ExecutorInfo:
        cfg = self.loaded.config
        tok = self.loaded.tokenizer
        return ExecutorInfo(
            model_name=cfg.name,
            architecture=cfg.architecture,
            num_layers=cfg.num_layers,
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            vocab_size=cfg.vocab_size,
            max_context=cfg.max_context,
            page_size=self.cache.page_size,
            num_kv_pages=self.cache.num_pages,
            num_embed_slots=self.cache.num_embed_slots,
            num_free_kv_pages=self.cache.num_free_pages,
            num_free_embed_slots=self.cache.num_free_slots,
            device=str(self.device),
            dtype=self.config.dtype,
            tokenizer_json=tok.to_json(),
            special_tokens=dict(tok.special_tokens),
            eos_token_ids=tok.eos_token_ids,
            chat_template=tok.chat_template,
            chat_template_variables=tok.chat_template_variables(),
            capabilities=("text",),
            max_batch_tokens=self.config.max_batch_tokens,
            num_swap_slots=self.cache.num_swap_slots,
        )
