"""A program the gateway serves as an OpenAI model, `"model": "l4m/<its tag>"` (docs/openai.md).

It answers the request it receives (chat messages or a text prompt) with the request's sampling,
stop strings and max_tokens, sends each piece of text as one message (one streamed chunk), then says
how it finished. Everything between `fill` and `finish` is yours to change: a constraint, a search,
a tool loop next to the model.

  l4m store examples/controllers/openai_program.py --tag answer
  curl .../v1/chat/completions -d '{"model": "l4m/answer", "messages": [...]}'
"""

from l4m.openai_compat import openai_request


async def main(ctx):
    request = await openai_request(ctx)
    async with ctx.new_context() as context:
        request.fill(context)
        prompt_tokens = context.num_tokens
        generation = context.generate(request.sampler(), stop=request.stop(ctx.model.stop_token_ids))
        async for token in generation:
            if token.text:
                await ctx.send(token.text)
        completion = generation.completion
        finish_reason = "length" if completion.stop is None or completion.stop.reason == "length" else "stop"
        await request.finish(ctx, finish_reason, prompt_tokens, len(completion.token_ids))
