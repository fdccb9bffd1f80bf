"""Prefix caching: the first run fills a long system prompt and exports its KV pages (persistent);
later runs import them and skip that prefill. `l4m run prefix_cache.py -- "question" [export-name]`.

The summary reports how many tokens this run fed through forward passes (counted by the SDK).
"""

import json

from l4m import Context, Greedy

SYSTEM = (
    "You are the help desk of the Example Hotel. Facts: check-in is from 15:00, check-out until 11:00. "
    "Breakfast is served 7:00-10:30 on the ground floor. The pool is on the roof and opens at 8:00. "
    "Parking costs 20 euros per night. Pets are welcome. The nearest metro station is Central Park, "
    "five minutes on foot. Answer in one short sentence."
)


async def main(ctx):
    question = ctx.args[0] if ctx.args else "When is breakfast?"
    name = ctx.args[1] if len(ctx.args) > 1 else "example-hotel-prefix-v1"
    tokenizer = ctx.tokenizer
    prefix_text = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}], add_generation_prompt=False)
    imported = await ctx.model.has_export(name)
    if imported:
        chat = await Context.import_(ctx.model, name)
    else:
        chat = ctx.new_context()
        chat.fill(prefix_text)
        await chat.export(name, persistent=True)
    async with chat:
        chat.fill(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
        completion = await chat.generate(Greedy(), max_tokens=40)
    await ctx.send(completion.text)
    await ctx.send(json.dumps({"imported": imported, "prefix_tokens": len(tokenizer.encode(prefix_text)),
                               "forward_tokens": ctx.model.stats.num_forward_tokens, "text": completion.text}))
