"""What the gateway and a program it runs for an OpenAI request (`"model": "l4m/<program>"`) agree on.

The gateway sends the request as the program's first user message, JSON:
`{"endpoint": CHAT_ENDPOINT | COMPLETIONS_ENDPOINT, "request": {the fields the client sent}}`. Each message
the program sends is the next piece of the answer's text, except one starting with FINISH_PREFIX: the
answer's end record, JSON `{"finish_reason": "stop" | "length", "usage": {"prompt_tokens": N,
"completion_tokens": M}}` (usage optional). `l4m.openai_compat` is the program's side, `l4m.gateway.programs`
the gateway's.
"""

CHAT_ENDPOINT = "chat.completions"
COMPLETIONS_ENDPOINT = "completions"
FINISH_PREFIX = "\x00l4m.finish "
