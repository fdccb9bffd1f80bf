"""Prometheus helpers of the services: the /metrics HTTP server and lock-free duration histograms
that a collector reads at scrape time."""

from __future__ import annotations

import argparse
import bisect
import ipaddress
from dataclasses import dataclass

from prometheus_client import REGISTRY, start_http_server
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import CollectorRegistry

# Latency buckets (seconds) for work from a sub-millisecond decode step on a GPU to a long CPU prefill.
DURATION_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class MetricsEndpoint:
    """Where a service serves /metrics: port 0 is off; loopback unless the operator exposes it (inside a
    container, 0.0.0.0 so that a Prometheus on the cluster's internal network can scrape it)."""

    port: int = 0
    host: str = LOOPBACK


METRICS_OFF = MetricsEndpoint()


def add_metrics_flags(parser: argparse.ArgumentParser) -> None:
    """`--metrics-port` and `--metrics-host`, the same on every service; `metrics_endpoint` reads them."""
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics on --metrics-host; 0 = off")
    parser.add_argument("--metrics-host", default=LOOPBACK,
                        help="IP address /metrics listens on (default loopback only; 0.0.0.0 in a container "
                        "whose network only the cluster's Prometheus reaches: docs/security.md)")


def metrics_endpoint(parser: argparse.ArgumentParser, args: argparse.Namespace) -> MetricsEndpoint:
    """The parsed `--metrics-port`/`--metrics-host`; a port out of range or a host that is not an IP
    address is a usage error (exit 2) naming the flag."""
    if not 0 <= args.metrics_port <= 65535:
        parser.error(f"--metrics-port must be in 0..65535 (0: off), got {args.metrics_port}")
    try:
        ipaddress.ip_address(args.metrics_host)
    except ValueError:
        parser.error(f"--metrics-host must be an IP address (127.0.0.1: loopback only; 0.0.0.0: every "
                     f"interface), got {args.metrics_host!r}")
    return MetricsEndpoint(args.metrics_port, args.metrics_host)


def start_metrics_server(port: int, registry: CollectorRegistry | None = None, host: str = LOOPBACK) -> None:
    """Serve Prometheus metrics on http://host:port/metrics (port 0: no server)."""
    if not port:
        return
    start_http_server(port, addr=host, registry=registry or REGISTRY)


class DurationHistogram:
    """A Prometheus-style histogram of durations for ONE writer thread: `observe` is a bucket search and
    two additions, no lock (prometheus_client's Histogram takes one per observation); a scrape reads
    the counts from another thread, which may see an observation half-recorded (counts off by one for
    one scrape, never corrupted)."""

    __slots__ = ("bounds_s", "counts", "sum_s")

    def __init__(self, bounds_s: tuple[float, ...] = DURATION_BUCKETS_S) -> None:
        self.bounds_s = bounds_s
        self.counts = [0] * (len(bounds_s) + 1)  # the last bucket is +Inf
        self.sum_s = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds_s, seconds)] += 1
        self.sum_s += seconds

    def observe_many(self, seconds: float, count: int) -> None:
        """`count` observations of the same duration at the cost of one."""
        self.counts[bisect.bisect_left(self.bounds_s, seconds)] += count
        self.sum_s += seconds * count

    def cumulative_buckets(self) -> list[tuple[str, int]]:
        """(le, cumulative count) pairs, +Inf last, as `HistogramMetricFamily.add_metric` takes them."""
        buckets, total = [], 0
        for bound, count in zip((*map(repr, self.bounds_s), "+Inf"), self.counts, strict=True):
            total += count
            buckets.append((bound, total))
        return buckets

    def family(self, name: str, documentation: str) -> HistogramMetricFamily:
        """An unlabelled HistogramMetricFamily of this histogram, for a collector at scrape time."""
        return HistogramMetricFamily(name, documentation, buckets=self.cumulative_buckets(), sum_value=self.sum_s)


class DurationsByKind(dict[str, DurationHistogram]):
    """`DurationHistogram`s by a label value (a command kind), created on first observation; one writer
    thread, as `DurationHistogram`. `family` gives them to a prometheus_client collector at scrape time."""

    def observe(self, kind: str, seconds: float) -> None:
        histogram = self.get(kind)
        if histogram is None:
            histogram = self[kind] = DurationHistogram()
        histogram.observe(seconds)

    def family(self, name: str, documentation: str) -> HistogramMetricFamily:
        """One HistogramMetricFamily, labelled `kind`, of every histogram so far."""
        family = HistogramMetricFamily(name, documentation, labels=["kind"])
        for kind, histogram in sorted(self.items()):
            family.add_metric([kind], histogram.cumulative_buckets(), histogram.sum_s)
        return family
