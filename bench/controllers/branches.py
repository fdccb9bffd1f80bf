"""Parallel branches from one shared prefix: `branches.py MODE PREFIX_IDS SUFFIXES BRANCH_TOKENS`.

PREFIX_IDS is comma-separated token ids; SUFFIXES holds one comma-separated id list per branch, the
branches separated by `;` (each branch's own instruction). Every branch generates BRANCH_TOKENS tokens
greedily, all branches at once (one stream each, so the scheduler batches their decode steps).
  fork       feed the prefix once, then `fork()` it per branch: the branches share its full KV pages.
  recompute  a fresh context per branch holding prefix + suffix: every branch prefills the prefix.
Sends one JSON line: the wall time of the whole job in this controller, the tokens fed through forward
passes, and every branch's generated token ids.
"""

import asyncio
import json
import time

from l4m import Greedy, stop


async def main(ctx):
    started = time.perf_counter()
    mode, prefix_arg, suffixes_arg, num_tokens_arg = ctx.args
    prefix = [int(t) for t in prefix_arg.split(",")]
    suffixes = [[int(t) for t in branch.split(",")] for branch in suffixes_arg.split(";")]
    limit = stop.max_tokens(int(num_tokens_arg))
    if mode not in ("fork", "recompute"):
        raise ValueError(f"MODE must be fork or recompute, got {mode!r}")

    async def generate(context, suffix):
        context.fill(suffix)
        return (await context.generate(Greedy(), stop=limit)).token_ids

    async def from_fork(base, suffix):
        async with base.fork() as branch:
            return await generate(branch, suffix)

    async def from_scratch(suffix):
        async with ctx.new_context() as branch:
            branch.fill(prefix)
            return await generate(branch, suffix)

    if mode == "fork":
        async with ctx.new_context() as base:
            base.fill(prefix)
            base.flush()  # the prefix goes out once; the forks wait for it and share its full pages
            branches = await asyncio.gather(*(from_fork(base, suffix) for suffix in suffixes))
    else:
        branches = await asyncio.gather(*(from_scratch(suffix) for suffix in suffixes))
    await ctx.send(json.dumps({"wall_s": time.perf_counter() - started, "token_ids": branches,
                               "num_forward_tokens": ctx.model.stats.num_forward_tokens}))
