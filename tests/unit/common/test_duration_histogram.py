"""The lock-free duration histogram the executor's metrics read at scrape time."""

from __future__ import annotations

from l4m.common.metrics import DurationHistogram


def test_observations_land_in_the_first_bucket_that_holds_them() -> None:
    histogram = DurationHistogram((0.01, 0.1, 1.0))
    for seconds in (0.005, 0.01, 0.05, 0.5, 3.0, 7.0):
        histogram.observe(seconds)
    # Prometheus buckets are cumulative and inclusive (le): 0.01 counts in le=0.01.
    assert histogram.cumulative_buckets() == [("0.01", 2), ("0.1", 3), ("1.0", 4), ("+Inf", 6)]
    assert abs(histogram.sum_s - 10.565) < 1e-9


def test_an_empty_histogram_reports_zero_everywhere() -> None:
    assert DurationHistogram((0.5,)).cumulative_buckets() == [("0.5", 0), ("+Inf", 0)]
