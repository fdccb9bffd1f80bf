"""Output constrained by a regular expression: an ISO date, then a yes/no answer."""

import json

from l4m import Constraint, Greedy

DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
YES_NO = r"(yes|no)"


async def main(ctx):
    async with ctx.new_context() as chat:
        chat.fill_chat([{"role": "user", "content": "When did the Apollo 11 landing happen? Answer with a date."}])
        date = await chat.generate_text(Greedy(), max_tokens=20, constraint=Constraint.regex(ctx.model, DATE))
    async with ctx.new_context() as chat:
        chat.fill_chat([{"role": "user", "content": "Is water wet? Answer yes or no."}])
        answer = await chat.generate_text(Greedy(), max_tokens=5, constraint=Constraint.regex(ctx.model, YES_NO))
    await ctx.send(f"date: {date}  answer: {answer}")
    await ctx.send(json.dumps({"date": date, "date_regex": DATE, "answer": answer, "answer_regex": YES_NO}))
