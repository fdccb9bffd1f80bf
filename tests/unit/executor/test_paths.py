"""copy_kv_page, the embed_text -> forward -> sample_top_k path, get_info, spans."""

from __future__ import annotations

import pytest
import torch
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from l4m.executor import engine as engine_module
from l4m.executor.commands import (
    Allocate,
    CopyKvPage,
    EmbedText,
    Forward,
    ResourceKind,
    SamplerKind,
    SamplerSpec,
    SampleTopK,
)
from tests.unit.executor.conftest import LogitsRecorder, PageTables, cpu_only
from tests.unit.executor.reference import reference_logits


# The cache as the dtype keeps it, and as float16 (the operator's --kv-cache-dtype, CPU only; its logits are held
# to 0.1 of the reference, test_kv_cache_float16.py): a copy moves K/V bit for bit either way.
@pytest.mark.parametrize(("kv_cache_dtype", "tolerance"), [("auto", 1e-3), pytest.param("float16", 0.1, marks=cpu_only)])
def test_copy_kv_page_moves_a_prefix(make_engine, loaded, prompts, kv_cache_dtype, tolerance) -> None:
    engine = make_engine(page_size=4, kv_cache_dtype=kv_cache_dtype)
    tables = PageTables(engine)
    prompt = prompts[2][:11]
    engine.forward_text([tables.item("src", prompt[:10], outputs=())])  # pages hold 4 + 4 + 2
    src = tables.pages["src"]
    engine.allocate([Allocate(ResourceKind.KV_PAGE, (100, 101, 102))])
    engine.copy_kv_page(
        [
            CopyKvPage(src[0], 100, 0, 0, 4),
            CopyKvPage(src[1], 101, 0, 0, 2),
            CopyKvPage(src[1], 101, 2, 2, 2),
            CopyKvPage(src[2], 102, 0, 0, 2),
        ]
    )
    recorder = LogitsRecorder(engine)
    engine.forward_text([tables.item("src", prompt[10:])])
    from l4m.executor.commands import ForwardText

    engine.forward_text([ForwardText((100, 101, 102), 3, (prompt[10],), (10,), (), (0,), (SamplerSpec(),))])
    expected = reference_logits(loaded, prompt)[-1]
    assert float((recorder.calls[0][0] - expected).abs().max()) <= tolerance
    assert torch.equal(recorder.calls[1][0], recorder.calls[0][0])  # the copied pages read as the source's


def test_embed_forward_sample_top_k_agrees_with_forward_text(make_engine, prompts) -> None:
    engine = make_engine(page_size=4)
    prompt = prompts[0]
    n = len(prompt)
    slots = tuple(range(n))
    engine.allocate(
        [Allocate(ResourceKind.EMBED_SLOT, (*slots, 60)), Allocate(ResourceKind.KV_PAGE, tuple(range(20)))]
    )
    engine.embed_text([EmbedText(slots, tuple(prompt), tuple(range(n)))])
    pages = tuple(range(-(-n // 4)))
    last = n - 4 * (len(pages) - 1)
    engine.forward([Forward(pages, last, slots, (n - 1,), (60,))])
    via_slots = engine.sample_top_k([SampleTopK(60, 5)])[0]
    tables = PageTables(engine)
    tables.next_page = 20
    dist = SamplerSpec(SamplerKind.DISTRIBUTION, distribution_top_k=5)
    via_text = engine.forward_text([tables.item("t", prompt, outputs=(n - 1,), sampler=dist)])[0].outputs[0]
    assert via_slots.token_ids == via_text.token_ids
    assert torch.allclose(torch.tensor(via_slots.probs), torch.tensor(via_text.probs), atol=1e-5)


def test_get_info(make_engine) -> None:
    info = make_engine(page_size=4, num_pages=32).get_info()
    assert (info.vocab_size, info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (
        49152,
        30,
        9,
        3,
        64,
    )
    assert info.page_size == 4 and info.num_kv_pages == 32 and info.num_free_kv_pages == 32
    assert info.special_tokens["<|im_end|>"] == 2 and 2 in info.eos_token_ids
    assert "<|im_start|>" in info.chat_template and '"merges"' in info.tokenizer_json
    assert info.capabilities == ("text",)


def test_batch_spans_have_prepare_forward_sample_children(make_engine, prompts, monkeypatch) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(engine_module, "_tracer", provider.get_tracer("l4m.executor"))
    engine = make_engine()
    tables = PageTables(engine)
    parent_provider = TracerProvider()
    with parent_provider.get_tracer("test").start_as_current_span("scheduler.batch") as parent:
        ctx = trace.set_span_in_context(parent)
    engine.execute([tables.item("a", prompts[1][:5])], ctx)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert {"executor.batch", "prepare", "forward", "sample"} <= set(spans)
    batch = spans["executor.batch"]
    assert batch.context.trace_id == parent.get_span_context().trace_id
    assert batch.parent.span_id == parent.get_span_context().span_id
    assert all(spans[n].parent.span_id == batch.context.span_id for n in ("prepare", "forward", "sample"))


def test_a_batch_builds_no_span_while_no_provider_records_them(make_engine, prompts, monkeypatch) -> None:
    """Issue #19: with tracing off (the API's proxy tracer, no provider installed) a batch opens no span at all,
    not even a no-op one; once a provider records, the same batch opens its four."""
    opened: list[str] = []

    class SpyTracer(trace.ProxyTracer):
        def start_as_current_span(self, name, *args, **kwargs):  # type: ignore[no-untyped-def, override]
            opened.append(name)
            return super().start_as_current_span(name, *args, **kwargs)

    monkeypatch.setattr(engine_module, "_tracer", SpyTracer("l4m.executor"))
    monkeypatch.setattr(trace, "get_tracer_provider", trace.ProxyTracerProvider)
    engine = make_engine()
    tables = PageTables(engine)
    before = engine.execute([tables.item("a", prompts[1][:5])])
    assert opened == []
    recording = TracerProvider()
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: recording)
    after = engine.execute([tables.item("b", prompts[1][:5])])
    assert sorted(opened) == ["executor.batch", "forward", "prepare", "sample"] and opened[0] == "executor.batch"
    assert before[0].outputs[0].token_id == after[0].outputs[0].token_id  # the same prompt, the same token
