"""l4m.gateway: the OpenAI-compatible HTTP front door (`/v1/models`, `/v1/completions`,
`/v1/chat/completions`), whose built-in handlers are L4M sessions written with the controller SDK."""
