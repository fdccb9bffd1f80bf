"""The Grafana dashboard cannot rot: every metric its queries read is exported by a live cluster.

On the session's `l4m up` (metrics endpoints on), after one short launch (so that the latency histograms
and the launch counters have samples), each service's /metrics is scraped and every metric name the
dashboard's PromQL names (tests/dashboard_metrics.py reads them) must be among the exported series;
the histograms it reads must carry samples, not only their declaration."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable

from tests.dashboard_metrics import DASHBOARD, dashboard_metric_names, exported_sample_names
from tests.integration.harness import METRICS_OFFSETS, REPO, CliRun, UpCluster

TEXT_COMPLETION = REPO / "examples" / "controllers" / "text_completion.py"
# Every service with a /metrics endpoint (the gateway has none).
SERVICES = ("spawner", "scheduler", "executor")


def _scrape(cluster: UpCluster, service: str) -> str:
    url = f"http://127.0.0.1:{cluster.metrics_port_base + METRICS_OFFSETS[service]}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def test_every_metric_the_dashboard_reads_is_exported_by_a_live_cluster(
    l4m_up: UpCluster, l4m_run: Callable[..., CliRun]
) -> None:
    wanted = dashboard_metric_names(json.loads(DASHBOARD.read_text()))
    assert len(wanted) >= 20, sorted(wanted)  # the reader found the dashboard's queries
    run = l4m_run(TEXT_COMPLETION, "--no-stream", "--max-tokens", "4", "Name a colour.")
    assert run.returncode == 0, run.describe()

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
