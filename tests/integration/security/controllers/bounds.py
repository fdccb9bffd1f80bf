"""Controllers of issue 17's bounds attacks: `l4m run bounds.py -- MODE [ARGS]`; each reports one JSON line,
or ends trapped (the test reads the reason).

  distributions N K   one forward_text of N tokens with N DISTRIBUTION outputs of top_k K ("vocab": the
                      vocabulary size), as sent by the attack of issue 17 (N = 256, K = vocab)
  zero-runs N         one forward_text whose vocabulary mask is all tokens then N zero-length runs
  bystander [wait]    a greedy completion of 12 tokens; with `wait`, sends "ready" after 4 of them and
                      waits for a message from the user before the other 8
"""

import json

from l4m.v1 import common_pb2

PROMPT = "The three primary colours are"


async def forward_text(ctx, num_tokens, samplers):
    """Pages for `num_tokens` tokens, then one forward_text with an output per sampler (the last tokens')."""
    model = ctx.model
    num_pages = -(-num_tokens // model.kv_page_size)
    page_ids = model.kv_pages.acquire(num_pages)
    model.session.send("allocate", common_pb2.AllocateItem(kind=common_pb2.RESOURCE_KIND_KV_PAGE, ids=page_ids))
    item = common_pb2.ForwardTextItem(
        kv_page_ids=page_ids, kv_last_page_length=num_tokens - model.kv_page_size * (num_pages - 1),
        token_ids=[1] * num_tokens, position_ids=range(num_tokens),
        output_indices=range(num_tokens - len(samplers), num_tokens), samplers=samplers)
    return await model.session.request("forward_text", item)


async def distributions(ctx, num_outputs, top_k):
    k = ctx.model.vocab_size if top_k == "vocab" else int(top_k)
    sampler = common_pb2.SamplerSpec(kind=common_pb2.SAMPLER_KIND_DISTRIBUTION, distribution_top_k=k)
    reply = await forward_text(ctx, num_outputs, [sampler] * num_outputs)
    entries = sum(len(o.distribution.token_ids) for o in reply.forward_text.outputs)
    await ctx.send(json.dumps({"served_entries": entries, "reply_bytes": reply.ByteSize()}))


async def zero_runs(ctx, num_runs):
    mask = common_pb2.Brle(run_lengths=[ctx.model.vocab_size] + [0] * num_runs)
    sampler = common_pb2.SamplerSpec(kind=common_pb2.SAMPLER_KIND_GREEDY, vocabulary_mask=mask)
    reply = await forward_text(ctx, 1, [sampler])
    await ctx.send(json.dumps({"served": reply.forward_text.outputs[0].token.token_id}))


async def greedy(context, num_tokens):
    tokens = []
    for _ in range(num_tokens):
        token = (await context.step()).token.token_id
        tokens.append(token)
        context.fill([token])
    return tokens


async def bystander(ctx, should_wait):
    async with ctx.new_context() as context:
        context.fill(PROMPT)
        tokens = await greedy(context, 4)
        if should_wait:
            await ctx.send("ready")
            if await ctx.receive(timeout_s=600) is None:
                raise SystemExit("no message from the user")
        tokens += await greedy(context, 8)
    await ctx.send(json.dumps({"tokens": tokens}))


async def main(ctx):
    mode, *args = ctx.args
    if mode == "distributions":
        return await distributions(ctx, int(args[0]), args[1])
    if mode == "zero-runs":
        return await zero_runs(ctx, int(args[0]))
    if mode == "bystander":
        return await bystander(ctx, args == ["wait"])
    raise SystemExit(f"unknown mode {mode!r}")
