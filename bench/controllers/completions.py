"""Benchmark text completion, several streams in one controller: `completions.py PROMPTS NEW_TOKENS
[MAX_CONTINUATION_STEPS]`, PROMPTS the prompts' token ids, comma-separated within a prompt and `;` between
prompts. The other arguments are completion.py's.

Each prompt gets a Context of its own and all of them generate at once (`asyncio.gather`), so the scheduler
batches their steps as it batches those of separate launches; what differs is that one process wakes for
all of them. Reports what completion.py reports, per stream, each message with the stream's index
(`"stream"`, the prompt's place in PROMPTS): `{"stream": i, "first_token_id": ...}` as soon as that stream
has its first token, and at the end one JSON line per stream with its token ids and times.
"""

import asyncio
import json
import time

from l4m import Greedy, stop


async def complete(ctx, stream, prompt_ids, num_new_tokens, steps, started_at_s, sends):
    token_ids, token_times_s = [], []
    async with ctx.new_context() as context:
        context.fill(prompt_ids)
        async for token in context.generate(Greedy(), stop=stop.max_tokens(num_new_tokens), **steps):
            token_times_s.append(time.time())
            token_ids.append(token.token_id)
            if len(token_ids) == 1:  # not awaited here: the decode loop does not stall on it
                first = {"stream": stream, "first_token_id": token.token_id}
                sends.append(asyncio.create_task(ctx.send(json.dumps(first))))
    return {"stream": stream, "started_at_s": started_at_s, "token_ids": token_ids, "token_times_s": token_times_s}


async def main(ctx):
    started_at_s = time.time()
    prompts = [[int(token) for token in prompt.split(",")] for prompt in ctx.args[0].split(";")]
    num_new_tokens = int(ctx.args[1])
    steps = {"max_continuation_steps": int(ctx.args[2])} if len(ctx.args) > 2 else {}
    sends = []
    summaries = await asyncio.gather(*(complete(ctx, stream, prompt_ids, num_new_tokens, steps, started_at_s, sends)
                                       for stream, prompt_ids in enumerate(prompts)))
    await asyncio.gather(*sends)
    for summary in summaries:
        await ctx.send(json.dumps(summary))
