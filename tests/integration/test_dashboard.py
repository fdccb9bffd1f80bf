"""The Grafana dashboard cannot rot: every metric its queries read is exported by a live cluster.

On the session's `l4m up` (metrics endpoints on), after one short launch that samples a few tokens and one
chat completion through the gateway (so that the latency histograms, the generation and gateway counters
and the launch counters have samples), each service's /metrics is scraped and every metric name the
dashboard's PromQL names (tests/dashboard_metrics.py reads them) must be among the exported series;
the histograms it reads must carry samples, not only their declaration."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from tests.dashboard_metrics import DASHBOARD, dashboard_metric_names, exported_sample_names
from tests.integration.harness import METRICS_OFFSETS, REPO, CliRun, UpCluster

TEXT_COMPLETION = REPO / "examples" / "controllers" / "text_completion.py"
# Every service with a /metrics endpoint.
SERVICES = ("spawner", "scheduler", "gateway", "executor")


def _scrape(cluster: UpCluster, service: str) -> str:
    url = f"http://127.0.0.1:{cluster.metrics_port_base + METRICS_OFFSETS[service]}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def _chat(cluster: UpCluster, max_tokens: int) -> dict:
    """One chat completion through the gateway, as the admin."""
    body = {"model": _model_name(cluster), "messages": [{"role": "user", "content": "Name a colour."}],
            "max_tokens": max_tokens, "temperature": 0}
    request = urllib.request.Request(f"{cluster.gateway_url}/chat/completions", data=json.dumps(body).encode(),
                                     headers={"authorization": f"Bearer {cluster.admin_key}",
                                              "content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _model_name(cluster: UpCluster) -> str:
    request = urllib.request.Request(f"{cluster.gateway_url}/models",
                                     headers={"authorization": f"Bearer {cluster.admin_key}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())["data"][0]["id"]


def _values(text: str) -> dict[str, float]:
    """Each unlabelled sample of an exposition text, and each labelled one summed over its labels."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "le" not in sample.labels:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def test_every_metric_the_dashboard_reads_is_exported_by_a_live_cluster(
    l4m_up: UpCluster, l4m_run: Callable[..., CliRun]
) -> None:
    wanted = dashboard_metric_names(json.loads(DASHBOARD.read_text()))
    assert len(wanted) >= 20, sorted(wanted)  # the reader found the dashboard's queries
    run = l4m_run(TEXT_COMPLETION, "--no-stream", "--max-tokens", "4", "Name a colour.")
    assert run.returncode == 0, run.describe()
    answer = _chat(l4m_up, 3)
    assert answer["usage"]["completion_tokens"] >= 1, answer

    texts = {service: _scrape(l4m_up, service) for service in SERVICES}
    exported = exported_sample_names(texts.values())
    missing = {name: queries for name, queries in sorted(wanted.items()) if name not in exported}
    assert not missing, (
        "the dashboard reads metrics no service exports:\n"
        + "\n".join(f"  {name}, in: {queries[0]}" for name, queries in missing.items())
    )
    # A launch went through every service: each histogram the dashboard reads has observations.
    observed = {line.split("{")[0].split(" ")[0] for text in texts.values() for line in text.splitlines()
                if line and not line.startswith("#")}
    unobserved = sorted(name for name in wanted if name.endswith("_bucket") and name not in observed)
    assert not unobserved, f"histograms with no sample after a launch: {unobserved}"
    # The generation and gateway families count what ran: bucket lines alone would not say so. Other tests
    # share this cluster, so at least what this test ran.
    scheduler, gateway = _values(texts["scheduler"]), _values(texts["gateway"])
    sampled = len(run.summary()["token_ids"]) + answer["usage"]["completion_tokens"]
    assert scheduler["l4m_scheduler_generated_tokens_total"] >= sampled, scheduler
    assert scheduler["l4m_scheduler_time_to_first_token_seconds_count"] >= 2, scheduler  # the launch, the chat
    assert scheduler["l4m_scheduler_inter_token_seconds_count"] >= 1, scheduler
    assert gateway["l4m_gateway_requests_total"] >= 2 and gateway["l4m_gateway_request_seconds_count"] >= 2, gateway
    assert gateway["l4m_gateway_generated_tokens_total"] >= answer["usage"]["completion_tokens"], gateway
    assert gateway["l4m_gateway_prompt_tokens_total"] >= answer["usage"]["prompt_tokens"], gateway
