"""A sandbox killed from outside (an operator's `kill -9`, the host's OOM killer) ends KILLED, not CRASHED."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from pathlib import Path

import pytest

from l4m.spawner.cpu_priority import sandbox_tree
from l4m.spawner.process_sandbox import ProcessSandbox
from l4m.spawner.programs import ProgramStore
from l4m.spawner.sandbox import ExitReason, SandboxSpec
from l4m.spawner.supervisor import InstanceSupervisor, OutputEvent

from .harness import run_with

SLEEPER = "import time\nprint('ready', flush=True)\ntime.sleep(120)\n"
WAIT_S = 60.0


def _program_pids(root: int) -> list[int]:
    """Every python process below `root` (the sandbox's launcher) that runs as a sandbox uid."""
    pids = []
    for pid in sandbox_tree(root) - {root}:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:
            continue
        uid = int(status.split("Uid:")[1].split()[0])
        if uid != 0 and "python" in Path(exe).name:
            pids.append(pid)
    return pids


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
@pytest.mark.parametrize("sandbox_name", ["process_sandbox", "warm_process_sandbox"])
def test_a_program_killed_from_outside_is_reported_killed(
    request: pytest.FixtureRequest, sandbox_name: str, how: int, tmp_path: Path
) -> None:
    sandbox: ProcessSandbox = request.getfixturevalue(sandbox_name)
    program = ProgramStore(tmp_path).put(SLEEPER.encode()).program

    async def go() -> None:
        supervisor = InstanceSupervisor(sandbox, SandboxSpec(f"k-{uuid.uuid4().hex[:12]}", program.path))
        await supervisor.start()
        events = supervisor.subscribe()
        async with asyncio.timeout(WAIT_S):
            async for event in events:
                if isinstance(event, OutputEvent) and event.data == b"ready\n":
                    break
        launcher = supervisor._handle._process.pid  # type: ignore[attr-defined]
        victims = _program_pids(launcher)
        assert victims, "the sandboxed program's process was not found below its launcher"
        for pid in victims:
            os.kill(pid, how)
        info = await asyncio.wait_for(supervisor.wait(), WAIT_S)
        assert (info.reason, info.signal) == (ExitReason.KILLED, how), info
        assert "outside the spawner" in info.message

    run_with(sandbox, go())
