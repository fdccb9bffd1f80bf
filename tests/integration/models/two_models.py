"""A controller for the several-models test: greedy tokens of a token-id prompt on its session's model,
and, with `--also NAME`, on a second model through `ctx.load_model(NAME)`, both at once.

`l4m run [--model M] two_models.py -- IDS N [--also NAME]`; prints one JSON line.
"""

import asyncio
import json

from l4m import Greedy
from l4m.stop import MaxTokens


async def greedy(model, prompt, num_tokens):
    async with model.new_context() as context:
        context.fill(prompt)
        completion = await context.generate(Greedy(), stop=MaxTokens(num_tokens))
        return completion.token_ids


async def main(ctx):
    prompt = [int(t) for t in ctx.args[0].split(",")]
    num_tokens = int(ctx.args[1])
    models = [ctx.model]
    if ctx.args[2:3] == ["--also"]:
        models.append(await ctx.load_model(ctx.args[3]))
    tokens = await asyncio.gather(*(greedy(m, prompt, num_tokens) for m in models))
    await ctx.send(json.dumps({"served": list(ctx.model.served_model_names),
                               "tokens": {m.name: t for m, t in zip(models, tokens, strict=True)}}))
