"""Agent loop with a tool call: the model writes a calculator call (its format enforced by a regex
constraint), the controller runs the tool next to the model and appends the observation to the SAME
context, so nothing is re-fed; then the model answers."""

import json
import re

from l4m import Constraint, Greedy, stop

CALL = r"calculate\([0-9]+ [-+*/] [0-9]+\)"


def calculate(expression):
    left, operator, right = re.fullmatch(r"([0-9]+) ([-+*/]) ([0-9]+)", expression).groups()
    a, b = int(left), int(right)
    return {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else float("nan")}[operator]


async def main(ctx):
    question = ctx.args[0] if ctx.args else "What is 37 times 12?"
    async with ctx.new_context() as agent:
        agent.fill_chat([
            {"role": "system", "content": "You can use a calculator: write calculate(A op B) and wait for the result."},
            {"role": "user", "content": question},
        ])
        agent.fill("I will use the calculator: ")
        call = await agent.generate_text(Greedy(), max_tokens=20, constraint=Constraint.regex(ctx.model, CALL))
        result = calculate(call[len("calculate("):-1])
        await ctx.send(f"tool call: {call} -> {result}")
        tokens_before_observation = ctx.model.stats.num_forward_tokens
        agent.fill(f"\nObservation: {result}\nSo the answer is")
        answer = await agent.generate_text(Greedy(), max_tokens=24, stop=stop.on_strings("\n") | stop.on_tokens(ctx.model.stop_token_ids))
        observation_tokens = ctx.model.stats.num_forward_tokens - tokens_before_observation
        context_tokens = agent.num_tokens
    await ctx.send(f"answer:{answer}")
    await ctx.send(json.dumps({"call": call, "result": result, "answer": answer,
                               "tokens_fed_after_tool": observation_tokens, "context_tokens": context_tokens}))
