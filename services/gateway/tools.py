"""Function calling (`tools`, `tool_choice`, `parallel_tool_calls`) through constrained output.

One call format, Hermes's (Hermes and Qwen 2.5/3 are trained on it): a call is

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and several calls are such blocks separated by a newline. The tools reach the model through its chat
template (`tools=`, as transformers passes them); a template that ignores them (its text is the same
with and without) gets `TOOLS_PROMPT` in the system message instead, and earlier calls and results
written in the same format.

`ToolPlan.grammar` is the llguidance Lark grammar of what the request allows, so the output is exact:
"required" is one or more calls (one with `parallel_tool_calls: false`), a named function exactly one
call of it, "auto" free text *or* calls -- the text branch may not start with `<tool_call>`, so the
first characters decide, and a call, once begun, must be complete and valid. Each call is the literal
`{"name": "<name>", "arguments": ` followed by the function's parameters schema (`%json`, compact
separators, properties in the schema's order), so a function's `$ref`s resolve in its own schema. "none"
is free text that never contains `<tool_call>` anywhere (a model trained on the format would otherwise
still write calls, which the client would get as content); with a JSON `response_format` its schema
constrains the answer instead (JSON is never a call). `CallParser` reads the text back into OpenAI's
`tool_calls`, piece by piece for a stream; the grammar guarantees it finds the format it expects.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from l4m.constraint import Constraint
from l4m.errors import ChatTemplateError, ConstraintError
from l4m.gateway.backend import GatewayError
from l4m.gateway.schemas import ChatCompletionRequest, ChatMessage, FunctionDefinition, NamedToolChoice
from l4m.model import Model
from l4m.tokenizer import Tokenizer

MAX_TOOLS = 128  # as OpenAI
CALL_TAG = "<tool_call>"
CALL_OPEN, CALL_CLOSE, CALL_SEPARATOR = CALL_TAG + "\n", "\n</tool_call>", "\n"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names: no JSON escapes needed
_CALL_HEAD = re.compile(r'<tool_call>\n\{"name": "([A-Za-z0-9_-]*)", "arguments": ')
# llguidance's JSON options: compact (a small model given free whitespace wanders into blank lines), and
# the separators `CallParser` expects.
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}

TOOLS_PROMPT = """# Tools

You may call functions to help answer. Their signatures, one JSON object a line, are within <tools></tools>:
<tools>
{signatures}
</tools>

To call a function, answer with only a JSON object with its name and arguments within <tool_call></tool_call> \
tags, one block per call:
<tool_call>
{{"name": <function-name>, "arguments": <arguments-json-object>}}
</tool_call>
The results come back within <tool_response></tool_response> tags."""


def _bad(message: str, param: str) -> GatewayError:
    return GatewayError(400, message, param=param)


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask of the answer: `functions` are all its tools (the prompt shows every
    one), `choice` is "none", "auto", "required" or the name of the one function to call, `parallel`
    whether an answer may hold several calls, `json_output` whether a JSON response_format (allowed
    with "none" only) constrains the answer in place of `grammar`."""

    functions: tuple[FunctionDefinition, ...]
    choice: str
    parallel: bool
    json_output: bool = False

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as transformers hands them to a chat template (OpenAI's shape)."""
        return [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in self.functions]

    def grammar(self) -> str | None:
        """The llguidance Lark grammar of the allowed output; None when a JSON response_format constrains it."""
        if self.json_output:
            return None
        if not self.parses_calls:
            # Text without the tag anywhere: a call can neither start nor hide after some text.
            return f"start: TEXT\nTEXT: /(?s:.*)/ & ~/(?s:.*{re.escape(CALL_TAG)}.*)/\n"
        named = self.choice not in ("auto", "required")
        callable_ = [f for f in self.functions if not named or f.name == self.choice]
        rules = []
        for i, function in enumerate(callable_):
            head = CALL_OPEN + '{"name": ' + json.dumps(function.name) + ', "arguments": '
            rules.append(f"call_{i}: {json.dumps(head)} args_{i} {json.dumps('}' + CALL_CLOSE)}")
            rules.append(f"args_{i}: %json {json.dumps(_parameters_schema(function))}")
        rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(callable_))))
        rules.append(f"calls: call ({json.dumps(CALL_SEPARATOR)} call)*" if self.parallel and not named
                     else "calls: call")
        if self.choice == "auto":
            # Free text that does not begin with the tag, or calls: the tag commits the answer to a call.
            rules += ["start: TEXT | calls", f"TEXT: /(?s:.*)/ & ~/(?s:{re.escape(CALL_TAG)}.*)/"]
        else:
            rules.append("start: calls")
        return "\n".join(rules) + "\n"

    def check(self, model: Model) -> None:
        """A 400 naming the function whose parameters schema llguidance rejects."""
        grammar = self.grammar()
        if grammar is None:
            return
        try:
            Constraint.lark(model, grammar)
        except ConstraintError as error:
            for i, function in enumerate(self.functions):
                try:
                    Constraint.json_schema(model, _parameters_schema(function))
                except ConstraintError as bad:
                    param = f"tools[{i}].function.parameters"
                    raise _bad(f"{param}: {bad}", param) from None
            raise _bad(f"tools: {error}", "tools") from None


def _parameters_schema(function: FunctionDefinition) -> dict[str, Any]:
    schema = dict(function.parameters) if function.parameters is not None else dict(_NO_PARAMETERS)
    schema["x-guidance"] = _COMPACT_JSON
    return schema


def plan_of(request: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tools, checked (a 400 naming the param); None when it has none."""
    if request.tools is None:
        if request.tool_choice is not None:
            raise _bad("tool_choice: only allowed when tools are given", "tool_choice")
        return None
    if not request.tools:
        raise _bad("tools: an empty list; give at least one function or leave tools out", "tools")
    if len(request.tools) > MAX_TOOLS:
        raise _bad(f"tools: at most {MAX_TOOLS} functions, got {len(request.tools)}", "tools")
    names = [tool.function.name for tool in request.tools]
    for i, name in enumerate(names):
        if not _NAME.fullmatch(name):
            raise _bad(f"tools[{i}].function.name: {name!r} must be 1 to 64 letters, digits, _ or -",
                       f"tools[{i}].function.name")
        if name in names[:i]:
            raise _bad(f"tools[{i}].function.name: {name!r} is given twice", f"tools[{i}].function.name")
    if request.tool_choice != "none" and request.json_schema() is not None:
        raise _bad("response_format: a JSON response_format with tools is not supported (use tool_choice "
                   "'none', or a function)", "response_format")
    parallel = request.parallel_tool_calls is not False
    return ToolPlan(tuple(tool.function for tool in request.tools), _choice(request.tool_choice, names), parallel,
                    json_output=request.json_schema() is not None)


def _choice(tool_choice: object, names: Sequence[str]) -> str:
    if tool_choice is None:
        return "auto"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise _bad(f"tool_choice: {tool_choice!r} is not one of 'none', 'auto', 'required' or "
                       f"{{'type': 'function', 'function': {{'name': ...}}}}", "tool_choice")
        return tool_choice
    try:
        named = NamedToolChoice.model_validate(tool_choice)
    except ValidationError as error:
        where = ".".join(str(p) for p in error.errors()[0]["loc"])
        raise _bad(f"tool_choice.{where}: {error.errors()[0]['msg']}", "tool_choice") from None
    if named.function.name not in names:
        raise _bad(f"tool_choice: no function named {named.function.name!r} in tools (tools: "
                   f"{', '.join(names)})", "tool_choice")
    return named.function.name


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation as a chat template reads it (transformers' shape): an assistant's `tool_calls`
    with their arguments as objects (templates write them with `tojson`), a tool result with its
    `tool_call_id` and the `name` of the function it answers. ValueError for content it cannot take, a
    400 for a tool call or result out of place."""
    names_by_id: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        entry: dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.name:
            entry["name"] = message.name
        if message.tool_calls:
            if message.role != "assistant":
                raise _bad(f"messages[{i}].tool_calls: only an assistant message makes tool calls",
                           f"messages[{i}].tool_calls")
            entry["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": _arguments(call.function.arguments)}}
                for call in message.tool_calls]
            names_by_id.update((call.id, call.function.name) for call in message.tool_calls)
            if message.content is None:
                entry["content"] = None  # as OpenAI sent it: templates test for it
        if message.role == "tool":
            if not message.tool_call_id:
                raise _bad(f"messages[{i}].tool_call_id: a tool message answers a call; give its id",
                           f"messages[{i}].tool_call_id")
            entry["tool_call_id"] = message.tool_call_id
            if message.tool_call_id in names_by_id:
                entry.setdefault("name", names_by_id[message.tool_call_id])
        out.append(entry)
    return out


def _arguments(arguments: str) -> object:
    """A call's arguments as the object they spell; the string itself when they are not JSON (a call cut
    at max_tokens)."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def render_prompt(tokenizer: Tokenizer, messages: list[dict[str, Any]], plan: ToolPlan | None) -> str:
    """The chat prompt: the model's template given the tools, or, when it ignores them, the tools in the
    system message and earlier calls and results written in the call format."""
    tools = plan.template_tools() if plan is not None else None
    has_tool_turns = any("tool_calls" in m or m["role"] == "tool" for m in messages)
    if tools is None and not has_tool_turns:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if _renders_tools(tokenizer):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    return tokenizer.apply_chat_template(_described(messages, tools), add_generation_prompt=True)


def _renders_tools(tokenizer: Tokenizer) -> bool:
    """Whether the model's chat template writes tools into the prompt (its text changes with them)."""
    probe = [{"role": "user", "content": "?"}]
    tool = {"type": "function", "function": {"name": "probe", "description": "probe", "parameters": _NO_PARAMETERS}}
    try:
        return (tokenizer.apply_chat_template(probe, add_generation_prompt=True, tools=[tool])
                != tokenizer.apply_chat_template(probe, add_generation_prompt=True))
    except ChatTemplateError:
        return False


def _described(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The conversation for a template that ignores tools: TOOLS_PROMPT in the system message, calls as
    the assistant's text, results within <tool_response> tags."""
    out = []
    for message in messages:
        entry = {"role": message["role"], "content": message.get("content") or ""}
        if "tool_calls" in message:
            calls = [format_call(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
            entry["content"] = CALL_SEPARATOR.join(([entry["content"]] if entry["content"] else []) + calls)
        elif message["role"] == "tool":
            entry["content"] = f"<tool_response>\n{entry['content']}\n</tool_response>"
        out.append(entry)
    if tools:
        signatures = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        description = TOOLS_PROMPT.format(signatures=signatures)
        if out and out[0]["role"] in ("system", "developer"):
            out[0]["content"] = f"{out[0]['content']}\n\n{description}" if out[0]["content"] else description
        else:
            out.insert(0, {"role": "system", "content": description})
    return out


def format_call(name: str, arguments: object) -> str:
    """One call block, as the grammar spells it."""
    written = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False,
                                                                       separators=(", ", ": "))
    return f'{CALL_OPEN}{{"name": {json.dumps(name)}, "arguments": {written}}}{CALL_CLOSE}'


class CallParser:
    """One choice's output, read piece by piece into OpenAI's delta fields: `{"content": text}` or
    `{"tool_calls": [{index, id, type, function: {name, arguments}}]}` for a call's start (its name, once
    complete), then `{"tool_calls": [{index, function: {arguments: fragment}}]}` as its arguments come.

    Under "auto" text is held back while it could still be the tag; "required" and a named function
    begin with a call. An answer cut short (max_tokens, a stop string) keeps the calls begun so far,
    the last with the arguments as far as they came.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self._state = "decide" if plan.choice == "auto" else "head"  # then "text", or "head"/"args"/"tail"
        self._pending = ""  # text read but not yet turned into deltas
        self._depth = 0  # in the arguments: nesting depth, whether inside a string, after a backslash
        self._in_string = self._escaped = False
        self.content: str | None = None
        self.calls: list[dict[str, Any]] = []

    @property
    def is_complete(self) -> bool:
        """Calls were made and none is cut short."""
        return bool(self.calls) and self._state == "head"

    def push(self, text: str) -> list[dict[str, Any]]:
        self._pending += text
        if self._state == "decide":
            if CALL_TAG.startswith(self._pending):
                return []  # could still be the tag
            self._state = "head" if self._pending.startswith(CALL_TAG) else "text"
        if self._state == "text":
            return self._text()
        return self._read_calls()

    def finish(self) -> list[dict[str, Any]]:
        """The deltas the end of the output releases (text held back as a possible tag)."""
        if self._state == "decide" or (self._state == "head" and not self.calls and self._pending):
            self._state = "text"
            return self._text()
        return []

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.is_complete else reason

    def message(self) -> dict[str, Any]:
        """The whole answer's message fields: content, or content null and the tool calls."""
        if not self.calls:
            return {"content": self.content or ""}
        return {"content": None, "tool_calls": self.calls}

    def _text(self) -> list[dict[str, Any]]:
        piece, self._pending = self._pending, ""
        self.content = (self.content or "") + piece
        return [{"content": piece}] if piece else []

    def _read_calls(self) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        while True:
            if self._state == "head":
                start = len(CALL_SEPARATOR) if self.calls else 0
                if self.calls and not self._pending.startswith(CALL_SEPARATOR):
                    return deltas
                match = _CALL_HEAD.match(self._pending, start)
                if match is None:
                    return deltas
                call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                        "function": {"name": match.group(1), "arguments": ""}}
                self.calls.append(call)
                deltas.append({"tool_calls": [{"index": len(self.calls) - 1, "id": call["id"], "type": "function",
                                               "function": {"name": match.group(1), "arguments": ""}}]})
                self._pending = self._pending[match.end():]
                self._state, self._depth = "args", 0
            elif self._state == "args":
                end = self._arguments_end()
                piece = self._pending[:end]
                if piece:
                    self.calls[-1]["function"]["arguments"] += piece
                    deltas.append({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": piece}}]})
                self._pending = self._pending[end:]
                if not self._pending:
                    return deltas
                self._state = "tail"
            else:
                tail = "}" + CALL_CLOSE
                if not self._pending.startswith(tail):
                    return deltas
                self._pending = self._pending[len(tail):]
                self._state = "head"

    def _arguments_end(self) -> int:
        """Where the arguments end in `_pending` (at the `}` closing the call at depth 0), or its length
        when they go on."""
        for i, char in enumerate(self._pending):
            if self._in_string:
                self._escaped, self._in_string = (False, True) if self._escaped else (char == "\\", char != '"')
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                if self._depth == 0:
                    return i
                self._depth -= 1
        return len(self._pending)


def parse(plan: ToolPlan, text: str) -> CallParser:
    """A whole answer, read."""
    parser = CallParser(plan)
    parser.push(text)
    parser.finish()
    return parser


class ChoiceParsers:
    """A `CallParser` per choice of a streamed answer."""

    def __init__(self, plan: ToolPlan) -> None:
        self._plan = plan
        self._parsers: dict[int, CallParser] = {}

    def push(self, index: int, text: str) -> list[dict[str, Any]]:
        return self._parser(index).push(text)

    def finish(self, index: int, reason: str) -> tuple[list[dict[str, Any]], str]:
        """The choice's last deltas and its finish_reason ("tool_calls" for complete calls)."""
        parser = self._parser(index)
        return parser.finish(), parser.finish_reason(reason)

    def _parser(self, index: int) -> CallParser:
        if index not in self._parsers:
            self._parsers[index] = CallParser(self._plan)
        return self._parsers[index]
