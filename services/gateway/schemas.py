"""The request and response shapes of the OpenAI API the gateway speaks (pydantic), and its error shape.

Requests are strict: a field the gateway does not know is a 400 naming it, and a known option it does
not implement yet (top_logprobs, penalties, logit_bias, response formats other than text/JSON, tools, echo,
...)
is a 400 naming the option when it asks for anything but the default (`unsupported_options`): never
silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_STOP_STRINGS = 4  # as OpenAI
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    """What every generating request shares."""

    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Known options not implemented yet: accepted only at their defaults (see `unsupported_options`).
    logprobs: Any = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Extensions (vLLM's names; `extra_body` in the openai package): generate past the model's stop
    # tokens (benchmarks decode a fixed count), and return each choice's token ids (`token_ids` on a
    # choice, and on each streamed chunk the ids of the text it adds).
    ignore_eos: bool = False
    return_token_ids: bool = False

    def wants_logprobs(self) -> bool:
        """The sampled tokens' logprobs: chat `logprobs: true`, a completion's `logprobs: 0`."""
        return self.logprobs is True or (self.logprobs == 0 and self.logprobs is not False
                                          and isinstance(self, CompletionRequest))

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop: a stop sequence is empty")
        return stops


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        kinds = {part.type for part in self.content} - {"text"}
        if kinds:
            raise ValueError(f"messages: content part type {sorted(kinds)[0]!r} is not supported (text only)")
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    def json_schema(self) -> dict[str, Any] | bool | None:
        """What `response_format` asks the output to be: a JSON schema, True for any JSON object
        (`json_object`), None for free text."""
        response_format = self.response_format or {}
        kind = response_format.get("type", "text")
        if kind == "json_object":
            return True
        if kind != "json_schema":
            return None
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("response_format.json_schema.schema: a JSON schema object is required")
        return spec["schema"]
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(default=16, ge=1)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ValueError("prompt: empty")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]


def unsupported_options(request: _Sampling) -> list[str]:
    """The options `request` sets to something the gateway does not implement yet, by name."""
    named = []
    # The sampled token's logprob comes with every token; alternatives (top_logprobs, a completion's
    # `logprobs` N > 0) need a distribution beside the sample, not implemented yet.
    if isinstance(request, CompletionRequest) and request.logprobs not in (None, 0, False):
        named.append("logprobs (alternatives: only logprobs=0)")
    if isinstance(request, ChatCompletionRequest) and request.logprobs not in (None, True, False):
        named.append(f"logprobs {request.logprobs!r}")
    if request.top_logprobs:
        named.append("top_logprobs")
    if request.presence_penalty:
        named.append("presence_penalty")
    if request.frequency_penalty:
        named.append("frequency_penalty")
    if request.logit_bias:
        named.append("logit_bias")
    if isinstance(request, ChatCompletionRequest):
        kind = (request.response_format or {}).get("type", "text")
        if kind not in RESPONSE_FORMATS:
            named.append(f"response_format {kind!r}")
        if request.tools:
            named.append("tools")
        if request.tool_choice not in (None, "none"):
            named.append("tool_choice")
    if isinstance(request, CompletionRequest):
        if request.echo:
            named.append("echo")
        if request.best_of not in (None, 1):
            named.append("best_of")
        if request.suffix:
            named.append("suffix")
    return named


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
