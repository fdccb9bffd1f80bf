"""The request and response shapes of the OpenAI API the gateway speaks (pydantic), and its error shape.

Requests are strict: a field the gateway does not know is a 400 naming it, and a known option it does
not implement yet (response formats other than text/JSON, echo, ...)
is a 400 naming the option when it asks for anything but the default (`unsupported_options`): never
silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_STOP_STRINGS = 4  # as OpenAI
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, as OpenAI (and the executor's rules.MAX_TOP_LOGPROBS)
MAX_COMPLETION_LOGPROBS = 5  # a text completion's legacy `logprobs` k, as OpenAI
MAX_LOGIT_BIAS = 100.0  # each logit_bias value in [-100, 100], as OpenAI
MAX_LOGIT_BIAS_ENTRIES = 300  # as OpenAI; well under the protocol's rules.MAX_LOGIT_BIAS_ENTRIES
MAX_PENALTY = 2.0  # presence_penalty / frequency_penalty in [-2, 2], as OpenAI


class InvalidParam(ValueError):
    """A request option out of its range: the message, and the option it names (OpenAI's `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
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
    # chat: a bool; a text completion: the legacy k in [0, 5] (`top_logprobs` is chat's k in [0, 20]).
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
        """The sampled tokens' logprobs: chat `logprobs: true`, a completion's `logprobs: k` (any k)."""
        if isinstance(self, CompletionRequest):
            return isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool)
        return self.logprobs is True

    def num_top_logprobs(self) -> int:
        """The alternatives asked for beside each token (chat `top_logprobs`, a completion's `logprobs`);
        raises InvalidParam for a value out of OpenAI's range."""
        if isinstance(self, CompletionRequest):
            if self.top_logprobs is not None:
                raise InvalidParam("top_logprobs", "top_logprobs: not a completions option; use logprobs: k")
            if self.logprobs is None:
                return 0
            if isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int) \
                    or not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
                raise InvalidParam("logprobs", f"logprobs: an integer in [0, {MAX_COMPLETION_LOGPROBS}] for "
                                   f"completions, got {self.logprobs!r}")
            return self.logprobs
        if self.logprobs is not None and not isinstance(self.logprobs, bool):
            raise InvalidParam("logprobs", f"logprobs: a boolean, got {self.logprobs!r}")
        if self.top_logprobs is None:
            return 0
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidParam("top_logprobs", f"top_logprobs: an integer in [0, {MAX_TOP_LOGPROBS}], got "
                               f"{self.top_logprobs}")
        if self.top_logprobs and self.logprobs is not True:
            raise InvalidParam("top_logprobs", "top_logprobs: needs logprobs: true")
        return self.top_logprobs

    def penalties(self) -> tuple[float, float]:
        """(presence_penalty, frequency_penalty), 0 when not given; raises InvalidParam outside [-2, 2]."""
        values = []
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and not -MAX_PENALTY <= value <= MAX_PENALTY:  # NaN fails too
                raise InvalidParam(name, f"{name}: a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
            values.append(value or 0.0)
        return values[0], values[1]

    def logit_biases(self, vocab_size: int) -> dict[int, float]:
        """`logit_bias` as {token id: bias}; raises InvalidParam("logit_bias") for a key that is not a token
        id of the model, a bias outside [-100, 100] (NaN and inf too) or more than 300 entries."""
        entries = self.logit_bias or {}
        if len(entries) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidParam("logit_bias", f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} entries, got "
                               f"{len(entries)}")
        biases = {}
        for key, value in entries.items():
            token_id = int(key) if key.isascii() and key.isdigit() else -1
            if not 0 <= token_id < vocab_size:
                raise InvalidParam("logit_bias", f"logit_bias: key {key!r} is not a token id in [0, {vocab_size})")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise InvalidParam("logit_bias", f"logit_bias: the bias of token {key} is {value}, not in "
                                   f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
            biases[token_id] = value
        return biases

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


class FunctionDefinition(BaseModel):
    """A tool: a function the model may call (`parameters` is the JSON schema of its arguments)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice` naming the one function to call."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    """A call an assistant made, as a conversation sends it back."""

    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool result's: the call it answers

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
    tools: list[ToolDefinition] | None = None
    # "none", "auto", "required" or a NamedToolChoice: checked in tools.py, which names what is wrong.
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

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
    if isinstance(request, ChatCompletionRequest):
        kind = (request.response_format or {}).get("type", "text")
        if kind not in RESPONSE_FORMATS:
            named.append(f"response_format {kind!r}")
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
