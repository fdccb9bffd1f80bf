"""Benchmark text completion: `completion.py PROMPT_IDS NEW_TOKENS [MAX_CONTINUATION_STEPS [NOTIFY_AT]]`,
PROMPT_IDS comma-separated token ids; MAX_CONTINUATION_STEPS as `Context.generate` takes it (default: the
SDK's, up to 9 tokens per round trip; 0: one round trip per token).

Feeds the prompt token-exact (no chat template), generates NEW_TOKENS greedily (end-of-sequence tokens do
not stop it: every engine of bench/e2e.py decodes the same count), and reports:
  - `{"first_token_id": ...}` as soon as the first token exists, so the user measures TTFT as seen by
    the user (sent without waiting for the reply: the decode loop does not stall on it);
  - at the end one JSON line: the token ids, each token's wall-clock time (`time.time()`, seconds, the
    same clock as the user's on this machine) and when `main` started;
  - with NOTIFY_AT, `{"num_tokens": NOTIFY_AT}` as soon as it has that many tokens (bench/e2e.py
    --long-prompt sends its long prompt once every decoding stream has).
"""

import asyncio
import json
import time

from l4m import Greedy, stop


async def main(ctx):
    started_at_s = time.time()
    prompt_ids = [int(token) for token in ctx.args[0].split(",")]
    num_new_tokens = int(ctx.args[1])
    steps = {"max_continuation_steps": int(ctx.args[2])} if len(ctx.args) > 2 else {}
    notify_at = int(ctx.args[3]) if len(ctx.args) > 3 else 0
    token_ids, token_times_s = [], []
    sends = []  # not awaited in the loop: the decode loop does not stall on them
    async with ctx.new_context() as context:
        context.fill(prompt_ids)
        async for token in context.generate(Greedy(), stop=stop.max_tokens(num_new_tokens), **steps):
            token_times_s.append(time.time())
            token_ids.append(token.token_id)
            if len(token_ids) == 1:
                sends.append(asyncio.create_task(ctx.send(json.dumps({"first_token_id": token.token_id}))))
            if len(token_ids) == notify_at:
                sends.append(asyncio.create_task(ctx.send(json.dumps({"num_tokens": notify_at}))))
    await asyncio.gather(*sends)
    await ctx.send(json.dumps({"started_at_s": started_at_s, "token_ids": token_ids, "token_times_s": token_times_s}))
