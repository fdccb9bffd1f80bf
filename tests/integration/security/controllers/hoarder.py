"""A controller that pins pages past its own life: `l4m run hoarder.py -- MODE PREFIX`.

  hoard PREFIX     allocate pages in chunks of 1/16 of what one instance may hold and export each chunk
                   persistent as PREFIX-<n>, reporting the pages exported so far after each, until trapped
  release PREFIX   unexport this user's exports named PREFIX-*; report what is left
"""

import json

from l4m.v1 import l4m_pb2


async def hoard(ctx, prefix):
    model = ctx.model
    chunk = max(1, model.max_kv_pages // 16)
    exported = 0
    for n in range(64):
        page_ids = model.allocate_kv_pages(chunk, 0)
        command = l4m_pb2.ExportKvPagesCommand(name=f"{prefix}-{n}", kv_page_ids=page_ids, persistent=True)
        model.session.send("export_kv_pages", command, 0)
        await model.session.request("synchronize", l4m_pb2.SynchronizeCommand(), 0)
        exported += chunk
        await ctx.send(json.dumps({"exported": exported, "chunk": chunk, "max_kv_pages": model.max_kv_pages}))


async def release(ctx, prefix):
    for export in await ctx.model.list_exports():
        if export.name.startswith(f"{prefix}-"):
            ctx.model.unexport(export.name)
    left = [e.name for e in await ctx.model.list_exports() if e.name.startswith(f"{prefix}-")]
    await ctx.send(json.dumps({"left": left}))


async def main(ctx):
    mode, prefix = ctx.args
    await {"hoard": hoard, "release": release}[mode](ctx, prefix)
