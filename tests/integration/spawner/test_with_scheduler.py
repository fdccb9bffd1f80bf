"""The spawner with a real scheduler (and its simulated executor): controllers run through the SDK's
runner, reach the scheduler over /run/l4m/scheduler.sock, get trapped, and give back what they held."""

from __future__ import annotations

import asyncio
from pathlib import Path

from l4m.spawner.config import SpawnerConfig
from l4m.spawner.process_sandbox import ProcessSandbox
from l4m.spawner.sandbox import Sandbox
from l4m.v1 import spawner_pb2
from tests.integration.spawner.conftest import SchedulerCluster
from tests.integration.spawner.harness import attach, exit_of, log_lines, running_spawner, upload

HELLO = """
async def main(ctx):
    c = ctx.new_context()
    c.fill([1, 2, 3, 4])
    token, _ = await c.next_token()
    await ctx.send(f"next token {token}")
    print("done", flush=True)
"""


def _config(tmp_path: Path, cluster: SchedulerCluster, **overrides: object) -> SpawnerConfig:
    return cluster.spawner_config(tmp_path, "sched", **overrides)


def test_a_controller_runs_through_the_sdk_runner(
    sandbox: Sandbox, scheduler_cluster: SchedulerCluster, tmp_path: Path
) -> None:
    async def go() -> list[spawner_pb2.AttachResponse]:
        async with running_spawner(_config(tmp_path, scheduler_cluster), sandbox) as spawner:
            sha = await upload(spawner.stub, HELLO)
            launched = await spawner.stub.Launch(spawner_pb2.LaunchRequest(program=sha), timeout=30)
            return await attach(spawner.stub, launched.instance_id)

    events = asyncio.run(go())
    assert exit_of(events).reason == spawner_pb2.EXIT_REASON_EXITED, events
    assert [e.message.text for e in events if e.HasField("message")][0].startswith("next token "), events
    assert "done" in log_lines(events)


# Feeds more tokens than its budget of 8: the scheduler traps it (TRAP_KIND_TOKEN_BUDGET). With
# "hold", it then sleeps, so only the trap the scheduler reports to the spawner can end it.
OVER_BUDGET = """
import asyncio, sys

async def main(ctx):
    c = ctx.new_context()
    c.fill(list(range(1, 40)))
    try:
        await c.step()
    except Exception as error:
        print("saw", type(error).__name__, flush=True)
        if ctx.args == ["hold"]:
            await asyncio.sleep(3600)
        raise
"""


def _run_over_budget(
    process_sandbox: ProcessSandbox, cluster: SchedulerCluster, tmp_path: Path, args: list[str]
):
    async def go() -> list[spawner_pb2.AttachResponse]:
        async with running_spawner(_config(tmp_path, cluster), process_sandbox) as spawner:
            sha = await upload(spawner.stub, OVER_BUDGET)
            request = spawner_pb2.LaunchRequest(
                program=sha, args=args, limits=spawner_pb2.Limits(max_tokens=8, wall_time_ms=60_000)
            )
            launched = await spawner.stub.Launch(request, timeout=30)
            return await attach(spawner.stub, launched.instance_id)

    return asyncio.run(go())


def test_a_trap_the_scheduler_reports_stops_the_sandbox(
    process_sandbox: ProcessSandbox, scheduler_cluster: SchedulerCluster, tmp_path: Path
) -> None:
    events = _run_over_budget(process_sandbox, scheduler_cluster, tmp_path, ["hold"])
    exit = exit_of(events)
    assert exit.reason == spawner_pb2.EXIT_REASON_TRAPPED, events
    # Killed by the spawner (SIGKILL) on the scheduler's word: the controller would have slept on.
    assert "budget" in exit.message and exit.signal == 9, exit


def test_a_runner_that_exits_on_its_trap_is_reported_trapped(
    process_sandbox: ProcessSandbox, scheduler_cluster: SchedulerCluster, tmp_path: Path
) -> None:
    exit = exit_of(_run_over_budget(process_sandbox, scheduler_cluster, tmp_path, []))
    assert exit.reason == spawner_pb2.EXIT_REASON_TRAPPED, exit
    assert "budget" in exit.message, exit


# Holds pages on two streams and decodes forever; a window keeps its page count bounded.
GENERATE_FOREVER = """
async def main(ctx):
    contexts = []
    for i in range(2):
        c = ctx.new_context()
        c.set_window(64)
        c.fill(list(range(1, 50)))
        await c.next_token()
        contexts.append(c)
    await ctx.send("holding pages")
    while True:
        for c in contexts:
            await c.next_token()
"""


async def _scheduler_stats(address: str) -> dict:
    from l4m.model import Model
    from l4m.session import Session

    session = await Session.connect(address)
    try:
        return await (await Model.load(session)).scheduler_stats()
    finally:
        await session.close()


def _kv_pages(stats: dict) -> tuple[int, int]:
    (executor,) = stats["executors"]
    return executor["kv_pages_free"], executor["kv_pages_total"]


def test_killing_a_controller_mid_generation_frees_its_pages(
    process_sandbox: ProcessSandbox, scheduler_cluster: SchedulerCluster, tmp_path: Path
) -> None:
    async def go() -> None:
        async with running_spawner(_config(tmp_path, scheduler_cluster), process_sandbox) as spawner:
            sha = await upload(spawner.stub, GENERATE_FOREVER)
            launched = await spawner.stub.Launch(spawner_pb2.LaunchRequest(program=sha), timeout=30)
            request = spawner_pb2.AttachRequest(instance_id=launched.instance_id)
            events = []
            async for event in spawner.stub.Attach(request, timeout=60):
                events.append(event)
                if event.HasField("message") or event.HasField("exit"):
                    break
            assert events[-1].HasField("message"), events
            free, total = _kv_pages(await _scheduler_stats(scheduler_cluster.scheduler_address))
            assert total - free > 0, "the controller holds no pages while generating"
            await spawner.stub.Terminate(
                spawner_pb2.TerminateRequest(instance_id=launched.instance_id), timeout=30
            )
            exit = exit_of(await attach(spawner.stub, launched.instance_id))
            assert exit.reason == spawner_pb2.EXIT_REASON_TERMINATED, exit
            # The spawner destroys the instance in the scheduler as it exits: every page comes back.
            for _ in range(50):
                stats = await _scheduler_stats(scheduler_cluster.scheduler_address)
                if _kv_pages(stats)[0] == total:
                    break
                await asyncio.sleep(0.1)
            assert _kv_pages(stats)[0] == total, stats
            (executor,) = stats["executors"]
            assert executor["embed_slots_free"] == executor["embed_slots_total"], stats

    asyncio.run(go())


# Waits on its user, then uses every runtime call a controller makes over frames; reports what it got and
# whether anything imported grpc (an idle controller's 2.8 MiB: docs/benchmarks.md, "Controller memory").
FRAMES_ONLY = """
import sys

async def main(ctx):
    if ctx.args == ["child"]:
        await ctx.vars.append("log", "child ran")
        return
    await ctx.send("waiting")
    text = await ctx.receive()
    version = await ctx.vars.set("greeting", text)
    swapped = (await ctx.vars.compare_and_set("greeting", version, text + "!")).swapped
    child = await ctx.spawn(args=["child"])
    exit_ = await child.wait(timeout_s=60)
    greeting, log = (await ctx.vars.get("greeting")).text, (await ctx.vars.get("log")).text
    await ctx.send(f"{greeting} {swapped} {exit_.is_success} {log!r} grpc imported: {'grpc' in sys.modules}")
"""


def test_a_controller_on_frames_alone_receives_shares_and_spawns_without_grpc(
    process_sandbox: ProcessSandbox, scheduler_cluster: SchedulerCluster, tmp_path: Path
) -> None:
    config = _config(tmp_path, scheduler_cluster, scheduler_framed_socket_name="scheduler.frames.sock")

    async def go() -> list[spawner_pb2.AttachResponse]:
        async with running_spawner(config, process_sandbox) as spawner:
            sha = await upload(spawner.stub, FRAMES_ONLY)
            launched = await spawner.stub.Launch(spawner_pb2.LaunchRequest(program=sha), timeout=30)
            events = []
            async for event in spawner.stub.Attach(spawner_pb2.AttachRequest(instance_id=launched.instance_id),
                                                   timeout=120):
                events.append(event)
                if event.HasField("message") and event.message.text == "waiting":
                    await spawner.stub.SendMessage(spawner_pb2.SendMessageRequest(
                        instance_id=launched.instance_id, text="hello"), timeout=30)
            return events

    events = asyncio.run(go())
    assert exit_of(events).reason == spawner_pb2.EXIT_REASON_EXITED, events
    messages = [e.message.text for e in events if e.HasField("message")]
    assert messages == ["waiting", "hello! True True 'child ran' grpc imported: False"], events


# The runner ends the process without the interpreter's finalization (`l4m.controller.exit_now`): what a
# program registered with atexit still runs, after what it printed, and a non-daemon thread it left running
# is still waited for (before the atexit handlers, as in a normal exit).
AT_EXIT = """
import atexit, threading, time

def late():
    time.sleep(0.3)
    print("the thread finished", flush=True)

async def main(ctx):
    atexit.register(lambda: print("atexit ran", flush=True))
    if ctx.args and ctx.args[0] == "thread":
        threading.Thread(target=late).start()
    print("main returned")
"""


def test_the_runner_exits_after_atexit_and_the_program_threads(
    sandbox: Sandbox, scheduler_cluster: SchedulerCluster, tmp_path: Path
) -> None:
    async def go(args: list[str]) -> list[spawner_pb2.AttachResponse]:
        async with running_spawner(_config(tmp_path, scheduler_cluster), sandbox) as spawner:
            sha = await upload(spawner.stub, AT_EXIT)
            launched = await spawner.stub.Launch(spawner_pb2.LaunchRequest(program=sha, args=args), timeout=30)
            return await attach(spawner.stub, launched.instance_id)

    for args, expected in (([], ["main returned", "atexit ran"]),
                           (["thread"], ["main returned", "the thread finished", "atexit ran"])):
        events = asyncio.run(go(args))
        exit_event = exit_of(events)
        assert exit_event.reason == spawner_pb2.EXIT_REASON_EXITED and exit_event.exit_code == 0, events
        lines = log_lines(events)
        assert [line for line in lines if line in expected] == expected, lines
