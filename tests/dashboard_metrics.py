"""The metric names a Grafana dashboard's PromQL queries read, and the names a /metrics page exports, so a
test can say which of the dashboard's metrics no service exports any more (the dashboard would rot).

`query_metric_names` reads a name off PromQL without a parser: it drops what cannot be a metric name
(strings, label matchers, range and subquery brackets, Grafana variables, the label lists of `by`,
`without`, `on`, `ignoring`, `group_left`, `group_right`) and keeps every identifier that is neither a
function call nor a keyword. `exported_sample_names` expands each family of the exposition text into the
sample names Prometheus stores (a counter `x` as `x_total`, a histogram `x` as `x_bucket`, `x_sum` and
`x_count`), so a query of `x_bucket` is satisfied by a histogram `x` and by nothing else."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "kubernetes" / "base" / "monitoring" / "dashboards" / "l4m-cluster.json"

# Series Prometheus makes itself for every target; no service exports them.
PROMETHEUS_SERIES = frozenset({
    "up", "scrape_duration_seconds", "scrape_samples_scraped", "scrape_samples_post_metric_relabeling",
    "scrape_series_added",
})
_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "inf", "nan", "by", "without", "on", "ignoring",
                       "group_left", "group_right", "start", "end"})
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_LABEL_MATCHERS = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_GRAFANA_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+")
_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
# An identifier not glued to a number or a dot (`1e3`, `0.99`), and whether a call's "(" follows it.
_IDENTIFIER = re.compile(r"(?<![\w.:])([A-Za-z_:][\w:]*)(\s*\()?")

_SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}


def query_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (no functions, labels, keywords or durations)."""
    text = _STRING.sub(" ", expr)
    text = _LABEL_MATCHERS.sub(" ", text)
    text = _GRAFANA_VARIABLE.sub(" ", text)
    while _BRACKETS.search(text):  # subqueries nest: `[5m:1m]` inside an outer range
        text = _BRACKETS.sub(" ", text)
    text = _LABEL_LIST.sub(" ", text)  # `sum by (kind) (x)` reads as the call `sum (x)`
    return {name for name, call in _IDENTIFIER.findall(text) if not call and name.lower() not in _KEYWORDS}


def dashboard_queries(dashboard: Any) -> Iterator[str]:
    """Every `expr` anywhere in a dashboard's JSON: panels, panels nested in rows, templating queries."""
    if isinstance(dashboard, dict):
        for key, value in dashboard.items():
            if key == "expr" and isinstance(value, str):
                yield value
            else:
                yield from dashboard_queries(value)
    elif isinstance(dashboard, list):
        for item in dashboard:
            yield from dashboard_queries(item)


def dashboard_metric_names(dashboard: Any) -> dict[str, list[str]]:
    """Each metric name the dashboard reads (Prometheus' own series left out) -> the queries naming it."""
    names: dict[str, list[str]] = {}
    for expr in dashboard_queries(dashboard):
        for name in query_metric_names(expr) - PROMETHEUS_SERIES:
            names.setdefault(name, []).append(expr)
    return names


def exported_sample_names(texts: Iterable[str]) -> set[str]:
    """The sample names the exposition texts declare or carry: every family expanded by its type (a
    family with no sample yet, such as a labelled counter never bumped, still counts: its TYPE line is
    there), plus every sample actually present."""
    names: set[str] = set()
    for text in texts:
        for family in text_string_to_metric_families(text):
            names.update(family.name + suffix for suffix in _SAMPLE_SUFFIXES.get(family.type, ("",)))
            names.update(sample.name for sample in family.samples)
    return names
