"""The executor engine: one model on one device, a paged KV cache, and batched L4M commands.

Every public command method takes one batch (a sequence of items of one command class), validates
the WHOLE batch first and raises a typed `ExecutorError` before touching any state, then applies it.
Batches must be executed one at a time in arrival order (the server runs them on a single worker
thread); fire-and-forget commands from the scheduler rely on that order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from opentelemetry import trace
from opentelemetry.context import Context

from l4m.brle import BrleError, decode_rows
from l4m.executor.attention import ItemLayout, build_decode_plan, build_plan, is_decode_batch
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
    SamplerKind,
    SamplerSpec,
    SampleTopK,
)
from l4m.executor.errors import CapabilityError, ExecutorError, InvalidCommand, UnknownResource
from l4m.executor.kv_cache import KvCache
from l4m.executor.model import LlamaModel
from l4m.executor.quant import kernels_available, load_kernels
from l4m.executor.sampler import apply_samplers, decode_vocab_masks, validate_sampler
from l4m.executor.weights import LoadedModel
from l4m.telemetry import DurationsByKind

_tracer = trace.get_tracer("l4m.executor")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WEIGHT_MODES = ("auto", "dequantized", "quantized")
MAX_AUTO_PAGES = 65536
MAX_CONTINUATION_STEPS = 64  # per forward_text item: bounds how long one batch holds the executor


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
    max_quantized_rows: int = 64  # prefill of 100 tokens: dense 436 tok/s vs quantized 224 (2 threads)
    # With quantized weights, run batches of single-token items (decode steps) through the whole layer
    # stack in one C++ call (`cpu_kernels.decode_layers`); False keeps them on the torch path.
    decode_kernel: bool = True


def resolve_weights(config: EngineConfig, loaded: LoadedModel) -> str:
    """The weight mode an engine with `config` uses: "dequantized" or "quantized"."""
    if config.weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {config.weights!r}")
    fits = torch.device(config.device).type == "cpu" and config.dtype == "float32"
    if config.weights == "quantized":
        if not fits:
            raise ValueError("weights=quantized needs device cpu and dtype float32")
        if not loaded.quantized:
            raise ValueError("weights=quantized needs a GGUF model with Q4_1 / Q8_0 tensors")
        load_kernels()
        return "quantized"
    if config.weights == "auto" and fits and loaded.quantized and kernels_available():
        return "quantized"
    return "dequantized"


def _free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


@contextlib.contextmanager
def _item(index: int) -> Iterator[None]:
    """Tag an error raised while validating item `index` with that index."""
    try:
        yield
    except ExecutorError as exc:
        exc.item_index = index
        raise


@dataclass(frozen=True)
class _PreparedItem:
    layout: ItemLayout
    write_slots: np.ndarray  # [num_new] flat page_id * page_size + offset


class _Continuation:
    """One forward_text item of a batch with continuation: its first pass (the item as if it had no
    continuation slots) and the single-token item of each later step."""

    def __init__(self, item: ForwardText, num_steps: int, written: _PreparedItem, page_size: int,
                 first_total: int) -> None:
        self.item = item
        self.num_steps = num_steps
        self.written = written  # every slot the item may write, for the batch's collision check
        self._page_size = page_size
        self._first_total = first_total
        if num_steps == 0:
            self.first_pass = item
            return
        self.first_pass = dataclasses.replace(
            item, num_continuation_steps=0, continuation_stop_token_ids=frozenset(),
            **self._pages(first_total),
        )

    def _pages(self, total: int) -> dict[str, object]:
        num_pages = -(-total // self._page_size)
        return {"kv_page_ids": self.item.kv_page_ids[:num_pages],
                "kv_last_page_length": total - self._page_size * (num_pages - 1)}

    def stops(self, output: object) -> bool:
        return getattr(output, "token_id", None) in self.item.continuation_stop_token_ids

    def step_item(self, step: int, token_id: int) -> ForwardText:
        """Continuation step `step` (1-based): feed `token_id`, the last one sampled, and sample the next."""
        (sampler,) = self.item.samplers
        if sampler.seed is not None:  # as the SDK numbers a generation's steps: step i draws with seed + i
            sampler = dataclasses.replace(sampler, seed=(sampler.seed + step) % (1 << 64))
        position = self.item.position_ids[-1] + step
        return ForwardText(token_ids=(token_id,), position_ids=(position,), output_indices=(0,),
                           samplers=(sampler,), **self._pages(self._first_total + step))  # type: ignore[arg-type]


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        if config.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {config.dtype!r}")
        if config.page_size < 1 or config.num_embed_slots < 0 or config.num_pages < 0:
            raise ValueError("page_size must be >= 1, num_pages and num_embed_slots >= 0")
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = _DTYPES[config.dtype]
        self.loaded = loaded
        self.weights = resolve_weights(config, loaded)
        self.model = LlamaModel(
            loaded, self.dtype, self.device, self.weights == "quantized", config.max_quantized_rows
        )
        cfg = loaded.config
        num_pages = config.num_pages
        if num_pages == 0:
            per_page = KvCache.bytes_per_page(
                cfg.num_layers, config.page_size, cfg.num_kv_heads, cfg.head_dim, self.dtype
            )
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
        }
        self._num_batches = 0
        self._num_forward_tokens = 0
        self._num_decode_kernel_batches = 0
        # Seconds each batch took in `execute`, by command kind (its class name); read by the metrics.
        self.batch_seconds = DurationsByKind()

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
        with _tracer.start_as_current_span("executor.batch", context=parent, attributes=attributes):
            result = self._handlers[kind](items)
        self._num_batches += 1
        self.batch_seconds.observe(kind.__name__, time.perf_counter() - started)
        return result

    # ---- validation helpers ---------------------------------------------------------------------

    def _check_pages(self, page_ids: Sequence[int], where: str) -> None:
        for page in page_ids:
            if not 0 <= page < self.cache.num_pages:
                raise UnknownResource(
                    f"{where}: kv page {page} is out of range (0..{self.cache.num_pages - 1})"
                )
            if not self.cache.is_page_allocated[page]:
                raise UnknownResource(f"{where}: kv page {page} is not allocated")

    def _check_slots(self, slot_ids: Sequence[int], where: str) -> None:
        for slot in slot_ids:
            if not 0 <= slot < self.cache.num_embed_slots:
                raise UnknownResource(
                    f"{where}: embed slot {slot} is out of range (0..{self.cache.num_embed_slots - 1})"
                )
            if not self.cache.is_slot_allocated[slot]:
                raise UnknownResource(f"{where}: embed slot {slot} is not allocated")

    def _check_tokens(self, token_ids: Sequence[int], where: str) -> None:
        vocab = self.loaded.config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidCommand(f"{where}: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")

    def _check_positions(self, position_ids: Sequence[int], num_tokens: int, where: str) -> None:
        if len(position_ids) != num_tokens:
            raise InvalidCommand(f"{where}: {len(position_ids)} position ids for {num_tokens} tokens")
        max_context = self.loaded.config.max_context
        bad = [p for p in position_ids if not 0 <= p < max_context]
        if bad:
            raise InvalidCommand(
                f"{where}: position id {bad[0]} is outside the model's context (0..{max_context - 1})"
            )

    def _layout(
        self,
        page_ids: Sequence[int],
        last_len: int,
        num_new: int,
        mask_rows: Sequence[Sequence[int]],
        where: str,
    ) -> _PreparedItem:
        """Check an item's pages, lengths and mask rows; where its new tokens go."""
        page_size = self.cache.page_size
        if not page_ids:
            raise InvalidCommand(f"{where}: no kv pages")
        if len(set(page_ids)) != len(page_ids):
            raise InvalidCommand(f"{where}: a kv page appears twice in the item's page list")
        self._check_pages(page_ids, where)
        if not 0 < last_len <= page_size:
            raise InvalidCommand(f"{where}: kv_last_page_length must be in 1..{page_size}, got {last_len}")
        if num_new < 1:
            raise InvalidCommand(f"{where}: no input tokens")
        total = page_size * (len(page_ids) - 1) + last_len
        if num_new > total:
            raise InvalidCommand(
                f"{where}: {num_new} new tokens do not fit in a context of {total} slots "
                "(the pages must already include room for the new tokens)"
            )
        num_ctx = total - num_new
        if mask_rows:
            if len(mask_rows) != num_new:
                raise InvalidCommand(
                    f"{where}: {len(mask_rows)} attention-mask rows for {num_new} tokens (one per token)"
                )
            for i, row in enumerate(mask_rows):
                if any(r < 0 for r in row):
                    raise InvalidCommand(f"{where}: attention-mask row {i} has a negative run")
                if sum(row) != num_ctx + i + 1:
                    raise InvalidCommand(
                        f"{where}: attention-mask row {i} decodes to {sum(row)} values, expected {num_ctx + i + 1} "
                        f"(context {num_ctx} + {i + 1})"
                    )
        slots = np.arange(num_ctx, total)
        write_slots = np.asarray(page_ids, dtype=np.int64)[slots // page_size] * page_size + slots % page_size
        return _PreparedItem(ItemLayout(tuple(page_ids), num_ctx, num_new, tuple(mask_rows)), write_slots)

    @staticmethod
    def _check_outputs(output_indices: Sequence[int], num_new: int, where: str) -> None:
        bad = [j for j in output_indices if not 0 <= j < num_new]
        if bad:
            raise InvalidCommand(f"{where}: output index {bad[0]} is out of range (0..{num_new - 1})")

    def _check_no_write_collision(self, prepared: Sequence[_PreparedItem], kind: str) -> None:
        """Raises, naming the first item that writes a slot an earlier item of the batch writes too
        (an item never writes one slot twice: its pages are distinct)."""
        slots = np.concatenate([p.write_slots for p in prepared])
        if np.unique(slots).size == slots.size:
            return
        owners = np.repeat(np.arange(len(prepared)), [p.write_slots.size for p in prepared])
        order = np.argsort(slots, kind="stable")  # equal slots stay in item order
        repeated = np.flatnonzero(slots[order][1:] == slots[order][:-1]) + 1
        first = repeated[np.argmin(owners[order][repeated])]
        item, earlier = int(owners[order][first]), int(owners[order][first - 1])
        page, offset = divmod(int(slots[order][first]), self.cache.page_size)
        raise InvalidCommand(
            f"{kind} item {item}: writes kv page {page} slot {offset}, the same kv page slot as item {earlier} of this batch",
            item_index=item,
        )

    # ---- resources ------------------------------------------------------------------------------

    def _resource_ids(self, items: Sequence[Allocate | Deallocate], kind: ResourceKind) -> np.ndarray:
        ids = [i for it in items if it.kind == kind for i in it.ids]
        return np.asarray(ids, dtype=np.int64)

    def _check_resource_batch(
        self, items: Sequence[Allocate | Deallocate], should_be_allocated: bool
    ) -> None:
        verb = "deallocate" if should_be_allocated else "allocate"
        seen: dict[ResourceKind, set[int]] = {ResourceKind.KV_PAGE: set(), ResourceKind.EMBED_SLOT: set()}
        for n, it in enumerate(items):
            where = f"{verb} item {n}"
            if not isinstance(it.kind, ResourceKind):
                raise InvalidCommand(f"{where}: unknown resource kind {it.kind!r}", item_index=n)
            if it.kind is ResourceKind.KV_PAGE:
                label, capacity, table = "kv page", self.cache.num_pages, self.cache.is_page_allocated
            else:
                label, capacity, table = "embed slot", self.cache.num_embed_slots, self.cache.is_slot_allocated
            for i in it.ids:
                if not 0 <= i < capacity:
                    raise UnknownResource(f"{where}: {label} {i} is out of range (0..{capacity - 1})", item_index=n)
                if table[i] != should_be_allocated:
                    state = "not allocated" if should_be_allocated else "already allocated"
                    raise InvalidCommand(f"{where}: {label} {i} is {state}", item_index=n)
                if i in seen[it.kind]:
                    raise InvalidCommand(f"{where}: {label} {i} appears twice in the batch", item_index=n)
                seen[it.kind].add(i)

    def reset(self) -> tuple[int, int]:
        """Free every KV page and embedding slot (the scheduler reconnected with empty tables); returns
        how many of each were allocated."""
        return self.cache.free_all()

    def allocate(self, items: Sequence[Allocate]) -> None:
        self._check_resource_batch(items, should_be_allocated=False)
        self.cache.allocate_pages(self._resource_ids(items, ResourceKind.KV_PAGE))
        self.cache.allocate_slots(self._resource_ids(items, ResourceKind.EMBED_SLOT))

    def deallocate(self, items: Sequence[Deallocate]) -> None:
        self._check_resource_batch(items, should_be_allocated=True)
        self.cache.deallocate_pages(self._resource_ids(items, ResourceKind.KV_PAGE))
        self.cache.deallocate_slots(self._resource_ids(items, ResourceKind.EMBED_SLOT))

    # ---- the model paths ------------------------------------------------------------------------

    def _run_model(
        self,
        prepared: Sequence[_PreparedItem],
        hidden: torch.Tensor,
        positions: torch.Tensor,
        output_rows: Sequence[int],
    ) -> torch.Tensor:
        """Plan attention and run the model; `[M, hidden]` normed outputs."""
        layouts = [p.layout for p in prepared]
        self._num_forward_tokens += hidden.shape[0]
        rows = torch.tensor(list(output_rows), dtype=torch.long, device=self.device)
        if self._takes_decode_kernel(layouts):
            self._num_decode_kernel_batches += 1
            plan = build_decode_plan(layouts, self.cache.page_size, self.cache.page_visible)
            return self.model.forward_decode(hidden, positions, plan, self.cache, rows)
        plan = build_plan(layouts, self.cache.page_size, self.cache.page_visible, self.dtype)
        return self.model.forward(hidden, positions, plan, self.cache, rows)

    def _takes_decode_kernel(self, layouts: Sequence[ItemLayout]) -> bool:
        """Single-token items, few enough that the quantized weights serve them (like `Linear`)."""
        return (
            self.config.decode_kernel
            and self.model.has_decode_kernel
            and len(layouts) <= self.config.max_quantized_rows
            and is_decode_batch(layouts)
        )

    def _validate_forward_text_item(self, item: ForwardText, where: str) -> _PreparedItem:
        p = self._layout(
            item.kv_page_ids, item.kv_last_page_length, len(item.token_ids), item.attention_mask, where
        )
        self._check_tokens(item.token_ids, where)
        self._check_positions(item.position_ids, len(item.token_ids), where)
        self._check_outputs(item.output_indices, len(item.token_ids), where)
        if len(item.samplers) != len(item.output_indices):
            raise InvalidCommand(
                f"{where}: {len(item.samplers)} samplers for {len(item.output_indices)} output indices (one each)"
            )
        for j, spec in enumerate(item.samplers):
            validate_sampler(spec, self.loaded.config.vocab_size, f"{where} sampler {j}")
        return p

    def _vocab_masks(
        self, items: Sequence[ForwardText], specs: Sequence[SamplerSpec], wheres: Sequence[str]
    ) -> np.ndarray | None:
        """The batch's decoded vocabulary masks; a bad mask is blamed on its item (each item is decoded
        alone only then, to find it)."""
        vocab = self.loaded.config.vocab_size
        try:
            return decode_vocab_masks(specs, vocab, wheres)
        except InvalidCommand:
            for n, item in enumerate(items):
                with _item(n):
                    decode_vocab_masks(item.samplers, vocab, [f"forward_text item {n} sampler {j}"
                                                             for j in range(len(item.samplers))])
            raise

    def _check_batch_tokens(self, num_tokens: int) -> None:
        if num_tokens > self.config.max_batch_tokens:
            raise InvalidCommand(
                f"the batch carries {num_tokens} new tokens, more than max_batch_tokens={self.config.max_batch_tokens}"
            )

    def forward_text(self, items: Sequence[ForwardText]) -> list[ForwardTextResult]:
        """One forward pass over every item; items with continuation steps then decode on, all of them
        together, one batched step at a time, until each has run its steps or sampled a stop token."""
        if not any(item.num_continuation_steps for item in items):
            return self._forward_text_once(items)
        steps = []
        for n, item in enumerate(items):
            with _item(n):
                steps.append(self._continuation_plan(item, f"forward_text item {n}"))
        self._check_no_write_collision([plan.written for plan in steps], "forward_text")
        results = self._forward_text_once([plan.first_pass for plan in steps])
        outputs = [list(result.outputs) for result in results]
        active = [n for n, plan in enumerate(steps) if plan.num_steps and not plan.stops(outputs[n][-1])]
        step = 0
        while active:
            step += 1
            answers = self._forward_text_once([steps[n].step_item(step, outputs[n][-1].token_id) for n in active])
            for n, answer in zip(active, answers, strict=True):
                outputs[n].append(answer.outputs[0])
            active = [n for n in active if steps[n].num_steps > step and not steps[n].stops(outputs[n][-1])]
        return [ForwardTextResult(tuple(o)) for o in outputs]

    def _continuation_plan(self, item: ForwardText, where: str) -> _Continuation:
        """Checks what continuation needs beyond a plain forward_text (see common.proto); the first pass is
        the item without its continuation slots."""
        num_steps, num_tokens = item.num_continuation_steps, len(item.token_ids)
        if num_steps == 0:
            prepared = self._layout(item.kv_page_ids, item.kv_last_page_length, max(num_tokens, 1), (), where)
            return _Continuation(item, 0, prepared, self.cache.page_size, 0)
        if num_steps > MAX_CONTINUATION_STEPS:
            raise InvalidCommand(f"{where}: {num_steps} continuation steps, more than {MAX_CONTINUATION_STEPS}")
        if item.attention_mask:
            raise InvalidCommand(f"{where}: continuation needs plain causal attention (no attention masks)")
        if tuple(item.output_indices) != (num_tokens - 1,):
            raise InvalidCommand(
                f"{where}: continuation needs exactly one output index, the last token's ({num_tokens - 1}), "
                f"not {list(item.output_indices)}"
            )
        (sampler,) = item.samplers or (None,)
        if sampler is None or sampler.kind not in (SamplerKind.GREEDY, SamplerKind.SAMPLE) or sampler.vocab_mask:
            raise InvalidCommand(
                f"{where}: continuation needs a GREEDY or SAMPLE sampler without a vocabulary mask (its token is fed back)"
            )
        self._check_tokens(tuple(item.continuation_stop_token_ids), f"{where} continuation_stop_token_ids")
        if item.position_ids:
            max_context = self.loaded.config.max_context
            if item.position_ids[-1] + num_steps >= max_context:
                raise InvalidCommand(
                    f"{where}: {num_steps} continuation steps after position {item.position_ids[-1]} pass the "
                    f"model's context ({max_context} positions)"
                )
        # Pages, room and write slots of everything the item may write, the continuation included.
        prepared = self._layout(item.kv_page_ids, item.kv_last_page_length, num_tokens + num_steps, (), where)
        first_total = prepared.layout.num_ctx + num_tokens
        return _Continuation(item, num_steps, prepared, self.cache.page_size, first_total)

    def _forward_text_once(self, items: Sequence[ForwardText]) -> list[ForwardTextResult]:
        with torch.inference_mode():
            with _tracer.start_as_current_span("prepare"):
                prepared, output_rows, specs, wheres = [], [], [], []
                offset = 0
                for n, item in enumerate(items):
                    where = f"forward_text item {n}"
                    with _item(n):
                        p = self._validate_forward_text_item(item, where)
                    for j in range(len(item.samplers)):
                        wheres.append(f"{where} sampler {j}")
                    prepared.append(p)
                    output_rows.extend(offset + j for j in item.output_indices)
                    specs.extend(item.samplers)
                    offset += len(item.token_ids)
                self._check_batch_tokens(offset)
                self._check_no_write_collision(prepared, "forward_text")
                allowed = self._vocab_masks(items, specs, wheres)
                tokens = torch.tensor(
                    [t for it in items for t in it.token_ids], dtype=torch.long, device=self.device
                )
                positions = torch.tensor(
                    [p for it in items for p in it.position_ids], dtype=torch.long, device=self.device
                )
            with _tracer.start_as_current_span("forward"):
                normed = self._run_model(prepared, self.model.embed_tokens(tokens), positions, output_rows)
                logits = self.model.logits(normed) if specs else None
            with _tracer.start_as_current_span("sample"):
                outputs = apply_samplers(logits, specs, allowed) if specs else []
        results, start = [], 0
        for item in items:
            results.append(ForwardTextResult(tuple(outputs[start : start + len(item.output_indices)])))
            start += len(item.output_indices)
        return results

    def forward(self, items: Sequence[Forward]) -> None:
        with torch.inference_mode():
            with _tracer.start_as_current_span("prepare"):
                prepared, output_rows, output_slots, offset = [], [], [], 0
                for n, item in enumerate(items):
                    where = f"forward item {n}"
                    with _item(n):
                        self._check_slots(item.input_slot_ids, where)
                        p = self._layout(
                            item.kv_page_ids, item.kv_last_page_length, len(item.input_slot_ids), (), where
                        )
                        self._check_outputs(item.output_indices, len(item.input_slot_ids), where)
                        if len(item.output_slot_ids) != len(item.output_indices):
                            raise InvalidCommand(
                                f"{where}: {len(item.output_slot_ids)} output slots for {len(item.output_indices)} output indices"
                            )
                        self._check_slots(item.output_slot_ids, where)
                    prepared.append(p)
                    output_rows.extend(offset + j for j in item.output_indices)
                    output_slots.extend(item.output_slot_ids)
                    offset += len(item.input_slot_ids)
                self._check_batch_tokens(offset)
                self._check_no_write_collision(prepared, "forward")
                inputs = torch.tensor(
                    [s for it in items for s in it.input_slot_ids], dtype=torch.long, device=self.device
                )
                hidden = self.cache.embeds[inputs]
                positions = self.cache.embed_positions[inputs]
            with _tracer.start_as_current_span("forward"):
                normed = self._run_model(prepared, hidden, positions, output_rows)
                if output_slots:
                    self.cache.embeds[torch.tensor(output_slots, device=self.device)] = normed

    def embed_text(self, items: Sequence[EmbedText]) -> None:
        for n, item in enumerate(items):
            where = f"embed_text item {n}"
            with _item(n):
                if len(item.slot_ids) != len(item.token_ids):
                    raise InvalidCommand(
                        f"{where}: {len(item.slot_ids)} slots for {len(item.token_ids)} tokens"
                    )
                self._check_slots(item.slot_ids, where)
                self._check_tokens(item.token_ids, where)
                self._check_positions(item.position_ids, len(item.token_ids), where)
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
            with _item(n):
                self._check_slots([item.slot_id], f"sample_top_k item {n}")
                if not 0 < item.k <= vocab:
                    raise InvalidCommand(f"sample_top_k item {n}: k must be in 1..{vocab}, got {item.k}")
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
        page_size = self.cache.page_size
        for n, item in enumerate(items):
            with _item(n):
                self._check_copy(item, f"copy_kv_page item {n}", page_size)
        with torch.inference_mode():
            for item in items:  # in order: a later copy may read what an earlier one wrote
                self.cache.copy_slots(
                    item.src_page_id, item.dst_page_id, item.src_offset, item.dst_offset, item.length
                )

    def _check_copy(self, item: CopyKvPage, where: str, page_size: int) -> None:
        self._check_pages([item.src_page_id, item.dst_page_id], where)
        for name, offset in (("src_offset", item.src_offset), ("dst_offset", item.dst_offset)):
            if not offset >= 0 or offset + item.length > page_size:
                raise InvalidCommand(
                    f"{where}: {name} {offset} + length {item.length} leaves the page (page_size {page_size})"
                )
        if item.length < 0:
            raise InvalidCommand(f"{where}: length must be >= 0, got {item.length}")

    def mask_kv_page(self, items: Sequence[MaskKvPage]) -> None:
        """Set each page's slot visibility to its BRLE (first run visible); later attention ANDs it in."""
        page_size = self.cache.page_size
        for n, item in enumerate(items):
            where = f"mask_kv_page item {n}"
            with _item(n):
                self._check_pages([item.page_id], where)
                if any(r < 0 for r in item.mask) or sum(item.mask) != page_size:
                    raise InvalidCommand(
                        f"{where}: mask must decode to exactly page_size={page_size} values, got {sum(item.mask)}"
                    )
        try:
            decoded = decode_rows([it.mask for it in items], page_size)
        except BrleError as exc:
            for n, item in enumerate(items):  # blame the item whose mask does not decode alone
                try:
                    decode_rows([item.mask], page_size)
                except BrleError as item_exc:
                    raise InvalidCommand(f"mask_kv_page item {n}: {item_exc}", item_index=n) from item_exc
            raise InvalidCommand(f"mask_kv_page: {exc}") from exc
        rows = torch.from_numpy(decoded).to(self.device)
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
                    "num_kv_pages_allocated": self.cache.num_pages - self.cache.num_free_pages,
                    "num_embed_slots_allocated": self.cache.num_embed_slots - self.cache.num_free_slots,
                    "device": str(self.device),
                    "weights": self.weights,
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
            architecture="llama",
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
            capabilities=("text",),
            max_batch_tokens=self.config.max_batch_tokens,
        )
