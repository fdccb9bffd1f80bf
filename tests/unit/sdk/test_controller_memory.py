"""What an idle controller holds (docs/benchmarks.md, "Controller memory"): the runner trims the C heap
once the session is up, before `main`, and the runtime client opens its gRPC channel (and gRPC's
threads) only when a RuntimeService call needs it: with the spawner's framed socket, only `watch` does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from l4m import controller
from l4m.controller import load_program, run_main
from l4m.fake import FakeL4M
from l4m.runtime import LocalRuntime, RuntimeClient
from l4m.session import Session

MiB = 1024 * 1024
# A fresh interpreter frees 64 MiB of heap chunks under one it keeps (so glibc cannot give them back by
# lowering the heap's top) and reports its private dirty memory before and after RELEASE.
_HEAP_PROBE = """
import importlib, json, sys
module, name = sys.argv[1].split(":")
release = getattr(importlib.import_module(module), name)
def private_dirty():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("Private_Dirty:"):
            return int(line.split()[1]) * 1024
chunks = [bytes(4000) + bytes([i % 256]) for i in range(16384)]
pin = bytes(4000) + b"pin"
del chunks
before = private_dirty()
release()
print(json.dumps([before, private_dirty()]))
"""


def test_freed_heap_pages_go_back_to_the_kernel() -> None:
    release = "l4m.memory:release_free_memory"
    done = subprocess.run([sys.executable, "-c", _HEAP_PROBE, release], capture_output=True, text=True,
                          timeout=60, check=True)  # fmt: skip
    before, after = json.loads(done.stdout)
    assert before - after >= 32 * MiB, (before / MiB, after / MiB)


def test_the_runner_trims_after_the_session_is_up_and_before_main(
    run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    monkeypatch.setattr(controller, "release_free_memory", lambda: events.append("trimmed") or True)
    program = tmp_path / "idle.py"
    program.write_text("async def main(ctx):\n    print('main ran')\n    return 7\n")
    monkeypatch.setattr("builtins.print", lambda *parts, **_: events.append(" ".join(map(str, parts))))
    result = run(run_main(load_program(program), [], Session(FakeL4M().stub()), LocalRuntime(), "local"))
    assert result == 7
    assert events == ["trimmed", "main ran"]


def test_a_runtime_that_made_no_grpc_call_opened_no_channel(run) -> None:
    # Runtime calls as frames: no gRPC channel, so none of gRPC's threads (every call but `watch` over
    # frames alone: tests/unit/spawner/test_framed_runtime_calls.py).
    client = RuntimeClient("unix:///nonexistent/runtime.sock", "token", framed_address="framed:///x.sock")
    assert client._channel is None
    run(client.close())
    assert client._channel is None
