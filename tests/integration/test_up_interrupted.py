"""Ctrl-C on `l4m up` while its services are still starting stops every one of them at once, and frees
the state directory for the next cluster."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from l4m.cluster import ClusterConfig, lock_state_dir
from tests.integration.harness import L4M_CLI, REPO, free_port, service_env

STOP_TIMEOUT_S = 60.0


def _processes_naming(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_ctrl_c_while_starting_stops_every_service(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    argv = [str(L4M_CLI), "up", "--state-dir", str(state_dir), "--spawner-port", str(free_port()),
            "--scheduler-port", str(free_port()), "--metrics-port-base", "0", "--quiet"]
    up = subprocess.Popen(argv, cwd=REPO, env=service_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + STOP_TIMEOUT_S  # the executor is started first; it loads the model for seconds
        while not _processes_naming(str(state_dir / "internal" / "executor-0.sock")):
            assert up.poll() is None and time.monotonic() < deadline, up.communicate(timeout=10)
            time.sleep(0.05)
        up.send_signal(signal.SIGINT)
        stdout, stderr = up.communicate(timeout=STOP_TIMEOUT_S)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert up.returncode == 130, stderr
    assert "l4m is up" not in stdout and "stopping before it was up" in stderr
    assert _processes_naming(str(state_dir)) == []  # nothing of this cluster outlives `l4m up`
    os.close(lock_state_dir(ClusterConfig(state_dir=state_dir, devices=("cpu",))))  # free for the next one
