"""Speculative decoding with an n-gram drafter: drafts come from the text itself, the model verifies a
whole draft in ONE forward pass. Runs plain greedy decoding too, to compare outputs and pass counts."""

import json

from l4m import Greedy, NgramDrafter, generate_speculative

PROMPT = ("Repeat this list exactly three times, one item per line:\n"
          "apple pie, banana bread, cherry tart, date cake, elderberry jam\n")


async def main(ctx):
    max_tokens = int(ctx.args[0]) if ctx.args else 96
    async with ctx.new_context() as base:
        base.fill_chat([{"role": "user", "content": PROMPT}])
        async with base.fork() as plain:
            before = ctx.model.stats.num_forward_passes
            greedy = await plain.generate(Greedy(), max_tokens=max_tokens)
            greedy_passes = ctx.model.stats.num_forward_passes - before
        async with base.fork() as fast:
            before = ctx.model.stats.num_forward_passes
            speculative = await generate_speculative(fast, NgramDrafter(n=3, max_draft_tokens=8), max_tokens=max_tokens)
            speculative_passes = ctx.model.stats.num_forward_passes - before
    await ctx.send(speculative.text)
    await ctx.send(json.dumps({"greedy_token_ids": greedy.token_ids, "speculative_token_ids": speculative.token_ids,
                               "greedy_passes": greedy_passes, "speculative_passes": speculative_passes,
                               "forward_passes": ctx.model.stats.num_forward_passes,
                               "forward_commands": ctx.model.stats.num_forward_commands}))
