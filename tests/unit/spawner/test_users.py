"""The spawner's core per user: who sees which instance and program, quotas, a child's budget, and
the end of an instance whose client went away (fake sandbox, fake scheduler)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from l4m.common.users import User
from l4m.spawner.config import SpawnerConfig
from l4m.spawner.instances import (
    CLIENT_GONE_MESSAGE,
    InstanceManager,
    InstanceNotFound,
    QuotaExceeded,
    TagTaken,
    child_token_budget,
)
from l4m.spawner.programs import ProgramNotFound
from l4m.spawner.sandbox import ExitReason, Limits
from l4m.spawner.server import ConfigError, is_loopback_address, make_authenticator
from l4m.spawner.supervisor import InstanceState
from tests.unit.spawner.test_instances import FakeRegistry, _manager
from tests.unit.spawner.test_supervisor import FakeSandbox

ALICE = User("alice")
BOB = User("bob")
ROOT = User("root", is_admin=True)


def _running(tmp_path: Path, **config: object) -> tuple[InstanceManager, str, FakeRegistry]:
    manager, sha, registry = _manager(tmp_path, FakeSandbox([], exit_code=None), **config)
    manager.record_upload(sha, ALICE)
    return manager, sha, registry


def test_another_users_instance_is_not_found_like_an_unknown_one_and_an_admin_sees_all(tmp_path: Path) -> None:
    async def go() -> None:
        manager, sha, registry = _running(tmp_path)
        instance = await manager.launch(sha, ("secret prompt",), user=ALICE)
        assert registry.registrations[instance.instance_id]["user"] == "alice"
        assert registry.registrations[instance.instance_id]["is_admin"] is False
        assert manager.get(instance.instance_id, ALICE) is instance
        unknown = str(pytest.raises(InstanceNotFound, manager.get, "i-nope", BOB).value)
        hidden = str(pytest.raises(InstanceNotFound, manager.get, instance.instance_id, BOB).value)
        assert hidden == unknown.replace("i-nope", instance.instance_id)
        with pytest.raises(InstanceNotFound):
            manager.send_to_instance(instance.instance_id, "hi", BOB)
        with pytest.raises(InstanceNotFound):
            await manager.terminate(instance.instance_id, user=BOB)
        assert manager.list_instances(BOB) == [] and manager.list_instances(ALICE) == [instance]
        assert manager.list_instances(ROOT) == [instance]
        info = await manager.terminate(instance.instance_id, user=ROOT)
        assert info.reason is ExitReason.TERMINATED

    asyncio.run(go())


def test_programs_are_visible_and_launchable_only_by_their_uploaders(tmp_path: Path) -> None:
    async def go() -> None:
        manager, sha, _ = _running(tmp_path)
        assert [p.sha256 for p in manager.programs_of(ALICE)] == [sha]
        assert manager.programs_of(BOB) == [] and [p.sha256 for p in manager.programs_of(ROOT)] == [sha]
        with pytest.raises(ProgramNotFound, match="no program"):
            await manager.launch(sha, user=BOB)
        manager.record_upload(sha, BOB)  # uploading the same bytes makes it Bob's too
        instance = await manager.launch(sha, user=BOB)
        assert instance.owner == BOB
        await manager.shutdown()

    asyncio.run(go())


def test_the_per_user_instance_quota_names_itself_and_a_key_may_raise_it(tmp_path: Path) -> None:
    async def go() -> None:
        manager, sha, _ = _running(tmp_path, max_instances_per_user=1)
        manager.record_upload(sha, BOB)
        first = await manager.launch(sha, user=ALICE)
        with pytest.raises(QuotaExceeded, match=r"user 'alice' .*max instances per user: 1"):
            await manager.launch(sha, user=ALICE)
        await manager.launch(sha, user=BOB)  # Bob has a quota of his own
        generous = User("alice", max_instances=2)
        await manager.launch(sha, user=generous)
        await manager.terminate(first.instance_id)
        await manager.shutdown()

    asyncio.run(go())


def test_the_user_token_quota_goes_to_the_scheduler(tmp_path: Path) -> None:
    async def go() -> None:
        manager, sha, registry = _running(tmp_path, max_tokens_per_minute_per_user=500)
        default = await manager.launch(sha, user=ALICE)
        own = await manager.launch(sha, user=User("alice", max_tokens_per_minute=70))
        assert registry.registrations[default.instance_id]["user_max_tokens_per_minute"] == 500
        assert registry.registrations[own.instance_id]["user_max_tokens_per_minute"] == 70
        await manager.shutdown()

    asyncio.run(go())


def test_a_child_belongs_to_the_parents_user_and_gets_the_smaller_budget(tmp_path: Path) -> None:
    async def go() -> None:
        manager, sha, registry = _running(tmp_path)
        parent = await manager.launch(sha, max_tokens=100, user=ALICE, max_children=2)
        small = await manager.spawn_child(parent, "", (), Limits(wall_time_s=5.0), max_tokens=10)
        large = await manager.spawn_child(parent, "", (), None, max_tokens=1000)
        assert (small.owner, large.owner) == (ALICE, ALICE)
        assert registry.registrations[small.instance_id]["max_tokens"] == 10
        assert registry.registrations[large.instance_id]["max_tokens"] == 100
        assert registry.registrations[small.instance_id]["parent_instance_id"] == parent.instance_id
        assert small.supervisor.spec.limits.wall_time_s == 5.0
        assert manager.list_instances(BOB) == []
        await manager.shutdown()

    asyncio.run(go())
    assert child_token_budget(0, 100) == 100 and child_token_budget(7, 0) == 7 and child_token_budget(0, 0) == 0


def test_the_last_client_going_away_ends_an_attached_instance_but_not_a_detached_one(tmp_path: Path) -> None:
    async def go() -> None:
        manager, sha, _ = _running(tmp_path)
        attached = await manager.launch(sha, user=ALICE)
        detached = await manager.launch(sha, user=ALICE, detached=True)
        with manager.attached(attached), manager.attached(attached):
            pass  # two clients, both gone
        with manager.attached(detached):
            pass
        info = await asyncio.wait_for(attached.supervisor.wait(), 1.0)
        assert (info.reason, info.message) == (ExitReason.TERMINATED, CLIENT_GONE_MESSAGE)
        await asyncio.sleep(0.05)
        assert detached.state is InstanceState.RUNNING
        await manager.shutdown()

    asyncio.run(go())


def test_a_launch_nobody_attaches_to_ends_after_the_grace_period(tmp_path: Path) -> None:
    async def go() -> None:
        manager, sha, _ = _running(tmp_path, unattached_grace_s=0.05)
        orphan = await manager.launch(sha, user=ALICE)
        watched = await manager.launch(sha, user=ALICE)
        detached = await manager.launch(sha, user=ALICE, detached=True)
        with manager.attached(watched):
            info = await asyncio.wait_for(orphan.supervisor.wait(), 1.0)
            assert info.message == CLIENT_GONE_MESSAGE
            assert watched.state is InstanceState.RUNNING and detached.state is InstanceState.RUNNING
            await manager.terminate(watched.instance_id)
        await manager.shutdown()

    asyncio.run(go())


def test_the_spawner_refuses_to_start_open_to_anyone(tmp_path: Path) -> None:
    config = SpawnerConfig(state_dir=tmp_path, socket_dir=tmp_path)
    with pytest.raises(ConfigError, match="--api-keys-file"):
        make_authenticator(config)
    with pytest.raises(ConfigError, match="loopback"):
        make_authenticator(SpawnerConfig(state_dir=tmp_path, socket_dir=tmp_path, insecure_local=True,
                                         listen_address="0.0.0.0:7410"))
    assert make_authenticator(SpawnerConfig(state_dir=tmp_path, socket_dir=tmp_path, insecure_local=True))
    assert is_loopback_address("localhost:1") and is_loopback_address("[::1]:1")
    assert not is_loopback_address("10.0.0.1:1")


def test_another_users_program_reads_exactly_like_an_unknown_one_and_its_tag_cannot_be_moved(
    tmp_path: Path,
) -> None:
    async def go() -> None:
        manager, sha, _ = _running(tmp_path)
        manager.store.set_tag("tool", sha)
        unknown_sha = "0" * 64
        for ref, unknown in ((sha, unknown_sha), ("tool", "nothing")):
            with pytest.raises(ProgramNotFound) as hidden:
                await manager.launch(ref, user=BOB)
            with pytest.raises(ProgramNotFound) as missing:
                await manager.launch(unknown, user=BOB)
            assert str(hidden.value) == str(missing.value).replace(unknown, ref).replace("nothing:latest", "tool:latest")
        with pytest.raises(TagTaken, match="another user's program"):
            manager.check_tags(("tool:latest",), BOB)
        manager.check_tags(("tool",), ALICE)
        manager.check_tags(("fresh",), BOB)

    asyncio.run(go())
