"""Benchmark text completion from text: `text.py PROMPT NEW_TOKENS`. Tokenizes PROMPT (the first use of the
tokenizer: a process fetches and builds it once, `l4m.model.TOKENIZERS`), generates NEW_TOKENS greedily and
sends the text (bench/shared_text.py)."""

from l4m import Greedy


async def main(ctx):
    context = ctx.new_context()
    context.fill(ctx.args[0])
    completion = await context.generate(Greedy(), max_tokens=int(ctx.args[1]))
    await ctx.send(completion.text or "(empty)")
