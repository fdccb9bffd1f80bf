"""Users of a real spawner (bubblewrap sandboxes, keys in a key store): a call without a valid key is
refused, a user sees and touches only its own instances and programs (an admin all), quotas refuse
with their name, and Ctrl-C on a real `l4m run` ends the instance within a second and, with a real
scheduler, gives every page back."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from l4m.client import Client
from l4m.errors import L4MError
from l4m.keys import KeyStore
from l4m.spawner.config import SpawnerConfig
from l4m.spawner.process_sandbox import ProcessSandbox
from l4m.v1 import spawner_pb2
from tests.integration.harness import service_env
from tests.integration.spawner.conftest import SchedulerCluster
from tests.integration.spawner.harness import RunningSpawner, running_spawner

SLEEPER = "import asyncio\n\nasync def main(ctx):\n    await ctx.send('up')\n    await asyncio.sleep(600)\n"
SLEEPER_SCRIPT = "import time\nprint('up', flush=True)\ntime.sleep(600)\n"
ENDED_BY_CTRL_C_S = 1.0


@dataclass
class Users:
    keys_file: Path
    alice: str
    bob: str
    root: str  # an admin


def _users(tmp_path: Path) -> Users:
    store = KeyStore.load(tmp_path / "api-keys.json")
    alice = store.add("alice", "user", max_instances=2)
    return Users(store.path, alice, store.add("bob"), store.add("root", "admin"))


def _config(tmp_path: Path, users: Users, **overrides: object) -> SpawnerConfig:
    return SpawnerConfig(
        state_dir=tmp_path / "state",
        socket_dir=tmp_path / "sockets",
        spawner_id=f"users-{tmp_path.name[-20:]}",
        controller_runner="",
        api_keys_file=users.keys_file,
        **overrides,
    )


@asynccontextmanager
async def _serving(
    config: SpawnerConfig, sandbox: ProcessSandbox, *keys: str | None
) -> AsyncIterator[tuple[RunningSpawner, list[Client]]]:
    """A running spawner and one client per key (None: no key)."""
    async with running_spawner(config, sandbox) as spawner:
        clients = [Client(spawner.address, timeout_s=30, api_key=key) for key in keys]
        try:
            yield spawner, clients
        finally:
            for client in clients:
                await client.close()


async def _launch(client: Client, source: str, detached: bool = False) -> str:
    sha = await client.upload(source.encode(), "p.py")
    return await client.launch(sha, detached=detached)


def test_calls_without_a_valid_key_are_unauthenticated_and_health_stays_open(
    process_sandbox: ProcessSandbox, tmp_path: Path
) -> None:
    users = _users(tmp_path)

    async def go() -> None:
        keys = (None, "l4m_" + "x" * 43, users.alice)
        async with _serving(_config(tmp_path, users), process_sandbox, *keys) as (spawner, clients):
            anonymous, wrong, alice = clients
            for client, detail in ((anonymous, "needs an API key"), (wrong, "not known")):
                for call in (client.list_instances(), client.upload(b"print(1)\n", "p.py"),
                             client.terminate("i-x"), client.send("i-x", "hi")):
                    with pytest.raises(L4MError, match=f"refused the API key \\(UNAUTHENTICATED\\): .*{detail}"):
                        await call
            assert await alice.list_instances() == []
            health = health_pb2_grpc.HealthStub(spawner.channel)
            answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await spawner.stub.ListInstances(spawner_pb2.ListInstancesRequest(), timeout=10)
            assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED

    asyncio.run(go())


def test_a_user_touches_only_its_own_instances_and_programs_and_an_admin_all(
    process_sandbox: ProcessSandbox, tmp_path: Path
) -> None:
    users = _users(tmp_path)

    async def go() -> None:
        keys = (users.alice, users.bob, users.root)
        async with _serving(_config(tmp_path, users), process_sandbox, *keys) as (_, (alice, bob, root)):
            sha = await alice.upload(SLEEPER_SCRIPT.encode(), "p.py")
            instance_id = await alice.launch(sha, ["my secret prompt"], detached=True)
            assert [i.instance_id for i in await alice.list_instances()] == [instance_id]
            (info,) = await root.list_instances()
            assert (info.user, info.detached, list(info.args)) == ("alice", True, ["my secret prompt"])
            assert await bob.list_instances() == []
            for call in (bob.send(instance_id, "hi"), bob.terminate(instance_id), bob.send("i-unknown", "hi")):
                with pytest.raises(L4MError, match=r"\(NOT_FOUND\): no instance"):
                    await call
            with pytest.raises(L4MError, match=r"attach failed \(NOT_FOUND\): no instance"):
                await anext(bob.attach(instance_id))
            # Bob knows the program's digest but never uploaded it: it does not exist for him.
            with pytest.raises(L4MError, match=r"launch failed \(NOT_FOUND\)"):
                await bob.launch(sha)
            programs = await bob._stub.ListPrograms(spawner_pb2.ListProgramsRequest(),
                                                    metadata=bob._metadata, timeout=10)
            assert list(programs.programs) == []
            await root.send(instance_id, "from the admin")
            await root.terminate(instance_id)
            (info,) = await alice.list_instances()
            assert info.state == spawner_pb2.INSTANCE_STATE_EXITED
            assert info.exit.reason == spawner_pb2.EXIT_REASON_TERMINATED

    asyncio.run(go())


def test_the_instance_quota_refuses_with_its_name(process_sandbox: ProcessSandbox, tmp_path: Path) -> None:
    users = _users(tmp_path)  # alice may run 2 at once, bob the spawner's default of 1

    async def go() -> None:
        config = _config(tmp_path, users, max_instances_per_user=1)
        async with _serving(config, process_sandbox, users.alice, users.bob) as (_, (alice, bob)):
            first = await _launch(alice, SLEEPER_SCRIPT, detached=True)
            await _launch(alice, SLEEPER_SCRIPT, detached=True)
            with pytest.raises(L4MError, match=r"RESOURCE_EXHAUSTED.*max instances per user: 2"):
                await _launch(alice, SLEEPER_SCRIPT, detached=True)
            await _launch(bob, SLEEPER_SCRIPT, detached=True)
            with pytest.raises(L4MError, match=r"RESOURCE_EXHAUSTED.*user 'bob'.*max instances per user: 1"):
                await _launch(bob, SLEEPER_SCRIPT, detached=True)
            await alice.terminate(first)  # an ended instance no longer counts
            await _launch(alice, SLEEPER_SCRIPT, detached=True)

    asyncio.run(go())


def test_a_launch_nobody_attaches_to_ends_after_the_grace_period(
    process_sandbox: ProcessSandbox, tmp_path: Path
) -> None:
    users = _users(tmp_path)

    async def go() -> None:
        config = _config(tmp_path, users, unattached_grace_s=0.5)
        async with _serving(config, process_sandbox, users.alice) as (_, (alice,)):
            orphan = await _launch(alice, SLEEPER_SCRIPT)
            detached = await _launch(alice, SLEEPER_SCRIPT, detached=True)
            await asyncio.sleep(2.0)
            states = {i.instance_id: i for i in await alice.list_instances()}
            assert states[orphan].exit.message == "its client went away", states[orphan]
            assert states[detached].state == spawner_pb2.INSTANCE_STATE_RUNNING

    asyncio.run(go())


async def _wait_for_line(stream: asyncio.StreamReader, text: str, timeout_s: float = 60.0) -> None:
    async def read() -> None:
        while (line := await stream.readline()) and text not in line.decode():
            pass

    await asyncio.wait_for(read(), timeout_s)


async def _ctrl_c_on_l4m_run(spawner: RunningSpawner, key_file: Path, program: Path) -> float:
    """Runs `l4m run PROGRAM` until it prints "up", sends it SIGINT; seconds until the spawner lists
    the instance as ended because its client went away."""
    argv = [sys.executable, "-m", "l4m.cli", "run", "--spawner", spawner.address, "--api-key-file", str(key_file),
            str(program)]  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=service_env()
    )
    try:
        await _wait_for_line(process.stdout, "up")
        process.send_signal(signal.SIGINT)
        interrupted_at = time.monotonic()
        instances = spawner.server.manager.list_instances()
        assert len(instances) == 1, instances
        await asyncio.wait_for(instances[0].supervisor.wait(), 10)
        ended_after_s = time.monotonic() - interrupted_at
        assert instances[0].exit_info.message == "its client went away", instances[0].exit_info
        assert await asyncio.wait_for(process.wait(), 10) == 130
        return ended_after_s
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def _key_file(tmp_path: Path, key: str) -> Path:
    path = tmp_path / "alice.key"
    path.write_text(key + "\n")
    os.chmod(path, 0o600)
    return path


def test_ctrl_c_on_l4m_run_ends_the_instance_within_a_second(process_sandbox: ProcessSandbox, tmp_path: Path) -> None:
    users = _users(tmp_path)
    program = tmp_path / "sleeper.py"
    program.write_text(SLEEPER_SCRIPT)

    async def go() -> float:
        async with running_spawner(_config(tmp_path, users), process_sandbox) as spawner:
            return await _ctrl_c_on_l4m_run(spawner, _key_file(tmp_path, users.alice), program)

    assert asyncio.run(go()) < ENDED_BY_CTRL_C_S


GENERATE_FOREVER = """
async def main(ctx):
    c = ctx.new_context()
    c.set_window(64)
    c.fill(list(range(1, 50)))
    await c.next_token()
    await ctx.send("up")
    while True:
        await c.next_token()
"""


async def _kv_pages(address: str) -> tuple[int, int]:
    from l4m.model import Model
    from l4m.session import Session

    session = await Session.connect(address)
    try:
        stats = await (await Model.load(session)).scheduler_stats()
    finally:
        await session.close()
    (executor,) = stats["executors"]
    return executor["kv_pages_free"], executor["kv_pages_total"]


def test_ctrl_c_on_l4m_run_gives_the_schedulers_pages_back(
    process_sandbox: ProcessSandbox, scheduler_cluster: SchedulerCluster, tmp_path: Path
) -> None:
    users = _users(tmp_path)
    program = tmp_path / "generate.py"
    program.write_text(GENERATE_FOREVER)

    async def go() -> float:
        config = SpawnerConfig(
            state_dir=tmp_path / "state",
            socket_dir=scheduler_cluster.socket_dir,
            spawner_id=f"users-sched-{tmp_path.name[-16:]}",
            scheduler_registry_address=scheduler_cluster.registry_address,
            cluster_secret_file=scheduler_cluster.cluster_secret_file,
            api_keys_file=users.keys_file,
        )
        async with running_spawner(config, process_sandbox) as spawner:
            ended_after_s = await _ctrl_c_on_l4m_run(spawner, _key_file(tmp_path, users.alice), program)
            deadline = time.monotonic() + 5
            while (pages := await _kv_pages(scheduler_cluster.scheduler_address))[0] != pages[1]:
                assert time.monotonic() < deadline, f"pages still held after Ctrl-C: {pages}"
                await asyncio.sleep(0.1)
            return ended_after_s

    assert asyncio.run(go()) < ENDED_BY_CTRL_C_S


# A plain script (no scheduler here): says "up", waits for a message, answers it, exits 4.
TALKER = """
import os, sys, grpc
from l4m.v1 import spawner_pb2, spawner_pb2_grpc
metadata = (("l4m-instance-token", os.environ["L4M_INSTANCE_TOKEN"]),)
with grpc.insecure_channel(os.environ["L4M_RUNTIME_ADDR"]) as channel:
    runtime = spawner_pb2_grpc.RuntimeServiceStub(channel)
    runtime.SendToUser(spawner_pb2.SendToUserRequest(text="up"), metadata=metadata, timeout=10)
    got = runtime.ReceiveFromUser(spawner_pb2.ReceiveFromUserRequest(timeout_ms=60000), metadata=metadata, timeout=65)
    runtime.SendToUser(spawner_pb2.SendToUserRequest(text="got " + got.text), metadata=metadata, timeout=10)
sys.exit(4)
"""


def _l4m(*args: str) -> list[str]:
    return [sys.executable, "-m", "l4m.cli", *args]


def test_a_detached_run_outlives_its_client_and_attach_follows_it(
    process_sandbox: ProcessSandbox, tmp_path: Path
) -> None:
    users = _users(tmp_path)
    program = tmp_path / "waits.py"
    program.write_text(TALKER)

    async def go() -> None:
        async with _serving(_config(tmp_path, users), process_sandbox, users.alice) as (spawner, (alice,)):
            key = ["--spawner", spawner.address, "--api-key-file", str(_key_file(tmp_path, users.alice))]
            detach = await asyncio.create_subprocess_exec(
                *_l4m("run", "--detach", *key, str(program)), stdout=asyncio.subprocess.PIPE, env=service_env()
            )
            out, _ = await asyncio.wait_for(detach.communicate(), 60)
            assert detach.returncode == 0
            instance_id = out.decode().strip()
            # Ctrl-C on `l4m attach` of a detached instance leaves it running.
            first = await asyncio.create_subprocess_exec(
                *_l4m("attach", instance_id, *key), stdout=asyncio.subprocess.PIPE, env=service_env()
            )
            await _wait_for_line(first.stdout, "up")
            first.send_signal(signal.SIGINT)
            assert await asyncio.wait_for(first.wait(), 10) == 130
            await asyncio.sleep(0.5)
            (info,) = await alice.list_instances()
            assert info.state == spawner_pb2.INSTANCE_STATE_RUNNING and info.detached
            second = await asyncio.create_subprocess_exec(
                *_l4m("attach", instance_id, *key), stdout=asyncio.subprocess.PIPE, env=service_env()
            )
            await _wait_for_line(second.stdout, "up")
            await alice.send(instance_id, "hello")
            rest, _ = await asyncio.wait_for(second.communicate(), 30)
            assert rest.decode() == "got hello\n"
            assert second.returncode == 4  # the controller's own status, as `l4m run` exits

    asyncio.run(go())


def test_tls_end_to_end_with_a_key(process_sandbox: ProcessSandbox, tmp_path: Path) -> None:
    from tests.integration.tls_certs import make_certificates

    users = _users(tmp_path)
    certificates = make_certificates(tmp_path / "tls")

    async def go() -> None:
        config = _config(tmp_path, users, tls_cert=certificates.cert_path, tls_key=certificates.key_path)
        async with running_spawner(config, process_sandbox) as spawner:
            async with Client(spawner.address, api_key=users.alice, tls_ca=certificates.ca_path) as alice:
                assert await alice.list_instances() == []
            async with Client(spawner.address, api_key=users.alice, timeout_s=3) as plain:
                with pytest.raises(L4MError, match="UNAVAILABLE"):
                    await plain.list_instances()

    asyncio.run(go())


def test_l4m_ps_lists_and_l4m_stop_ends_only_the_callers_own_instances(
    process_sandbox: ProcessSandbox, tmp_path: Path
) -> None:
    users = _users(tmp_path)
    (tmp_path / "bob.key").write_text(users.bob + "\n")
    os.chmod(tmp_path / "bob.key", 0o600)

    async def cli(spawner: RunningSpawner, key_file: Path, *args: str) -> tuple[int, str, str]:
        process = await asyncio.create_subprocess_exec(
            *_l4m(*args, "--spawner", spawner.address, "--api-key-file", str(key_file)),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=service_env())
        out, err = await asyncio.wait_for(process.communicate(), 60)
        return process.returncode or 0, out.decode(), err.decode()

    async def go() -> None:
        async with _serving(_config(tmp_path, users), process_sandbox, users.alice, users.bob) as (
                spawner, (alice, bob)):
            alices = await _launch(alice, SLEEPER_SCRIPT, detached=True)
            bobs = await _launch(bob, SLEEPER_SCRIPT, detached=True)
            alice_key = _key_file(tmp_path, users.alice)

            code, out, _ = await cli(spawner, alice_key, "ps")
            assert code == 0
            header, *rows = out.splitlines()
            assert header.split() == ["ID", "USER", "STATUS", "AGE", "PROGRAM", "PROCESS", "PARENT", "ARGS"]
            assert [row.split()[:3] for row in rows] == [[alices, "alice", "running"]], out

            code, _, err = await cli(spawner, alice_key, "stop", bobs)
            assert code == 1 and "NOT_FOUND" in err and bobs in err, err
            assert (await bob.list_instances())[0].state == spawner_pb2.INSTANCE_STATE_RUNNING

            code, _, err = await cli(spawner, alice_key, "stop", alices)
            assert code == 0, err
            (info,) = await alice.list_instances()
            assert info.exit.reason == spawner_pb2.EXIT_REASON_TERMINATED
            assert (await cli(spawner, alice_key, "ps"))[1].splitlines()[1:] == []
            code, out, _ = await cli(spawner, alice_key, "ps", "--all")
            assert [row.split()[:3] for row in out.splitlines()[1:]] == [[alices, "alice", "terminated"]], out

    asyncio.run(go())
