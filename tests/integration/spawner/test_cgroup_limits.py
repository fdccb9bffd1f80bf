"""CPU bandwidth and the cgroup version each controller runs on, in real groups (v1 or v2, whichever
this machine's controllers are on; the escape suite covers the memory and process limits on both).

The CPU check reads the kernel's own count of throttled periods in the instance's group while the
program spins, so it does not depend on how busy the machine is.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from l4m.spawner.cgroups import stat_field
from l4m.spawner.process_sandbox import ProcessSandbox
from l4m.spawner.programs import ProgramStore
from l4m.spawner.sandbox import ExitReason, Limits, SandboxSpec
from l4m.spawner.supervisor import ExitEvent, InstanceSupervisor

SPIN = """
import time
print("spinning", flush=True)
end = time.monotonic() + 1.5
while time.monotonic() < end:
    pass
"""


def throttled_periods(group: Path) -> int:
    periods = stat_field((group / "cpu.stat").read_text(), "nr_throttled")
    assert periods is not None, f"no nr_throttled in {group / 'cpu.stat'}"
    return periods


def test_cpu_bandwidth_limit_throttles_a_spinning_program(
    process_sandbox: ProcessSandbox, tmp_path: Path
) -> None:
    parents = process_sandbox.cgroup_parents
    if "cpu" not in parents:
        pytest.fail("no cpu cgroup (v1 or v2) on this machine: the CPU bandwidth limit is not enforced")
    program = ProgramStore(tmp_path).put(SPIN.encode()).program
    spec = SandboxSpec("cpu-spin-1", program.path, limits=Limits(cpu_cores=0.1, wall_time_s=300.0))

    async def go() -> int:
        supervisor = InstanceSupervisor(process_sandbox, spec)
        await supervisor.start()
        throttled = -1
        async for event in supervisor.subscribe():
            if not isinstance(event, ExitEvent) and b"spinning" in event.data:
                deadline = time.monotonic() + 1.0  # ten 100 ms periods of 10 ms each
                while time.monotonic() < deadline and throttled <= 0:
                    await asyncio.sleep(0.1)
                    throttled = throttled_periods(parents["cpu"] / spec.instance_id)
        assert (await supervisor.wait()).reason is ExitReason.EXITED
        return throttled

    assert asyncio.run(go()) > 0


def test_enforcement_names_the_cgroup_version_in_use(process_sandbox: ProcessSandbox) -> None:
    parents = process_sandbox.cgroup_parents
    assert parents, "no cgroups: this test would check nothing"
    enforcement = process_sandbox.enforcement()
    for controller, key, v1, v2 in (
        ("memory", "memory_bytes", "cgroup memory", "cgroup v2 memory.max"),
        ("pids", "max_processes", "cgroup pids", "cgroup v2 pids.max"),
        ("cpu", "cpu_cores", "cgroup cpu cfs quota", "cgroup v2 cpu.max"),
    ):
        if controller not in parents:
            continue
        on_v2 = (parents[controller] / "cgroup.controllers").exists()  # the file marks a v2 group
        assert enforcement[key].startswith(v2 if on_v2 else v1), (controller, enforcement[key])
