"""Smoke test of bench/spawner.py: a tiny run through a real scheduler (simulated executor), a real
spawner and real bubblewrap sandboxes, whose JSON must hold sane numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "bench" / "spawner.py"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_launch_to_first_command_on_cold_and_warm_sandboxes(tmp_path: Path) -> None:
    out = tmp_path / "spawner.json"
    done = run_bench(
        "--backends", "process,process-warm", "--launches", "2", "--concurrent", "3", "--json", str(out)
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {(row["backend"], row["mode"]): row for row in json.loads(out.read_text())}
    assert set(rows) == {
        ("process", "sequential"),
        ("process", "3 at once"),
        ("process-warm", "refilled"),
        ("process-warm", "back-to-back"),
        ("process-warm", "3 at once"),
    }
    for row in rows.values():
        # Every launch's first output was the line printed after the scheduler answered.
        assert row["num_ok"] == row["num_launches"], (row, done.stderr[-3000:])
        assert 0 < row["p50_ms"] <= row["p99_ms"] <= row["max_ms"]
    assert rows[("process", "sequential")]["num_warm"] == 0
    assert rows[("process-warm", "refilled")]["num_warm"] == 2
    # A burst's cost to the spawner, by window; only the warm pool has a refill to wait for.
    warm_burst = rows[("process-warm", "3 at once")]["burst"]
    cold_burst = rows[("process", "3 at once")]["burst"]
    for burst in (warm_burst, cold_burst):
        assert burst["handover_s"] > 0 and burst["handover_cpu_ms"] > 0 and burst["run_exit_cpu_ms"] > 0
    assert warm_burst["refill_s"] >= warm_burst["handover_s"] and cold_burst["refill_s"] == 0


@pytest.mark.slow
def test_refills_are_timed_and_none_fails(tmp_path: Path) -> None:
    out = tmp_path / "refill.json"
    done = run_bench("--refill", "--hogs", "0", "--rounds", "1", "--json", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    refills = json.loads(out.read_text())
    assert len(refills) == 2
    assert all(refill["refill_s"] > 0 and refill["num_start_failures"] == 0 for refill in refills)
