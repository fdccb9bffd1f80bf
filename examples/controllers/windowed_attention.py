"""Attention sink + sliding window (StreamingLLM): each token sees the first `sink` tokens and the last
`window` ones; pages that fall fully out of the window are deallocated, so a long generation holds a
bounded number of pages. `l4m run windowed_attention.py -- [max_tokens] [window] [sink]`."""

import json

from l4m import Sample


async def main(ctx):
    max_tokens = int(ctx.args[0]) if ctx.args else 256
    window = int(ctx.args[1]) if len(ctx.args) > 1 else 64
    sink = int(ctx.args[2]) if len(ctx.args) > 2 else 4
    async with ctx.new_context() as story:
        story.set_window(num_window_tokens=window, num_sink_tokens=sink)
        story.fill_chat([{"role": "user", "content": "Tell me a very long story about a lighthouse keeper."}])
        max_pages, pages_trace = 0, []
        generation = story.generate(Sample(temperature=0.7, top_p=0.9, seed=5), max_tokens=max_tokens, stop=None)
        async for _token in generation:
            max_pages = max(max_pages, len(story.kv_page_ids))
            if len(generation.completion.token_ids) % 32 == 0:
                pages_trace.append(len(story.kv_page_ids))
        text = generation.completion.text
        positions, slots = story.next_position, story.num_kv_slots
    await ctx.send(text[-300:])
    await ctx.send(json.dumps({"generated_tokens": len(generation.completion.token_ids), "max_pages_held": max_pages,
                               "pages_trace": pages_trace, "kv_page_size": ctx.model.kv_page_size,
                               "next_position": positions, "kv_slots": slots, "window": window, "sink": sink}))
