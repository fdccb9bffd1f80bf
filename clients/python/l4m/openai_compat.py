"""A program served through the gateway's OpenAI API (`"model": "l4m/<program>"`, docs/openai.md).

The contract, as the program sees it:
- its first message from the user is the request, JSON: `{"endpoint": "chat.completions" | "completions",
  "request": {...}}`, where `request` holds the fields the client sent (validated by the gateway):
  `messages` or `prompt`, `max_tokens`, `temperature`, `top_p`, `seed`, `stop`, ...
- every message it sends (`ctx.send(text)`) is the next piece of the answer's text (one streamed chunk);
- `OpenAIRequest.finish` sends the answer's `finish_reason` and `usage` (otherwise: "stop", no usage);
- exiting 0 ends the answer; any other end (an exception, a trap, a limit) is the request's error.

`openai_request(ctx)` reads and parses the request; `OpenAIRequest` turns it into SDK objects (a prompt
filled into a context, a sampler, a stop condition) so a program only writes what it does differently.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from l4m.context import Context
from l4m.errors import L4MError
from l4m.instance import Instance
from l4m.sampler import Greedy, Sample, Sampler
from l4m.stop import StopCondition, max_tokens, on_strings, on_tokens
from l4m.wire.openai_program import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, FINISH_PREFIX

DEFAULT_MAX_TOKENS = 16  # a text completion's, as OpenAI's; a chat request without one runs to a stop token


@dataclass(frozen=True)
class OpenAIRequest:
    endpoint: str  # CHAT_ENDPOINT or COMPLETIONS_ENDPOINT
    body: dict[str, Any]  # the request's fields as the client sent them

    @classmethod
    def parse(cls, text: str) -> OpenAIRequest:
        try:
            envelope = json.loads(text)
            endpoint, body = envelope["endpoint"], envelope["request"]
        except (ValueError, TypeError, KeyError) as error:
            raise L4MError(f"not an OpenAI request from the gateway ({error}): {text[:80]!r}") from None
        if endpoint not in (CHAT_ENDPOINT, COMPLETIONS_ENDPOINT) or not isinstance(body, dict):
            raise L4MError(f"not an OpenAI request from the gateway: endpoint {endpoint!r}")
        return cls(endpoint, body)

    @property
    def is_chat(self) -> bool:
        return self.endpoint == CHAT_ENDPOINT

    @property
    def messages(self) -> list[dict[str, Any]]:
        """A chat request's messages, each content flattened to text."""
        return [{**m, "content": _text(m.get("content"))} for m in self.body.get("messages", [])]

    @property
    def prompt(self) -> str | list[int]:
        """A text completion's prompt: text or token ids."""
        prompt = self.body.get("prompt", "")
        return prompt[0] if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else prompt

    @property
    def max_tokens(self) -> int | None:
        asked = self.body.get("max_completion_tokens") or self.body.get("max_tokens")
        return asked or (None if self.is_chat else DEFAULT_MAX_TOKENS)

    @property
    def stop_strings(self) -> list[str]:
        stop = self.body.get("stop")
        return [stop] if isinstance(stop, str) else list(stop or [])

    def fill(self, context: Context) -> None:
        """Queue the prompt: the messages in the model's chat template, or the completion's prompt."""
        if self.is_chat:
            context.fill_chat(self.messages)
        else:
            context.fill(self.prompt)

    def sampler(self) -> Sampler:
        """Greedy at temperature 0, else a draw at `temperature` after `top_p`, seeded by `seed`; either with
        the request's `logit_bias` and presence / frequency penalties (as the gateway's own handlers)."""
        shaping: dict[str, Any] = {
            "logit_bias": {int(token): float(bias) for token, bias in (self.body.get("logit_bias") or {}).items()},
            "presence_penalty": float(self.body.get("presence_penalty") or 0.0),
            "frequency_penalty": float(self.body.get("frequency_penalty") or 0.0),
        }
        temperature = self.body.get("temperature", 1.0)
        if temperature == 0:
            return Greedy(**shaping)
        top_p = self.body.get("top_p", 1.0)
        return Sample(temperature=temperature, top_p=0.0 if top_p >= 1 else top_p, seed=self.body.get("seed"),
                      **shaping)

    def stop(self, stop_token_ids: Sequence[int]) -> StopCondition:
        """The model's stop tokens, the request's stop strings and its max_tokens."""
        condition: StopCondition = on_tokens(stop_token_ids)
        if self.max_tokens is not None:
            condition = condition | max_tokens(self.max_tokens)
        if self.stop_strings:
            condition = condition | on_strings(*self.stop_strings)
        return condition

    async def finish(self, ctx: Instance, finish_reason: str = "stop", prompt_tokens: int | None = None,
                     completion_tokens: int | None = None) -> None:
        """Send the answer's finish_reason ("stop" or "length") and, when given, its usage."""
        record: dict[str, Any] = {"finish_reason": finish_reason}
        if prompt_tokens is not None and completion_tokens is not None:
            record["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
        await ctx.send(FINISH_PREFIX + json.dumps(record))


async def openai_request(ctx: Instance, timeout_s: float | None = 30.0) -> OpenAIRequest:
    """The request the gateway sent this program (its first message); L4MError when none came."""
    text = await ctx.receive(timeout_s)
    if text is None:
        raise L4MError("no OpenAI request arrived: run this program through the gateway "
                           "(`\"model\": \"l4m/<program>\"`), or give the request on stdin when run locally")
    return OpenAIRequest.parse(text)


def _text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.get("text") or "" for part in content if isinstance(part, dict))
