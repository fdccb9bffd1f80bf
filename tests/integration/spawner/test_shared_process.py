"""Shared controller processes (LaunchRequest.share_process) with a real scheduler and bubblewrap sandboxes:
who shares a process with whom, what each instance sees of its own, and what a shared fate means."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from l4m.client import Client
from l4m.keys import KeyStore
from l4m.spawner.config import SpawnerConfig
from l4m.spawner.process_sandbox import ProcessSandbox
from l4m.spawner.sandbox import Sandbox
from l4m.v1 import spawner_pb2
from tests.integration.spawner.conftest import SchedulerCluster
from tests.integration.spawner.harness import (
    RunningSpawner,
    attach,
    exit_of,
    log_lines,
    running_spawner,
    upload,
)

# Prints a mark its process drew when it loaded the program (process ids repeat: each sandbox has its own pid
# namespace), generates a token, waits for "go" from the user (so that launches overlap), prints
# its arguments to stdout and stderr, and ends the way its first argument says.
PROGRAM = """
import asyncio, os, sys

MARK = os.urandom(8).hex()

async def main(ctx):
    print(f"process {MARK}", flush=True)
    c = ctx.new_context()
    c.fill([1, 2, 3, 4])
    token, _ = await c.next_token()
    await ctx.send(f"{ctx.args[1]} token {token}")
    if await ctx.receive(timeout_s=60) != "go":
        return 5
    print(f"out {ctx.args[1]}", flush=True)
    print(f"err {ctx.args[1]}", file=sys.stderr, flush=True)
    how = ctx.args[0]
    if how == "raise":
        raise ValueError(f"boom {ctx.args[1]}")
    if how == "exit7":
        return 7
    if how == "crash":
        os._exit(9)
    if how == "hang":
        import time
        time.sleep(3600)
    if how == "sleep":
        await asyncio.sleep(3600)
"""


def _config(tmp_path: Path, cluster: SchedulerCluster, **overrides: object) -> SpawnerConfig:
    return cluster.spawner_config(tmp_path, "shared", **overrides)


async def _launch(spawner: RunningSpawner, sha: str, how: str, name: str, share: bool = True,
                  **limits: int) -> str:
    # Detached: `_wait_for_message`'s Attach ends before the instance does.
    request = spawner_pb2.LaunchRequest(program=sha, args=[how, name], share_process=share, detached=True,
                                        limits=spawner_pb2.Limits(**limits) if limits else None)
    return (await spawner.stub.Launch(request, timeout=30)).instance_id


async def _wait_for_message(spawner: RunningSpawner, instance_id: str) -> None:
    """Until the instance has said its token (it is then running its program, in its process)."""
    call = spawner.stub.Attach(spawner_pb2.AttachRequest(instance_id=instance_id), timeout=60)
    async for event in call:
        if event.HasField("message"):
            call.cancel()
            return
        assert not event.HasField("exit"), event


async def _info(spawner: RunningSpawner, instance_id: str) -> spawner_pb2.InstanceInfo:
    listed = await spawner.stub.ListInstances(spawner_pb2.ListInstancesRequest(), timeout=30)
    return next(i for i in listed.instances if i.instance_id == instance_id)


def _process_mark(events: list[spawner_pb2.AttachResponse]) -> str:
    return next(line for line in log_lines(events) if line.startswith("process "))


def test_launches_of_one_program_share_a_process_and_keep_their_own_output_and_exits(
    sandbox: Sandbox, scheduler_cluster: SchedulerCluster, tmp_path: Path
) -> None:
    """On every backend: a cold process sandbox, a warm one, a Docker container."""

    async def go() -> tuple[list[list[spawner_pb2.AttachResponse]], list[spawner_pb2.InstanceInfo], str]:
        async with running_spawner(_config(tmp_path, scheduler_cluster), sandbox) as spawner:
            sha = await upload(spawner.stub, PROGRAM)
            ids = [await _launch(spawner, sha, how, name)
                   for how, name in (("ok", "a"), ("raise", "b"), ("exit7", "c"))]
            attaches = [asyncio.ensure_future(attach(spawner.stub, i)) for i in ids]
            for instance_id in ids:
                await _wait_for_message(spawner, instance_id)
            infos = [await _info(spawner, i) for i in ids]
            for instance_id in ids:
                await spawner.stub.SendMessage(spawner_pb2.SendMessageRequest(instance_id=instance_id, text="go"))
            events = list(await asyncio.gather(*attaches))
            alone = await _launch(spawner, sha, "ok", "d", share=False)
            await spawner.stub.SendMessage(spawner_pb2.SendMessageRequest(instance_id=alone, text="go"))
            return events, infos, _process_mark(await attach(spawner.stub, alone))

    events, infos, alone_mark = asyncio.run(go())
    process_ids = {info.shared_process for info in infos}
    assert len(process_ids) == 1 and "" not in process_ids, infos
    marks = {_process_mark(e) for e in events}
    assert len(marks) == 1, marks
    assert alone_mark not in marks
    ok, raised, exit7 = events
    assert exit_of(ok).reason == spawner_pb2.EXIT_REASON_EXITED, ok
    assert "out a" in log_lines(ok) and "err a" in log_lines(ok)
    assert not {"out b", "err b", "out c", "err c"} & set(log_lines(ok)), log_lines(ok)
    assert exit_of(raised).reason == spawner_pb2.EXIT_REASON_CRASHED
    assert exit_of(raised).exit_code == 1 and "ValueError: boom b" in exit_of(raised).message, exit_of(raised)
    assert any("Traceback" in line for line in log_lines(raised))
    assert exit_of(exit7).reason == spawner_pb2.EXIT_REASON_CRASHED and exit_of(exit7).exit_code == 7
    assert [e.message.text.split()[0] for e in ok if e.HasField("message")] == ["a"]



# Tokenizes, says which tokenizer object its process gave it and the ids, and waits for "go".
TEXT_PROGRAM = """
async def main(ctx):
    ids = ctx.tokenizer.encode("hello there")
    await ctx.send(f"{id(ctx.tokenizer)} {ids}")
    if await ctx.receive(timeout_s=60) != "go":
        return 5
"""


def test_the_instances_of_a_process_share_one_tokenizer(
    warm_process_sandbox: ProcessSandbox, scheduler_cluster: SchedulerCluster, tmp_path: Path
) -> None:
    """The tokenizer is fetched and built once a process (`ModelInfo.tokenizer_sha256` names it), not once
    an instance: while both instances live, their tokenizers are one object."""

    async def go() -> tuple[list[str], list[spawner_pb2.InstanceInfo], list[list[spawner_pb2.AttachResponse]]]:
        async with running_spawner(_config(tmp_path, scheduler_cluster), warm_process_sandbox) as spawner:
            sha = await upload(spawner.stub, TEXT_PROGRAM)
            ids = [await _launch(spawner, sha, "ok", name) for name in ("a", "b")]
            attaches = [asyncio.ensure_future(attach(spawner.stub, i)) for i in ids]
            said = [await _first_message(spawner, i) for i in ids]
            infos = [await _info(spawner, i) for i in ids]
            for instance_id in ids:
                await _go(spawner, instance_id)
            return said, infos, list(await asyncio.gather(*attaches))

    said, infos, events = asyncio.run(go())
    assert len({info.shared_process for info in infos} - {""}) == 1, infos
    (tokenizer_a, ids_a), (tokenizer_b, ids_b) = (text.split(" ", 1) for text in said)
    assert tokenizer_a == tokenizer_b, said
    assert ids_a == ids_b and ids_a.startswith("[") and len(ids_a) > 2, said
    assert [exit_of(e).reason for e in events] == [spawner_pb2.EXIT_REASON_EXITED] * 2, events


async def _first_message(spawner: RunningSpawner, instance_id: str) -> str:
    call = spawner.stub.Attach(spawner_pb2.AttachRequest(instance_id=instance_id), timeout=60)
    async for event in call:
        if event.HasField("message"):
            call.cancel()
            return event.message.text
        assert not event.HasField("exit"), event
    raise AssertionError(f"{instance_id} ended its attach stream without a message")


async def _go(spawner: RunningSpawner, instance_id: str) -> None:
    await spawner.stub.SendMessage(spawner_pb2.SendMessageRequest(instance_id=instance_id, text="go"), timeout=30)


async def _terminate(spawner: RunningSpawner, instance_id: str) -> None:
    await spawner.stub.Terminate(spawner_pb2.TerminateRequest(instance_id=instance_id), timeout=30)


def test_a_crash_of_the_process_ends_every_instance_in_it_and_the_next_launch_gets_a_new_one(
    warm_process_sandbox: ProcessSandbox, scheduler_cluster: SchedulerCluster, tmp_path: Path
) -> None:
    async def go() -> tuple[list[list[spawner_pb2.AttachResponse]], list[spawner_pb2.InstanceInfo]]:
        async with running_spawner(_config(tmp_path, scheduler_cluster), warm_process_sandbox) as spawner:
            sha = await upload(spawner.stub, PROGRAM)
            crash, sleeper = await _launch(spawner, sha, "crash", "a"), await _launch(spawner, sha, "sleep", "b")
            attaches = [asyncio.ensure_future(attach(spawner.stub, i)) for i in (crash, sleeper)]
            for instance_id in (crash, sleeper):
                await _wait_for_message(spawner, instance_id)
            await _go(spawner, crash)
            events = list(await asyncio.gather(*attaches))
            after = await _launch(spawner, sha, "ok", "c")
            await _wait_for_message(spawner, after)
            await _go(spawner, after)
            events.append(await attach(spawner.stub, after))
            return events, [await _info(spawner, i) for i in (crash, sleeper, after)]

    (crash, sleeper, after), infos = asyncio.run(go())
    assert infos[0].shared_process == infos[1].shared_process != infos[2].shared_process, infos
    for events in (crash, sleeper):
        exit_ = exit_of(events)
        assert exit_.reason == spawner_pb2.EXIT_REASON_CRASHED and exit_.exit_code == 9, exit_
        assert f"its shared process {infos[0].shared_process} ended: exited with status 9" in exit_.message, exit_
    assert exit_of(after).reason == spawner_pb2.EXIT_REASON_EXITED, after


def test_a_stopped_instance_ends_alone_and_one_that_does_not_stop_takes_its_process_down(
    warm_process_sandbox: ProcessSandbox, scheduler_cluster: SchedulerCluster, tmp_path: Path
) -> None:
    async def go() -> tuple[list[list[spawner_pb2.AttachResponse]], spawner_pb2.InstanceState]:
        async with running_spawner(_config(tmp_path, scheduler_cluster), warm_process_sandbox) as spawner:
            sha = await upload(spawner.stub, PROGRAM)
            ids = [await _launch(spawner, sha, how, name) for how, name in (("sleep", "a"), ("sleep", "b"),
                                                                             ("hang", "c"))]
            attaches = [asyncio.ensure_future(attach(spawner.stub, i)) for i in ids]
            for instance_id in ids:
                await _wait_for_message(spawner, instance_id)
            await _terminate(spawner, ids[0])
            state_of_b = (await _info(spawner, ids[1])).state
            await _go(spawner, ids[2])
            await asyncio.sleep(0.5)  # c now blocks its process's event loop
            await _terminate(spawner, ids[2])
            return list(await asyncio.gather(*attaches)), state_of_b

    (stopped, beside, hung), state_of_b = asyncio.run(go())
    assert exit_of(stopped).reason == spawner_pb2.EXIT_REASON_TERMINATED, stopped
    assert state_of_b == spawner_pb2.INSTANCE_STATE_RUNNING
    assert exit_of(hung).reason == spawner_pb2.EXIT_REASON_TERMINATED, hung
    exit_b = exit_of(beside)
    assert exit_b.reason == spawner_pb2.EXIT_REASON_KILLED, exit_b
    assert "did not stop within 2 s" in exit_b.message and exit_of(hung).message, exit_b


def test_the_operator_caps_how_many_instances_share_a_process(
    warm_process_sandbox: ProcessSandbox, scheduler_cluster: SchedulerCluster, tmp_path: Path
) -> None:
    async def shared_processes(cap: int) -> list[str]:
        config = dataclasses.replace(_config(tmp_path / str(cap), scheduler_cluster), max_instances_per_process=cap)
        async with running_spawner(config, warm_process_sandbox) as spawner:
            sha = await upload(spawner.stub, PROGRAM)
            ids = [await _launch(spawner, sha, "sleep", name) for name in "abc"]
            for instance_id in ids:
                await _wait_for_message(spawner, instance_id)
            infos = [await _info(spawner, i) for i in ids]
            for instance_id in ids:
                await _terminate(spawner, instance_id)
            return [info.shared_process for info in infos]

    two = asyncio.run(shared_processes(2))
    assert two[0] == two[1] != two[2] and "" not in two, two
    assert asyncio.run(shared_processes(1)) == ["", "", ""]


# Opens a second control connection with its process's token, then (with "forge") reports on an instance
# that is not in its process; then waits, beside the other instance of its process.
FORGER = """
import asyncio, os, sys
from l4m.framed import connect_unix
from l4m.v1 import spawner_pb2
from l4m.wire import frames

class Reader(frames.FrameProtocol):
    def __init__(self):
        super().__init__(1 << 20)
        self.frames = asyncio.get_running_loop().create_future()
    def frame_received(self, kind, payload):
        if not self.frames.done():
            self.frames.set_result((kind, payload))

async def main(ctx):
    await ctx.send("up")
    if await ctx.receive(timeout_s=60) != "go":
        return 5
    reader = await connect_unix(asyncio.get_running_loop(), Reader, "/run/l4m/runtime.frames.sock")
    token = os.environ["L4M_SHARED_PROCESS_TOKEN"]
    reader.write(frames.encode(frames.RUNTIME_OPEN, spawner_pb2.FramedRuntimeOpen(
        protocol_version=frames.PROTOCOL_VERSION, process_token=token)))
    kind, payload = await reader.frames
    code, message = frames.read_status(payload)
    print(f"second connection: {code.name}: {message}", flush=True)
    if ctx.args == ["forge"]:
        process = sys.stdout._process
        process.write(frames.encode(frames.SHARED_REPORT, spawner_pb2.SharedProcessReport(
            instance_id="i-0123456789abcdef", stdout=b"not mine")))
    await asyncio.sleep(60)
"""


def test_a_process_speaks_only_on_its_own_connection_and_only_of_its_own_instances(
    warm_process_sandbox: ProcessSandbox, scheduler_cluster: SchedulerCluster, tmp_path: Path
) -> None:
    async def go() -> list[list[spawner_pb2.AttachResponse]]:
        async with running_spawner(_config(tmp_path, scheduler_cluster), warm_process_sandbox) as spawner:
            sha = await upload(spawner.stub, FORGER)
            launches = [spawner_pb2.LaunchRequest(program=sha, args=args, share_process=True, detached=True)
                        for args in (["look"], ["forge"])]
            ids = [(await spawner.stub.Launch(request, timeout=30)).instance_id for request in launches]
            attaches = [asyncio.ensure_future(attach(spawner.stub, i)) for i in ids]
            for instance_id in ids:
                await _wait_for_message(spawner, instance_id)
            await _go(spawner, ids[0])
            await asyncio.sleep(1.0)
            await _go(spawner, ids[1])
            return list(await asyncio.gather(*attaches))

    looked, forged = asyncio.run(go())
    assert "second connection: UNAUTHENTICATED: missing or unknown process_token" in log_lines(looked), looked
    # The spawner refuses the report and ends the connection; the process hears why and exits (or is killed).
    for events in (looked, forged):
        exit_ = exit_of(events)
        assert exit_.reason in (spawner_pb2.EXIT_REASON_CRASHED, spawner_pb2.EXIT_REASON_KILLED), exit_
        assert ("(INVALID_ARGUMENT): a report on 'i-0123456789abcdef', which the spawner did not start in this "
                "process" in exit_.message or "its control connection to the spawner ended" in exit_.message), exit_


def test_other_users_other_programs_and_launches_that_do_not_ask_never_share(
    warm_process_sandbox: ProcessSandbox, scheduler_cluster: SchedulerCluster, tmp_path: Path
) -> None:
    store = KeyStore.load(tmp_path / "api-keys.json")
    alice_key, bob_key = store.add("alice"), store.add("bob")
    config = _config(tmp_path, scheduler_cluster, api_keys_file=store.path)

    async def go() -> dict[str, str]:
        async with running_spawner(config, warm_process_sandbox) as spawner:
            alice = Client(spawner.address, timeout_s=30, api_key=alice_key)
            bob = Client(spawner.address, timeout_s=30, api_key=bob_key)
            try:
                program = await alice.upload(PROGRAM.encode(), "p.py")
                other = await alice.upload(PROGRAM.encode() + b"\n# another program\n", "q.py")
                assert program == await bob.upload(PROGRAM.encode(), "p.py")
                launches = {"alice 1": (alice, program, True), "alice 2": (alice, program, True),
                            "bob": (bob, program, True), "alice alone": (alice, program, False),
                            "alice other": (alice, other, True)}
                ids = {name: await client.launch(sha, ["sleep", name], detached=True, share_process=share)
                       for name, (client, sha, share) in launches.items()}
                infos = {info.instance_id: info for client in (alice, bob) for info in await client.list_instances()}
                for name, instance_id in ids.items():
                    await launches[name][0].terminate(instance_id)
                return {name: infos[instance_id].shared_process for name, instance_id in ids.items()}
            finally:
                await alice.close()
                await bob.close()

    processes = asyncio.run(go())
    assert processes["alice 1"] == processes["alice 2"] != "", processes
    assert processes["alice alone"] == "", processes
    assert len({processes["alice 1"], processes["bob"], processes["alice other"]}) == 3, processes


# Feeds more tokens than its budget of 8 (the scheduler traps it), or waits beside it.
OVER_BUDGET = """
import asyncio

async def main(ctx):
    await ctx.send("up")
    if ctx.args == ["wait"]:
        await ctx.receive(timeout_s=60)
        return
    c = ctx.new_context()
    c.fill(list(range(1, 40)))
    await c.step()
"""


def test_a_trapped_instance_ends_trapped_and_alone(
    warm_process_sandbox: ProcessSandbox, scheduler_cluster: SchedulerCluster, tmp_path: Path
) -> None:
    async def go() -> tuple[list[spawner_pb2.AttachResponse], list[spawner_pb2.AttachResponse]]:
        async with running_spawner(_config(tmp_path, scheduler_cluster), warm_process_sandbox) as spawner:
            sha = await upload(spawner.stub, OVER_BUDGET)
            waiting = (await spawner.stub.Launch(spawner_pb2.LaunchRequest(
                program=sha, args=["wait"], share_process=True, detached=True), timeout=30)).instance_id
            await _wait_for_message(spawner, waiting)
            trapped = (await spawner.stub.Launch(spawner_pb2.LaunchRequest(
                program=sha, share_process=True, detached=True,
                limits=spawner_pb2.Limits(max_tokens=8)), timeout=30)).instance_id
            trapped_events = await attach(spawner.stub, trapped)
            info_trapped, info_waiting = await _info(spawner, trapped), await _info(spawner, waiting)
            await _go(spawner, waiting)
            assert info_waiting.state == spawner_pb2.INSTANCE_STATE_RUNNING
            assert info_trapped.shared_process == info_waiting.shared_process != ""
            return trapped_events, await attach(spawner.stub, waiting)

    trapped, waiting = asyncio.run(go())
    exit_ = exit_of(trapped)
    assert exit_.reason == spawner_pb2.EXIT_REASON_TRAPPED and "budget" in exit_.message, exit_
    assert exit_of(waiting).reason == spawner_pb2.EXIT_REASON_EXITED, waiting
