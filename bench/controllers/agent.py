"""An agent loop with tool calls: `agent.py MODE SYSTEM_IDS OBSERVATIONS TURN_TOKENS`.

SYSTEM_IDS is the comma-separated conversation start; OBSERVATIONS holds one comma-separated id list per
tool result, separated by `;`. Each turn the model generates TURN_TOKENS tokens greedily (its tool call),
then the tool's result is appended; after the last result one more turn gives the answer.
  keep    one context for the whole loop: each turn feeds only the new tokens (the KV is kept).
  resend  each turn is a fresh context fed the whole conversation so far (an HTTP API's way: the
          server sees a new prompt every time and prefills all of it).
Sends one JSON line: the wall time in this controller, the tokens fed through forward passes, and each
turn's generated token ids (greedy: the same in both modes).
"""

import json
import time

from l4m import Greedy, stop


async def main(ctx):
    started = time.perf_counter()
    mode, system_arg, observations_arg, num_tokens_arg = ctx.args
    conversation = [int(t) for t in system_arg.split(",")]
    observations = [[int(t) for t in result.split(",")] for result in observations_arg.split(";")]
    limit = stop.max_tokens(int(num_tokens_arg))
    if mode not in ("keep", "resend"):
        raise ValueError(f"MODE must be keep or resend, got {mode!r}")
    turns = []
    if mode == "keep":
        async with ctx.new_context() as agent:
            agent.fill(conversation)
            for observation in [*observations, None]:
                turns.append((await agent.generate(Greedy(), stop=limit)).token_ids)
                if observation is not None:
                    agent.fill(observation)
    else:
        for observation in [*observations, None]:
            async with ctx.new_context() as agent:
                agent.fill(conversation)
                turns.append((await agent.generate(Greedy(), stop=limit)).token_ids)
            conversation += turns[-1] + (observation or [])
    await ctx.send(json.dumps({"wall_s": time.perf_counter() - started, "token_ids": turns,
                               "num_forward_tokens": ctx.model.stats.num_forward_tokens}))
