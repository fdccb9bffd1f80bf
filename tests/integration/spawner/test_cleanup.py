"""Nothing outlives an instance, and a restarted spawner removes what a crashed one left behind."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from l4m.spawner.cgroups import CgroupManager
from l4m.spawner.docker_sandbox import LABEL_INSTANCE, LABEL_SPAWNER, DockerSandbox
from l4m.spawner.process_sandbox import ProcessSandbox
from l4m.spawner.programs import ProgramStore
from l4m.spawner.sandbox import ExitReason, Limits, SandboxSpec
from l4m.spawner.supervisor import InstanceSupervisor


def test_process_sandbox_leaves_no_cgroups(process_sandbox: ProcessSandbox, tmp_path: Path) -> None:
    program = ProgramStore(tmp_path).put(b"print('hi')\n").program

    async def go() -> None:
        supervisors = [
            InstanceSupervisor(process_sandbox, SandboxSpec(f"clean-{n}", program.path)) for n in range(5)
        ]
        for supervisor in supervisors:
            await supervisor.start()
        infos = await asyncio.gather(*(s.wait() for s in supervisors))
        assert {info.reason for info in infos} == {ExitReason.EXITED}

    asyncio.run(go())
    assert process_sandbox.cgroup_parents, "no cgroups: this test would check nothing"
    for parent in process_sandbox.cgroup_parents.values():  # v1 and v2 alike
        assert not [p for p in parent.iterdir() if p.is_dir() and p.name.startswith("clean-")]


def test_process_sandbox_removes_orphaned_cgroups(process_sandbox: ProcessSandbox) -> None:
    if not process_sandbox.cgroup_controllers:
        pytest.fail(
            "no writable cgroup controller (v1 or v2) on this machine; the process sandbox falls back to rlimits"
        )
    manager = CgroupManager(process_sandbox.config.spawner_id)
    group = manager.create("orphan-1", Limits())
    sleeper = subprocess.Popen(["sleep", "600"])
    for procs in group.procs_files():
        procs.write_text(str(sleeper.pid))
    assert asyncio.run(process_sandbox.cleanup_orphans()) >= 1
    assert sleeper.wait(timeout=10) == -9
    assert not any(directory.exists() for directory in group.dirs.values())


@pytest.mark.docker
def test_docker_sandbox_removes_orphaned_containers(docker_sandbox: DockerSandbox) -> None:
    import docker

    client = docker.from_env()
    labels = {LABEL_SPAWNER: docker_sandbox.config.spawner_id, LABEL_INSTANCE: "orphan-1"}
    container = client.containers.run(
        docker_sandbox.config.image, ["sleep", "600"], labels=labels, network_mode="none", detach=True
    )
    assert asyncio.run(docker_sandbox.cleanup_orphans()) >= 1
    with pytest.raises(docker.errors.NotFound):
        container.reload()
