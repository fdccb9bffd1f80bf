"""scripts/setup.sh's choice of torch build: CUDA where an NVIDIA GPU answers `nvidia-smi -L`, the CPU
build otherwise; L4M_TORCH overrides, anything else is refused by name. (A fake `nvidia-smi` first on
PATH plays the GPU.)"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def choice(tmp_path: Path, smi: str | None, torch: str | None = None) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if smi is not None:
        fake = bin_dir / "nvidia-smi"
        fake.write_text(f"#!/bin/sh\n{smi}\n")
        fake.chmod(0o755)
        path = f"{bin_dir}:{os.environ['PATH']}"
    else:  # only the tools the script's first lines use: no nvidia-smi, even on a GPU machine
        for tool in ("dirname", "grep"):
            (bin_dir / tool).symlink_to(shutil.which(tool))
        path = str(bin_dir)
    env = {**os.environ, "PATH": path}
    env.pop("L4M_TORCH", None)
    if torch is not None:
        env["L4M_TORCH"] = torch
    return subprocess.run([shutil.which("bash"), str(ROOT / "scripts/setup.sh"), "--torch-build"], env=env,
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(
    ("smi", "torch", "want"),
    [
        ("echo 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'", None, "cuda"),
        ("echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'; exit 9", None, "cpu"),
        (None, None, "cpu"),  # no nvidia-smi on PATH at all
        ("echo 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'", "cpu", "cpu"),
        (None, "cuda", "cuda"),
    ],
    ids=["gpu answers", "driver missing", "no nvidia-smi", "forced cpu", "forced cuda"],
)
def test_setup_picks_the_torch_build(tmp_path, smi, torch, want) -> None:
    result = choice(tmp_path, smi, torch)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == want


def test_an_unknown_torch_build_is_refused_by_name(tmp_path) -> None:
    result = choice(tmp_path, None, "rocm")
    assert result.returncode != 0
    assert "L4M_TORCH must be auto, cpu or cuda, got 'rocm'" in result.stderr
