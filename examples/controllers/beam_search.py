"""Beam search over forked contexts: `l4m run beam_search.py -- "prompt" [beam_width] [max_tokens]`."""

import json

from l4m import beam_search


async def main(ctx):
    prompt = ctx.args[0] if ctx.args else "Give me a name for a pet turtle."
    beam_width = int(ctx.args[1]) if len(ctx.args) > 1 else 3
    max_tokens = int(ctx.args[2]) if len(ctx.args) > 2 else 16
    async with ctx.new_context() as chat:
        chat.fill_chat([{"role": "user", "content": prompt}])
        beams = await beam_search(chat, beam_width=beam_width, max_tokens=max_tokens)
    for beam in beams:
        await ctx.send(f"{beam.logprob:8.3f}  {beam.text!r}")
    await ctx.send(json.dumps({"beams": [{"text": b.text, "logprob": b.logprob, "token_ids": list(b.token_ids),
                                          "finished": b.is_finished} for b in beams]}))
