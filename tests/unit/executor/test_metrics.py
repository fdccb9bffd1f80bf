"""The executor's Prometheus metrics, read from a real engine at scrape time."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from l4m.executor.commands import Allocate, ForwardText, ResourceKind, SamplerKind, SamplerSpec
from l4m.executor.metrics import executor_registry


def _samples(registry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_batch_seconds_counts_each_batch_by_kind(make_engine, prompts) -> None:
    engine = make_engine(page_size=16)
    registry = executor_registry(engine)
    engine.execute([Allocate(ResourceKind.KV_PAGE, tuple(range(8)))])
    greedy = SamplerSpec(SamplerKind.GREEDY)
    tokens = prompts[0][:5]
    for _ in range(3):
        engine.execute([ForwardText((0,), 5, tuple(tokens), tuple(range(5)), (), (4,), (greedy,))])
    samples = _samples(registry)
    assert samples[("l4m_executor_batch_seconds_count", (("kind", "ForwardText"),))] == 3
    assert samples[("l4m_executor_batch_seconds_count", (("kind", "Allocate"),))] == 1
    assert samples[("l4m_executor_batch_seconds_bucket", (("kind", "ForwardText"), ("le", "+Inf")))] == 3
    assert samples[("l4m_executor_batch_seconds_sum", (("kind", "ForwardText"),))] > 0
    assert samples[("l4m_executor_batches_total", ())] == 4
    assert samples[("l4m_executor_forward_tokens_total", ())] == 15
