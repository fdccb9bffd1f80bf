"""A parent that spawns child controllers (this same program, in child mode) and gathers their answers
through shared variables: each child writes `answer/<i>`, the parent waits on them without polling.

`l4m run spawn_children.py -- "question 1" "question 2" ...`
"""

import json

from l4m import Greedy

QUESTIONS = ["What is the largest planet?", "What is the boiling point of water in Celsius?"]


async def child(ctx, index, question):
    async with ctx.new_context() as chat:
        chat.fill_chat([{"role": "user", "content": question + " Answer in one short sentence."}])
        answer = await chat.generate_text(Greedy(), max_tokens=32)
    await ctx.vars.set(f"answer/{index}", answer)
    await ctx.vars.append("log", f"child {index} done\n")


async def main(ctx):
    if ctx.args[:1] == ["--child"]:
        return await child(ctx, int(ctx.args[1]), ctx.args[2])
    questions = ctx.args or QUESTIONS
    children = [await ctx.spawn(args=["--child", str(i), q]) for i, q in enumerate(questions)]
    answers = [(await ctx.vars.wait_for(f"answer/{i}")).text for i in range(len(questions))]
    exits = [await c.wait(timeout_s=120) for c in children]
    for question, answer in zip(questions, answers, strict=True):
        await ctx.send(f"{question} -> {answer}")
    log = (await ctx.vars.get("log")).text
    await ctx.send(json.dumps({"questions": questions, "answers": answers,
                               "children_ok": [e is not None and e.is_success for e in exits],
                               "log_lines": log.count("\n")}))
