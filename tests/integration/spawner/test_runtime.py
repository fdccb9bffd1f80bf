"""The RuntimeService as controllers use it from real sandboxes: shared variables under concurrent
compare-and-set from 20 children, the per-tree child cap, and a launch while the scheduler is down.

The controllers here are plain scripts on raw stubs (`controller_runner=""`): what is tested is the
spawner's runtime, not the SDK."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from l4m.spawner.config import SpawnerConfig
from l4m.spawner.process_sandbox import ProcessSandbox
from l4m.v1 import spawner_pb2
from tests.integration.spawner.harness import attach, exit_of, log_lines, running_spawner, upload

RUNTIME_PRELUDE = """
import os, sys, grpc
from l4m.v1 import spawner_pb2 as pb, spawner_pb2_grpc
md = (("l4m-instance-token", os.environ["L4M_INSTANCE_TOKEN"]),)
rt = spawner_pb2_grpc.RuntimeServiceStub(grpc.insecure_channel(os.environ["L4M_RUNTIME_ADDR"]))
"""

# "parent K N": spawns K copies of itself as "child N", waits for all, prints the counter.
# "child N": adds 1 to the shared counter N times, each by compare-and-set, retrying on conflict.
CAS_COUNTER = (
    RUNTIME_PRELUDE
    + """
if sys.argv[1] == "child":
    num_conflicts = 0
    state = rt.GetVariable(pb.GetVariableRequest(name="counter"), metadata=md, timeout=30)
    version, value = state.version, state.value
    for _ in range(int(sys.argv[2])):
        while True:
            new_value = str(int(value or b"0") + 1).encode()
            request = pb.CompareAndSetVariableRequest(name="counter", expected_version=version, value=new_value)
            result = rt.CompareAndSetVariable(request, metadata=md, timeout=30)
            version, value = result.version, result.value
            if result.swapped:
                break
            num_conflicts += 1
    print("conflicts", num_conflicts)
else:
    num_children, num_increments = int(sys.argv[2]), sys.argv[3]
    child_ids = [
        rt.SpawnChild(pb.SpawnChildRequest(args=["child", num_increments]), metadata=md, timeout=60).instance_id
        for _ in range(num_children)
    ]
    for child_id in child_ids:
        waited = rt.WaitChild(pb.WaitChildRequest(instance_id=child_id, timeout_ms=120_000), metadata=md, timeout=130)
        assert waited.exited and waited.exit.reason == pb.EXIT_REASON_EXITED, waited
    final = rt.GetVariable(pb.GetVariableRequest(name="counter"), metadata=md, timeout=30)
    print("final", final.value.decode(), final.version)
"""
)

# Spawns children that exit at once until the spawner refuses one; prints the refusal.
SPAWN_UNTIL_REFUSED = (
    RUNTIME_PRELUDE
    + """
if sys.argv[1:] == ["child"]:
    sys.exit(0)
for attempt in range(1, 10):
    try:
        rt.SpawnChild(pb.SpawnChildRequest(args=["child"]), metadata=md, timeout=60)
    except grpc.RpcError as error:
        print("refused", attempt, error.code().name, error.details())
        break
"""
)


def _config(tmp_path: Path, **overrides: object) -> SpawnerConfig:
    return SpawnerConfig(
        state_dir=tmp_path / "state",
        socket_dir=tmp_path / "sockets",
        spawner_id=f"rt-{tmp_path.name[-20:]}",
        controller_runner="",
        **overrides,
    )


def test_compare_and_set_from_20_concurrent_children_loses_no_update(
    process_sandbox: ProcessSandbox, tmp_path: Path
) -> None:
    num_children, num_increments = 20, 25

    async def go() -> list[spawner_pb2.AttachResponse]:
        async with running_spawner(_config(tmp_path), process_sandbox) as spawner:
            sha = await upload(spawner.stub, CAS_COUNTER)
            request = spawner_pb2.LaunchRequest(
                program=sha, args=["parent", str(num_children), str(num_increments)]
            )
            launched = await spawner.stub.Launch(request, timeout=30)
            events = await attach(spawner.stub, launched.instance_id, timeout_s=180)
            listed = await spawner.stub.ListInstances(spawner_pb2.ListInstancesRequest(), timeout=10)
            children = [i for i in listed.instances if i.parent_instance_id == launched.instance_id]
            assert len(children) == num_children
            child_logs = [log_lines(await attach(spawner.stub, c.instance_id)) for c in children]
            print("child conflicts:", [lines[-1] for lines in child_logs])
            return events

    events = asyncio.run(go())
    assert exit_of(events).reason == spawner_pb2.EXIT_REASON_EXITED, events
    total = num_children * num_increments
    assert f"final {total} {total}" in log_lines(events), events


def test_the_child_cap_per_launch_tree_is_a_clear_error(
    process_sandbox: ProcessSandbox, tmp_path: Path
) -> None:
    async def go() -> tuple[list[str], list[str]]:
        async with running_spawner(_config(tmp_path, max_children_per_tree=3), process_sandbox) as spawner:
            sha = await upload(spawner.stub, SPAWN_UNTIL_REFUSED)
            by_spawner = await spawner.stub.Launch(spawner_pb2.LaunchRequest(program=sha), timeout=30)
            lowered = await spawner.stub.Launch(
                spawner_pb2.LaunchRequest(program=sha, limits=spawner_pb2.Limits(max_children=1)), timeout=30
            )
            return (
                log_lines(await attach(spawner.stub, by_spawner.instance_id)),
                log_lines(await attach(spawner.stub, lowered.instance_id)),
            )

    by_spawner, lowered = asyncio.run(go())
    assert any(
        line.startswith("refused 4 RESOURCE_EXHAUSTED") and "at most 3 children" in line
        for line in by_spawner
    ), by_spawner
    assert any(
        line.startswith("refused 2 RESOURCE_EXHAUSTED") and "at most 1 children" in line for line in lowered
    ), lowered


def test_a_launch_while_the_scheduler_is_unreachable_fails_cleanly(
    process_sandbox: ProcessSandbox, tmp_path: Path
) -> None:
    config = _config(tmp_path, scheduler_registry_address=f"unix:{tmp_path}/no-scheduler.sock")

    async def go() -> tuple[grpc.aio.AioRpcError, spawner_pb2.ListInstancesResponse, object]:
        async with running_spawner(config, process_sandbox) as spawner:
            sha = await upload(spawner.stub, "print('never runs')\n")
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await spawner.stub.Launch(spawner_pb2.LaunchRequest(program=sha), timeout=30)
            listed = await spawner.stub.ListInstances(spawner_pb2.ListInstancesRequest(), timeout=10)
            return raised.value, listed, spawner.server.manager.metrics

    error, listed, metrics = asyncio.run(go())
    assert error.code() is grpc.StatusCode.UNAVAILABLE, error
    assert "scheduler" in error.details() and "not started" in error.details(), error.details()
    assert not listed.instances
    assert metrics.instances.labels("starting")._value.get() == 0
    assert metrics.instances.labels("running")._value.get() == 0
