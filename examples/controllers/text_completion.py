"""Text completion with the chat template:
`l4m run text_completion.py -- "Your question" [max_tokens]` (or `-- --max-tokens N "Your question"`).

Sends the answer as it is generated (one message per chunk), then a summary line with the token ids,
so tests can compare it with the executor's own greedy output.
"""

import json

from l4m import Greedy


async def main(ctx):
    args = list(ctx.args)
    max_tokens = 48
    if args[:1] == ["--max-tokens"]:
        max_tokens, args = int(args[1]), args[2:]
    prompt = args[0] if args else "What is the capital of France?"
    if len(args) > 1:
        max_tokens = int(args[1])
    async with ctx.new_context() as chat:
        chat.fill_chat([{"role": "user", "content": prompt}])
        prompt_tokens = chat.num_tokens
        generation = chat.generate(Greedy(), max_tokens=max_tokens)
        async for token in generation:
            if token.text:
                await ctx.send(token.text)
        completion = generation.completion
        await ctx.send(json.dumps({"prompt_tokens": prompt_tokens, "token_ids": completion.token_ids,
                                   "text": completion.text, "stop": completion.stop.reason}))
