"""The executor's OpenMP wait: what `default_wait` adds, and that the benchmarks' executor alone gets it
before torch loads (its module loads no torch)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from l4m.executor.openmp import SPIN_COUNT, default_wait, describe_wait

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("environ", "added", "described"),
    [
        ({}, {"GOMP_SPINCOUNT": str(SPIN_COUNT)}, "libgomp's default"),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, {}, "OMP_WAIT_POLICY=PASSIVE"),
        ({"GOMP_SPINCOUNT": "500"}, {}, "GOMP_SPINCOUNT=500"),
        ({"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "7"}, {}, "OMP_WAIT_POLICY=ACTIVE, GOMP_SPINCOUNT=7"),
    ],
)
def test_the_spin_count_is_added_unless_the_operator_chose(environ: dict, added: dict, described: str) -> None:
    assert default_wait(environ) == added
    assert describe_wait(environ) == described


def test_the_benchmarks_executor_alone_sets_the_wait_before_torch_loads() -> None:
    """bench/peers.py applies the wait in main(), so importing it (and the l4m module it takes the wait from)
    must not load torch; e2e.py's smoke test checks the wait its executor-alone run reports."""
    probe = ("import sys; sys.path.insert(0, 'bench'); import peers; "
             "print('torch' in sys.modules, peers.default_wait({}))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"False {{'GOMP_SPINCOUNT': '{SPIN_COUNT}'}}"
