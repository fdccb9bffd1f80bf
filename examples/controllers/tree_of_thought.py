"""Tree of thought: propose several first steps (forks, sampled), extend each with a few candidate
continuations (forks of forks), score every leaf by the model's own probability that it is correct,
and join on the best one."""

import asyncio
import json
import math

from l4m import Sample

PROBLEM = "Tom has 3 apples and buys 2 bags with 4 apples each. How many apples does he have?"


async def score(leaf):
    """log P(" Yes") after asking the model whether the reasoning is right."""
    async with leaf.fork() as judge:
        if judge.token_ids[-1] not in judge.model.stop_token_ids:
            judge.fill("<|im_end|>")
        judge.fill("\n<|im_start|>user\nIs this reasoning correct? Answer Yes or No.<|im_end|>\n"
                   "<|im_start|>assistant\n")
        (logprob,) = await judge.logprobs_of(judge.model.tokenizer.encode("Yes"))
        return logprob


async def expand(node, breadth, seed, max_tokens):
    children = []
    for i in range(breadth):
        child = node.fork()
        text = await child.generate_text(Sample(temperature=0.8, seed=seed + i), max_tokens=max_tokens)
        children.append((child, text))
    return children


async def main(ctx):
    problem = ctx.args[0] if ctx.args else PROBLEM
    async with ctx.new_context() as root:
        root.fill_chat([{"role": "user", "content": problem + " Think step by step."}])
        level1 = await expand(root, breadth=2, seed=1, max_tokens=24)
        leaves = []
        for index, (node, thought) in enumerate(level1):
            for leaf, more in await expand(node, breadth=2, seed=100 + 10 * index, max_tokens=32):
                leaves.append((leaf, thought + more))
            await node.free()
        scores = await asyncio.gather(*(score(leaf) for leaf, _ in leaves))
        best = max(range(len(leaves)), key=lambda i: scores[i])
        for leaf, _ in leaves:
            await leaf.free()
    for (_, text), s in zip(leaves, scores, strict=True):
        await ctx.send(f"p(correct)={math.exp(s):.3f}  {text!r}")
    await ctx.send(json.dumps({"leaves": [t for _, t in leaves], "scores": scores, "best": best}))
