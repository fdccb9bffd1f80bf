"""An attacking controller: `l4m run attacker.py -- MODE [ARGS]`. Each mode tries one thing the trust
boundary forbids (tests/integration/security) and reports what it saw as one JSON line; a mode the
scheduler traps ends here with the trap (the test reads the reason).

  registry REGISTRY_PATH   call InstanceRegistryService on /run/l4m/scheduler.sock; look for REGISTRY_PATH
  batching                 debug_query "batching:k-only:100000" (a cluster-wide knob)
  read-batching            debug_query "batching" (reading it is open)
  export NAME              export a context under NAME (persistent, private) and end
  list                     list the exports this instance sees
  probe NAME               list exports, then unexport NAME (another user's), then list again
  import-raw NAME          import NAME on the wire (no listing first)
  write-import NAME        import NAME (own), unexport it, then mask a page of the import
  feed N                   feed N tokens (a child over its parent's budget)
  spawn-feed N             spawn this program as a child in `feed N` mode; report how the child ended
  unshare                  `unshare -Urm` and a mount in the sandbox
  wait                     send "ready", then wait (for Ctrl-C on `l4m run`)
  forge-messages           on /run/l4m/runtime.frames.sock: messages under a made-up token, then a frame
                           of another kind after its own token's opening
"""

import asyncio
import json
import os
import subprocess

import grpc

from l4m.v1 import common_pb2, registry_pb2, registry_pb2_grpc

SCHEDULER_SOCKET = "unix:///run/l4m/scheduler.sock"


async def registry(ctx, registry_path):
    codes = {}
    async with grpc.aio.insecure_channel(SCHEDULER_SOCKET) as channel:
        stub = registry_pb2_grpc.InstanceRegistryServiceStub(channel)
        calls = {
            "RegisterInstance": lambda: stub.RegisterInstance(registry_pb2.RegisterInstanceRequest(
                instance_id="ghost", token="x" * 32, launched_at_unix_ms=1), timeout=10),
            "DestroyInstance": lambda: stub.DestroyInstance(
                registry_pb2.DestroyInstanceRequest(instance_id=ctx.instance_id), timeout=10),
        }
        for name, call in calls.items():
            try:
                await call()
                codes[name] = "OK"
            except grpc.aio.AioRpcError as error:
                codes[name] = error.code().name
        try:
            async for _ in stub.WatchInstanceEvents(registry_pb2.WatchInstanceEventsRequest(), timeout=10):
                break
            codes["WatchInstanceEvents"] = "OK"
        except grpc.aio.AioRpcError as error:
            codes["WatchInstanceEvents"] = error.code().name
    await ctx.send(json.dumps({"codes": codes, "run_l4m": sorted(os.listdir("/run/l4m")),
                               "registry_visible": os.path.exists(registry_path),
                               "internal_visible": os.path.exists(os.path.dirname(registry_path))}))


async def export(ctx, name):
    async with ctx.new_context() as context:
        context.fill("The secret of user A is 1234. " * 4)
        await context.step()
        await context.export(name, persistent=True)
        await ctx.model.session.request("synchronize", _synchronize(), context.stream_id)
    await ctx.send(json.dumps({"exported": name}))


def _synchronize():
    from l4m.v1 import l4m_pb2

    return l4m_pb2.SynchronizeCommand()


async def probe(ctx, name):
    before = [e.name for e in await ctx.model.list_exports()]
    ctx.model.unexport(name)
    after = [e.name for e in await ctx.model.list_exports()]  # replied: the unexport ran (or trapped) first
    await ctx.send(json.dumps({"before": before, "after": after}))


async def import_raw(ctx, name):
    from l4m.v1 import l4m_pb2

    page_ids = ctx.model.kv_pages.acquire(1)
    await ctx.model.session.request("import_kv_pages", l4m_pb2.ImportKvPagesCommand(name=name, kv_page_ids=page_ids))
    await ctx.send(json.dumps({"imported": name}))


async def write_import(ctx, name):
    context = await ctx.model.import_context(name)
    ctx.model.unexport(name)  # the test's cleanup: the pages stay alive while imported
    page = context.kv_page_ids[0]
    size = ctx.model.kv_page_size
    item = common_pb2.MaskKvPageItem(kv_page_id=page, visibility=common_pb2.Brle(run_lengths=[0, size]))
    ctx.model.session.send("mask_kv_page", item, context.stream_id)
    await ctx.model.session.request("synchronize", _synchronize(), context.stream_id)
    await ctx.send(json.dumps({"masked": page}))


async def feed(ctx, count):
    async with ctx.new_context() as context:
        context.fill([ctx.tokenizer.encode("hello")[0]] * count)
        await context.step()
    await ctx.send(json.dumps({"fed": count}))


async def spawn_feed(ctx, count):
    child = await ctx.spawn(args=["feed", str(count)])
    exit_ = await child.wait(timeout_s=120)
    summary = None if exit_ is None else {"success": exit_.is_success, "reason": exit_.reason, "message": exit_.message}
    await ctx.send(json.dumps({"child": summary}))


async def unshare(ctx):
    results = {}
    for name, argv in {"unshare": ["unshare", "-Urm", "true"],
                       "mount": ["unshare", "-Urm", "mount", "-t", "tmpfs", "none", "/tmp"]}.items():
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=10)
            results[name] = {"returncode": proc.returncode, "stderr": proc.stderr.strip()[-200:]}
        except (OSError, subprocess.SubprocessError) as error:
            results[name] = {"returncode": None, "stderr": str(error)}
    await ctx.send(json.dumps(results))


async def wait(ctx):
    async with ctx.new_context() as context:
        context.fill("Hold these pages. " * 20)
        await context.step()
        await ctx.send("ready")
        await asyncio.sleep(600)


async def forge_messages(ctx):
    from l4m.v1 import l4m_pb2, spawner_pb2
    from l4m.wire import frames

    def opening(token):
        return frames.encode(frames.RUNTIME_OPEN, spawner_pb2.FramedRuntimeOpen(
            protocol_version=frames.PROTOCOL_VERSION, instance_token=token))

    def message(text):
        return frames.encode(frames.SEND_TO_USER, spawner_pb2.SendToUserRequest(text=text))

    async def attempt(*payload):
        """Every status the spawner answers until it closes the connection."""
        reader, writer = await asyncio.open_unix_connection("/run/l4m/runtime.frames.sock")
        writer.write(b"".join(payload))
        answers = []
        while (frame := await asyncio.wait_for(frames.read_frame(reader, 1 << 16), 30)) is not None:
            answers.append(frames.parse_status(frame[1])[0].name)
        writer.close()
        return answers

    forged = await attempt(opening("x" * 32), message("forged"))
    own = os.environ["L4M_INSTANCE_TOKEN"]
    wrong_kind = await attempt(opening(own), message("own"), frames.encode(frames.REQUEST, l4m_pb2.SessionRequest()),
                               message("after"))
    await ctx.send(json.dumps({"forged": forged, "wrong_kind": wrong_kind}))


async def main(ctx):
    mode, *args = ctx.args
    if mode == "registry":
        return await registry(ctx, args[0])
    if mode == "list":
        return await ctx.send(json.dumps({"exports": [e.name for e in await ctx.model.list_exports()]}))
    if mode == "read-batching":
        return await ctx.send(json.dumps({"batching": await ctx.model.debug_query("batching")}))
    if mode == "batching":
        answer = await ctx.model.debug_query("batching:k-only:100000")
        return await ctx.send(json.dumps({"batching": answer}))
    modes = {"export": export, "probe": probe, "import-raw": import_raw,
             "write-import": write_import}
    if mode in modes:
        return await modes[mode](ctx, args[0])
    if mode == "feed":
        return await feed(ctx, int(args[0]))
    if mode == "spawn-feed":
        return await spawn_feed(ctx, int(args[0]))
    if mode == "unshare":
        return await unshare(ctx)
    if mode == "wait":
        return await wait(ctx)
    if mode == "forge-messages":
        return await forge_messages(ctx)
    raise SystemExit(f"unknown mode {mode!r}")
