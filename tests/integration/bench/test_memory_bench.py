"""Smoke test of bench/memory.py: a tiny run through a real scheduler (simulated executor, framed
sessions), a real spawner and real bubblewrap sandboxes, whose JSON must hold sane memory figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "bench" / "memory.py"), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.mark.slow
def test_idle_controllers_and_warm_sandboxes_are_measured(tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    done = run_bench("--phases", "cold,warm,many", "--launches", "2", "--count", "3", "--concurrency", "3",
                     "--settle-s", "0.5", "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    rows = {row["what"].split(" (")[0]: row for row in results["rows"]}
    assert set(rows) == {"cold launch, idle", "warm sandbox, before its launch", "warm launch, idle"}
    assert rows["warm launch, idle"]["what"] == "warm launch, idle (2/2 warm)"
    for row in rows.values():
        assert row["num_sandboxes"] == 2, row
        # bubblewrap, its pid 1 in the sandbox, python: a Python interpreter's worth of private memory.
        assert row["processes_per_sandbox"] == 3, row
        assert 4 < row["python_uss_mib_median"] <= row["uss_mib_median"] <= row["rss_mib_median"], row
        assert row["pss_mib_median"] <= row["rss_mib_median"], row
    many = results["many"]
    assert many["num_idle"] == many["num_asked"] == 3, many
    assert 4 < many["per_controller_uss_mib"] <= many["sandboxes_rss_mib"] / 3, many
    if many["cgroup_mib_per_controller"]:  # cgroup v1 memory: the charge covers the anonymous memory
        assert many["cgroup_mib_per_controller"]["usage"] >= many["cgroup_mib_per_controller"]["rss"] > 4, many
    assert many["extrapolated_1000_gib"] > 4, many


def test_the_import_breakdown_grows_with_each_import(tmp_path: Path) -> None:
    out = tmp_path / "imports.json"
    done = run_bench("--imports", "--json", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = json.loads(out.read_text())
    names = [step[0] for step in steps]
    assert names[:3] == ["(interpreter)", "asyncio", "google.protobuf.message"]
    # grpc last: only a program that opens a gRPC channel imports it (not the idle runner).
    assert names[-1] == "grpc" and names.index("llguidance") > names.index("l4m.controller")
    uss = [step[1] for step in steps]
    assert uss[-1] > uss[0] > 1


def test_an_unknown_phase_is_refused_by_name() -> None:
    done = run_bench("--phases", "cold,lukewarm")
    assert done.returncode == 2 and "lukewarm" in done.stderr, done.stderr[-2000:]
