"""Text completion with the chat template:
`l4m run text_completion.py -- [--no-stream] [--max-tokens N] "Your question" [max_tokens]`.

Sends the answer as it is generated (one message per chunk; with --no-stream one message at the end),
then a summary line with the token ids, so tests can compare it with the executor's own greedy output.
"""

import json

from l4m import Greedy


async def main(ctx):
    args = list(ctx.args)
    max_tokens = 48
    stream = True
    if args[:1] == ["--no-stream"]:
        stream, args = False, args[1:]
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
            if token.text and stream:
                await ctx.send(token.text)
        completion = generation.completion
        if not stream:
            await ctx.send(completion.text)
        await ctx.send(json.dumps({"prompt_tokens": prompt_tokens, "token_ids": completion.token_ids,
                                   "text": completion.text, "stop": completion.stop.reason}))
