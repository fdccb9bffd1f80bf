"""Output constrained by a JSON schema (llguidance masks on every step): `l4m run json_schema.py -- "who"`."""

import json

from l4m import Constraint, Greedy

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "occupation": {"type": "string", "maxLength": 40},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    },
    "required": ["name", "age", "occupation", "languages"],
    "additionalProperties": False,
}


async def main(ctx):
    who = ctx.args[0] if ctx.args else "a French chef"
    async with ctx.new_context() as chat:
        chat.fill_chat([{"role": "user", "content": f"Describe {who} as a JSON object with name, age, "
                                                    "occupation and languages."}])
        completion = await chat.generate(Greedy(), max_tokens=160, constraint=Constraint.json_schema(ctx.model, SCHEMA))
    await ctx.send(completion.text)
    await ctx.send(json.dumps({"schema": SCHEMA, "text": completion.text, "stop": completion.stop.reason}))
