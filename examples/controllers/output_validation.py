"""Output validation: score fixed candidate answers by the model's probability (a fork per candidate,
every candidate token scored in one forward pass), and pick the most likely one."""

import asyncio
import json
import math

QUESTION = "What is the capital of Japan?"
CANDIDATES = ["Tokyo", "Kyoto", "Osaka", "Paris"]


async def score(base, text):
    async with base.fork() as candidate:
        logprobs = await candidate.logprobs_of(candidate.model.tokenizer.encode(text))
        return sum(logprobs)


async def main(ctx):
    question = ctx.args[0] if ctx.args else QUESTION
    candidates = ctx.args[1:] or CANDIDATES
    async with ctx.new_context() as base:
        base.fill_chat([{"role": "user", "content": question + " Answer with one word."}])
        scores = await asyncio.gather(*(score(base, c) for c in candidates))
    total = sum(math.exp(s) for s in scores)
    for candidate, s in sorted(zip(candidates, scores, strict=True), key=lambda p: -p[1]):
        await ctx.send(f"{candidate:10s} logprob {s:8.3f}  share {math.exp(s) / total:.3f}")
    best = max(range(len(candidates)), key=lambda i: scores[i])
    await ctx.send(json.dumps({"candidates": candidates, "logprobs": scores, "best": candidates[best]}))
