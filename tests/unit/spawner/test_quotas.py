"""Quotas in the spawner's core (fake sandbox, fake scheduler): limits over the maximum refused, per-user
sums of memory and wall time, instances alive at once under concurrent launches, the bounds on
arguments and on the inbox, and what an exited instance keeps."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from l4m.common.users import User
from l4m.spawner.config import MiB
from l4m.spawner.instances import (
    ArgsTooLarge,
    InboxFull,
    InstanceManager,
    InvalidModelName,
    LimitTooHigh,
    QuotaExceeded,
    child_limits,
    resolve_limits,
)
from l4m.spawner.sandbox import Limits
from l4m.spawner.supervisor import ITEM_OVERHEAD_BYTES, InstanceState
from tests.unit.spawner.test_instances import FakeRegistry
from tests.unit.spawner.test_instances import _manager as _admin_manager
from tests.unit.spawner.test_supervisor import FakeSandbox

ALICE, BOB = User("alice"), User("bob")


def _manager(tmp_path: Path, sandbox: FakeSandbox, **config: object) -> tuple[InstanceManager, str, FakeRegistry]:
    """The unit tests' manager, its program uploaded by alice and bob too."""
    manager, sha, registry = _admin_manager(tmp_path, sandbox, **config)
    for user in (ALICE, BOB):
        manager.record_upload(sha, user)
    return manager, sha, registry


MAXIMUM = Limits(wall_time_s=3600, cpu_time_s=3600, memory_bytes=4096 * MiB, max_output_bytes=256 * MiB)


def test_a_limit_over_the_maximum_is_refused_naming_field_value_and_maximum() -> None:
    with pytest.raises(LimitTooHigh, match=r"memory_bytes = 8589934592 is over the spawner's maximum of 4294967296"):
        resolve_limits(Limits(memory_bytes=8192 * MiB), Limits(), MAXIMUM)
    with pytest.raises(LimitTooHigh, match=r"wall_time_s = 7200 is over the spawner's maximum of 3600"):
        resolve_limits(Limits(wall_time_s=7200, memory_bytes=0), Limits(), MAXIMUM)


def test_zero_takes_the_default_and_the_maximum_itself_is_allowed() -> None:
    zeros = Limits(0, 0, 0, 0, 0, 0, 0.0, 0)
    assert resolve_limits(zeros, Limits(), MAXIMUM) == Limits()
    at_max = resolve_limits(Limits(wall_time_s=3600, memory_bytes=4096 * MiB), Limits(), MAXIMUM)
    assert (at_max.wall_time_s, at_max.memory_bytes) == (3600, 4096 * MiB)


def test_a_child_gets_at_most_its_parents_but_over_the_maximum_is_refused() -> None:
    parent = Limits(wall_time_s=100, memory_bytes=256 * MiB)
    capped = child_limits(Limits(wall_time_s=1000, memory_bytes=128 * MiB), parent, MAXIMUM)
    assert (capped.wall_time_s, capped.memory_bytes) == (100, 128 * MiB)
    with pytest.raises(LimitTooHigh, match="wall_time_s = 5000"):
        child_limits(Limits(wall_time_s=5000), parent, MAXIMUM)


def test_a_launch_over_the_maximum_starts_nothing(tmp_path: Path) -> None:
    async def go() -> None:
        sandbox = FakeSandbox([], exit_code=None)
        manager, sha, registry = _manager(tmp_path, sandbox)
        with pytest.raises(LimitTooHigh, match="memory_bytes"):
            await manager.launch(sha, limits=Limits(memory_bytes=5000 * MiB), user=ALICE)
        assert (sandbox.handles, registry.registered) == ([], [])
        root = await manager.launch(sha, user=ALICE)
        with pytest.raises(LimitTooHigh, match="max_output_bytes"):
            await manager.spawn_child(root, "", (), Limits(max_output_bytes=1 << 40))
        assert root.tree.num_children == 0
        await manager.shutdown()

    asyncio.run(go())


def test_arguments_past_their_bound_are_refused(tmp_path: Path) -> None:
    async def go() -> None:
        sandbox = FakeSandbox([], exit_code=None)
        manager, sha, _ = _manager(tmp_path, sandbox, max_args_bytes=1000)
        with pytest.raises(ArgsTooLarge, match="the arguments are 1001 bytes; at most 1000"):
            await manager.launch(sha, ("x" * 500, "y" * 501), user=ALICE)
        assert sandbox.handles == []
        await manager.launch(sha, ("x" * 1000,), user=ALICE)
        await manager.shutdown()

    asyncio.run(go())


def test_the_model_a_launch_names_reaches_the_controller_and_its_children_bounded(tmp_path: Path) -> None:
    """`LaunchRequest.model` goes into the sandbox's environment (L4M_MODEL): any user may name any model
    (the scheduler refuses one nobody serves), but only a bounded, printable, one-line name."""
    async def go() -> None:
        sandbox = FakeSandbox([], exit_code=None)
        manager, sha, registry = _manager(tmp_path, sandbox)
        for bad, reason in (("q" * 257, "257 bytes; at most 256"), ("qwen\nL4M_X=1", "non-printable"),
                            ("a\x00b", "non-printable")):
            with pytest.raises(InvalidModelName, match=reason):
                await manager.launch(sha, model=bad, user=ALICE)
        assert (sandbox.handles, registry.registered) == ([], [])
        root = await manager.launch(sha, model="qwen", user=ALICE)
        child = await manager.spawn_child(root, "", (), None)
        default = await manager.launch(sha, user=BOB)
        envs = [handle.spec.env for handle in sandbox.handles]
        assert [env.get("L4M_MODEL") for env in envs] == ["qwen", "qwen", None]
        assert (root.model, child.model, default.model) == ("qwen", "qwen", "")
        await manager.shutdown()

    asyncio.run(go())


def test_the_memory_sum_per_user_refuses_naming_the_quota_and_frees_at_exit(tmp_path: Path) -> None:
    async def go() -> None:
        manager, sha, _ = _manager(
            tmp_path, FakeSandbox([], exit_code=None), max_memory_bytes_per_user=1024 * MiB
        )
        big = Limits(memory_bytes=768 * MiB)
        first = await manager.launch(sha, limits=big, user=ALICE)
        with pytest.raises(QuotaExceeded, match=r"'alice'.*768 MiB.*max memory per user: 1024 MiB"):
            await manager.launch(sha, limits=big, user=ALICE)
        with pytest.raises(QuotaExceeded, match="max memory per user"):
            await manager.spawn_child(first, "", (), None)  # a child inherits 768 MiB: over
        await manager.launch(sha, limits=big, user=BOB)  # another user is not affected
        await manager.terminate(first.instance_id)
        await manager.launch(sha, limits=big, user=ALICE)
        await manager.shutdown()

    asyncio.run(go())


def test_the_wall_time_sum_per_user_refuses_naming_the_quota(tmp_path: Path) -> None:
    async def go() -> None:
        manager, sha, _ = _manager(tmp_path, FakeSandbox([], exit_code=None), max_wall_time_s_per_user=1000)
        await manager.launch(sha, limits=Limits(wall_time_s=600), user=ALICE)
        with pytest.raises(QuotaExceeded, match=r"600 s of wall time.*max wall time per user: 1000 s"):
            await manager.launch(sha, limits=Limits(wall_time_s=600), user=ALICE)
        await manager.launch(sha, limits=Limits(wall_time_s=400), user=ALICE)
        await manager.shutdown()

    asyncio.run(go())


def test_concurrent_launches_cannot_pass_the_instances_quota(tmp_path: Path) -> None:
    """Issue #17: one client took all 256 slots. Launches still starting count against the quota."""

    async def go() -> None:
        manager, sha, _ = _manager(tmp_path, FakeSandbox([], exit_code=None), max_instances_per_user=3)
        results = await asyncio.gather(*(manager.launch(sha, user=ALICE) for _ in range(20)), return_exceptions=True)
        assert sum(not isinstance(r, BaseException) for r in results) == 3
        assert all(isinstance(r, QuotaExceeded) for r in results if isinstance(r, BaseException))
        await manager.launch(sha, user=BOB)
        await manager.shutdown()

    asyncio.run(go())


def test_unread_messages_to_an_instance_are_bounded(tmp_path: Path) -> None:
    async def go() -> None:
        manager, sha, _ = _manager(tmp_path, FakeSandbox([], exit_code=None), max_inbox_bytes=64 * 1024)
        instance = await manager.launch(sha, user=ALICE)
        num_sent = 0
        with pytest.raises(InboxFull, match="inbox holds at most 65536 bytes"):
            for _ in range(100_000):
                manager.send_to_instance(instance.instance_id, "", ALICE)
                num_sent += 1
        assert num_sent == 64 * 1024 // ITEM_OVERHEAD_BYTES
        assert await manager.receive_from_user(instance, 1) == ""
        manager.send_to_instance(instance.instance_id, "", ALICE)  # one read makes room for one
        await manager.terminate(instance.instance_id)
        assert (instance.inbox.qsize(), instance.inbox_bytes) == (0, 0)

    asyncio.run(go())


def test_an_exited_tree_drops_its_variables_and_old_exits_are_forgotten(tmp_path: Path) -> None:
    async def go() -> None:
        manager, sha, _ = _manager(tmp_path, FakeSandbox([], exit_code=None), max_exited_instances=2)
        root = await manager.launch(sha, user=ALICE)
        child = await manager.spawn_child(root, "", (), None)
        await root.tree.variables.set("x", b"1" * 1000)
        await manager.terminate(child.instance_id)
        assert root.tree.variables.get("x").exists  # the root still runs
        await manager.terminate(root.instance_id)
        assert (root.tree.variables.num_variables, root.tree.variables.total_bytes) == (0, 0)
        for _ in range(3):
            await manager.terminate((await manager.launch(sha, user=ALICE)).instance_id)
        listed = manager.list_instances()
        assert len(listed) == 2 and all(i.state is InstanceState.EXITED for i in listed)

    asyncio.run(go())
