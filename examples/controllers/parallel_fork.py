"""Parallel generation: one shared system prompt, forked per question, generated concurrently (each fork
on its own stream, so the scheduler batches the decode steps across them)."""

import asyncio
import json

from l4m import Greedy

QUESTIONS = ["What is 2 + 2?", "Name a color of the sky.", "What animal says moo?", "What is the opposite of hot?"]


async def answer(base, question):
    async with base.fork() as chat:
        chat.fill(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
        return await chat.generate_text(Greedy(), max_tokens=24)


async def main(ctx):
    questions = ctx.args or QUESTIONS
    async with ctx.new_context() as base:
        base.fill("<|im_start|>system\nYou are a helpful assistant. Answer briefly.<|im_end|>\n")
        answers = await asyncio.gather(*(answer(base, q) for q in questions))
    for question, text in zip(questions, answers, strict=True):
        await ctx.send(f"{question} -> {text}")
    await ctx.send(json.dumps({"questions": questions, "answers": answers,
                               "forward_passes": ctx.model.stats.num_forward_passes,
                               "forward_commands": ctx.model.stats.num_forward_commands}))
