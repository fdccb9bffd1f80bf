"""Output constrained by a JSON schema (llguidance masks on every step):
`l4m run json_schema.py -- ["WHO" ['{"type": "object", ...}']]`: the prompt is "Describe WHO as a JSON
object ..." (WHO: a noun phrase such as "a retired sailor"; default "a French chef"), and the schema
defaults to SCHEMA below."""

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
    schema = ctx.args[1] if len(ctx.args) > 1 else SCHEMA  # a JSON string is parsed by Constraint.json_schema
    constraint = Constraint.json_schema(ctx.model, schema)  # a bad schema fails here, before any token is fed
    async with ctx.new_context() as chat:
        chat.fill_chat([{"role": "user", "content": f"Describe {who} as a JSON object with name, age, "
                                                    "occupation and languages."}])
        completion = await chat.generate(Greedy(), max_tokens=160, constraint=constraint)
    await ctx.send(completion.text)
    schema = json.loads(schema) if isinstance(schema, str) else schema
    await ctx.send(json.dumps({"schema": schema, "text": completion.text, "stop": completion.stop.reason}))
