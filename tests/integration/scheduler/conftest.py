"""Fixtures for scheduler integration tests (processes in scheduler_procs.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the tests here import scheduler_procs, session_client

from scheduler_procs import Cluster  # noqa: E402


@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    cluster = Cluster()
    yield cluster
    cluster.stop()
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        for process in cluster.processes:
            print(f"----- {process.name} log -----\n{process.log_tail(8000)}")

