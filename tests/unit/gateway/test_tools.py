"""Function calling in the gateway (`tools`, `tool_choice`, `parallel_tool_calls`): the grammar that makes
the output a call (or free text, for "auto"), reading calls back piece by piece, the prompt a template that
ignores tools gets, OpenAI's answer and stream shapes through the official `openai` package (in process,
no socket), and a 400 naming the param for every bad request."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from tokenizers import Tokenizer

from l4m.constraint import Constraint
from l4m.fake import FakeL4M, tiny_tokenizer_json
from l4m.gateway.schemas import ChatCompletionRequest, ChatMessage
from l4m.gateway.tools import (
    CALL_TAG,
    MAX_TOOLS,
    TOOLS_PROMPT,
    CallParser,
    ToolPlan,
    format_call,
    parse,
    plan_of,
    render_prompt,
    template_messages,
)
from l4m.model import Model
from l4m.session import Session
from tests.unit.gateway.test_gateway import MESSAGES, MODEL, Gateway

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
COUNT = {"type": "object", "properties": {"n": {"$ref": "#/$defs/small"}}, "required": ["n"],
         "additionalProperties": False, "$defs": {"small": {"type": "integer", "minimum": 0, "maximum": 9}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "count", "parameters": COUNT}}]
SCHEMAS = {"get_weather": WEATHER, "count": COUNT}
CALL = format_call("get_weather", {"city": "Paris", "unit": "c"})


def _model(fake: FakeL4M | None = None) -> Model:
    fake = fake or FakeL4M()
    return Model(Session(fake.stub(), blocking_get_info=fake.get_info_blocking), fake.info())


def _gateway(tmp_path: Path) -> Gateway:
    """A gateway whose fake has room for the tools' prompt (its tokens are bytes: ~1,300 of them)."""
    gateway = Gateway(tmp_path)
    gateway.fake = FakeL4M(num_kv_pages=2048)
    gateway.backend._fake = gateway.fake  # type: ignore[attr-defined]
    return gateway


def _plan(choice: object = "auto", parallel: bool | None = None) -> ToolPlan:
    request = ChatCompletionRequest(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                    parallel_tool_calls=parallel)
    plan = plan_of(request)
    assert plan is not None
    return plan


def _follows(model: Model, grammar: str, text: str) -> bool:
    """Whether `text` is a complete output under `grammar` (every token allowed, the grammar accepting)."""
    constraint = Constraint.lark(model, grammar)
    try:
        for token_id in model.tokenizer.encode(text):
            constraint.consume(token_id)
    except Exception:
        return False
    return constraint.is_accepting()


def test_the_grammar_allows_exactly_what_tool_choice_asks() -> None:
    model = _model()
    second = format_call("count", {"n": 3})
    cases = {
        "auto": {"Hello there": True, "": True, CALL: True, f"{CALL}\n{second}": True, "I'd say <tool_call>": True,
                 "<tool_call>\nhello": False, CALL.replace("Paris", "Parisienne-ville"): False},
        "required": {"Hello there": False, CALL: True, f"{CALL}\n{second}": True,
                     format_call("count", {"n": 12}): False, format_call("nope", {}): False},
        json.dumps({"type": "function", "function": {"name": "count"}}): {CALL: False, second: True,
                                                                          f"{second}\n{second}": False},
    }
    for choice, texts in cases.items():
        plan = _plan(json.loads(choice) if choice.startswith("{") else choice)
        for text, allowed in texts.items():
            assert _follows(model, plan.grammar(), text) == allowed, (choice, text)
    assert not _follows(model, _plan("required", parallel=False).grammar(), f"{CALL}\n{second}")


def test_none_allows_any_text_but_the_call_tag_anywhere() -> None:
    model = _model()
    grammar = _plan("none").grammar()
    texts = {"Hello there": True, "": True, "I would use the get_weather tool for that.": True,
             "Tags look like <tool> or <tool_call (unclosed)": True, "<tool_response>sunny</tool_response>": True,
             CALL: False, "<tool_call>": False, "I'd say <tool_call>": False, f"Sure.\n{CALL}": False,
             "a <tool_call> in the middle": False}
    for text, allowed in texts.items():
        assert _follows(model, grammar, text) == allowed, text
    json_none = ChatCompletionRequest(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                      response_format={"type": "json_object"})
    assert plan_of(json_none).grammar() is None  # type: ignore[union-attr]  # the JSON constraint applies instead


def test_a_call_is_read_back_the_same_piece_by_piece_as_whole() -> None:
    tricky = format_call("count", {"n": 3}).replace('{"n": 3}', '{"n": 3, "s": "a}\\"{["}')
    text = f"{CALL}\n{tricky}"
    whole = parse(_plan("required"), text)
    assert whole.is_complete and whole.message()["content"] is None
    assert [c["function"]["name"] for c in whole.calls] == ["get_weather", "count"]
    assert json.loads(whole.calls[1]["function"]["arguments"]) == {"n": 3, "s": 'a}"{['}
    streamed = CallParser(_plan("required"))
    deltas = [d for char in text for d in streamed.push(char)] + streamed.finish()
    calls: dict[int, dict] = {}
    for delta in deltas:
        (entry,) = delta["tool_calls"]
        if "id" in entry:  # a call starts: id, type and name, arguments empty
            assert entry["type"] == "function" and entry["function"]["arguments"] == ""
            calls[entry["index"]] = {"name": entry["function"]["name"], "arguments": ""}
        else:
            calls[entry["index"]]["arguments"] += entry["function"]["arguments"]
    assert [c["function"]["name"] for c in whole.calls] == [c["name"] for c in calls.values()]
    assert [c["function"]["arguments"] for c in whole.calls] == [c["arguments"] for c in calls.values()]
    assert all(c["id"].startswith("call_") for c in whole.calls) and streamed.finish_reason("stop") == "tool_calls"


def test_auto_holds_back_only_what_could_be_the_tag() -> None:
    parser = CallParser(_plan("auto"))
    assert parser.push("<to") == [] and parser.push("p") == [{"content": "<top"}] and parser.push("!") == [
        {"content": "!"}]
    assert parser.finish_reason("stop") == "stop" and parser.message() == {"content": "<top!"}
    held = CallParser(_plan("auto"))
    assert held.push("<tool") == [] and held.finish() == [{"content": "<tool"}]
    cut = parse(_plan("auto"), CALL[:-20])  # max_tokens in the middle of the arguments
    assert cut.calls and not cut.is_complete and cut.finish_reason("length") == "length"


def test_a_template_that_ignores_tools_gets_them_in_the_system_prompt() -> None:
    tokenizer = _model().tokenizer  # the fake's template is SmolLM2's: no tools
    history = [ChatMessage(role="user", content="Weather in Paris?"),
               ChatMessage(role="assistant", content=None, tool_calls=[{
                   "id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]),
               ChatMessage(role="tool", tool_call_id="call_1", content="21 C")]
    prompt = render_prompt(tokenizer, template_messages(history), _plan())
    assert prompt.startswith("<|im_start|>system\n" + TOOLS_PROMPT.split("{")[0])
    assert json.dumps(TOOLS[0], ensure_ascii=False) in prompt and f"<|im_start|>assistant\n{CALL}<|im_end|>" in prompt
    assert "<|im_start|>tool\n<tool_response>\n21 C\n</tool_response><|im_end|>" in prompt
    plain = [ChatMessage(role="user", content="hi")]
    assert render_prompt(tokenizer, template_messages(plain), None) == tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}])


def test_a_template_that_renders_tools_gets_them_as_transformers_passes_them() -> None:
    template = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}"
                "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments.city }}]{% endfor %}"
                "{% if m.name %} ({{ m.name }}){% endif %}\n{% endfor %}")
    tokenizer = _model(FakeL4M(chat_template=template)).tokenizer
    history = [ChatMessage(role="assistant", tool_calls=[{
                   "id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]),
               ChatMessage(role="tool", tool_call_id="c1", content="-3")]
    prompt = render_prompt(tokenizer, template_messages(history), _plan())
    # (trim_blocks, as transformers: a newline after a block tag is dropped)
    assert prompt == "TOOLS:get_weather;count;assistant: [get_weather Oslo]tool: -3 (get_weather)"


async def test_required_and_named_answers_are_calls_that_validate(tmp_path: Path) -> None:
    gateway = _gateway(tmp_path)
    client = gateway.client()
    answer = await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                  temperature=1.0, seed=3, n=3, max_tokens=200,
                                                  parallel_tool_calls=False)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    named = await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0,
                                                 tool_choice={"type": "function", "function": {"name": "count"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "count" and 0 <= json.loads(call.function.arguments)["n"] <= 9
    gateway.assert_freed()


async def test_a_streamed_call_arrives_as_openais_tool_call_deltas(tmp_path: Path) -> None:
    gateway = _gateway(tmp_path)
    client = gateway.client()
    request = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "temperature": 0,
               "max_tokens": 200, "parallel_tool_calls": False}
    whole = await client.chat.completions.create(**request)
    stream = await client.chat.completions.create(**request, stream=True)
    chunks = [c async for c in stream]
    deltas = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    first, rest = deltas[0], deltas[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == whole.choices[0].message.tool_calls[0].function.name
    assert all(d.id is None and d.function.name is None for d in rest if d.index == 0)
    arguments = "".join(d.function.arguments or "" for d in deltas if d.index == 0)
    assert arguments == whole.choices[0].message.tool_calls[0].function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
    assert not any(c.choices[0].delta.content for c in chunks)
    sampled = {**request, "temperature": 1.0, "seed": 7, "n": 2}  # each choice on its own, as whole
    whole = await client.chat.completions.create(**sampled)
    calls = {0: "", 1: ""}
    async for chunk in await client.chat.completions.create(**sampled, stream=True):
        for choice in chunk.choices:
            calls[choice.index] += "".join(d.function.arguments or "" for d in choice.delta.tool_calls or [])
    assert calls == {c.index: c.message.tool_calls[0].function.arguments for c in whole.choices}
    gateway.assert_freed()


async def test_auto_and_none_answer_text_and_a_tool_result_goes_back(tmp_path: Path) -> None:
    """The fake model starts an answer with the tag about once in 259 tokens: "auto" is text here
    (the call branch is the grammar test's); "none" is text; a conversation carrying a call and its result
    is taken."""
    gateway = _gateway(tmp_path)
    client = gateway.client()
    auto = await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0,
                                                max_tokens=10)
    none = await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                                temperature=0, max_tokens=10)
    bare = await client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=10)
    for answer in (auto, none):
        assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content
        assert answer.choices[0].finish_reason in ("stop", "length")
        assert answer.usage.prompt_tokens > bare.usage.prompt_tokens + 200  # the tools are in the prompt
    call = (await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0,
                                                 tool_choice="required", max_tokens=200)).choices[0].message
    followed = await client.chat.completions.create(model=MODEL, tools=TOOLS, temperature=0, max_tokens=5, messages=[
        *MESSAGES, call.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "sunny"}])
    assert followed.choices[0].message.content is not None
    gateway.assert_freed()


class _TagWriter(FakeL4M):
    """A model trained on the call format: whatever came before, it wants to go on writing `<tool_call>`."""

    TAG_IDS = Tokenizer.from_str(tiny_tokenizer_json()).encode(CALL_TAG).ids

    def logits(self, visible: Sequence[tuple[int, int]]) -> np.ndarray:
        logits = super().logits(visible)
        tokens = [token for token, _ in visible]
        spelled = next(k for k in range(len(self.TAG_IDS), -1, -1) if tokens[len(tokens) - k:] == self.TAG_IDS[:k])
        logits[self.TAG_IDS[spelled % len(self.TAG_IDS)]] += 100.0
        return logits


async def test_none_keeps_a_model_that_wants_to_call_to_text(tmp_path: Path) -> None:
    """Without tools the model writes the tag; with tool_choice "none" it never gets it out, whole or
    streamed, and no call is read from the answer; a JSON response_format with "none" is that JSON."""
    gateway = _gateway(tmp_path)
    gateway.fake = gateway.backend._fake = _TagWriter(num_kv_pages=2048)  # type: ignore[attr-defined]
    client = gateway.client()
    request = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 40}
    free = await client.chat.completions.create(**request)
    assert CALL_TAG in free.choices[0].message.content
    none = await client.chat.completions.create(**request, tools=TOOLS, tool_choice="none")
    (choice,) = none.choices
    assert choice.message.tool_calls is None and choice.finish_reason == "length"
    assert choice.message.content.startswith("<tool_call") and CALL_TAG not in choice.message.content
    stream = await client.chat.completions.create(**request, tools=TOOLS, tool_choice="none", stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == choice.message.content
    as_json = await client.chat.completions.create(**{**request, "max_tokens": 200}, tools=TOOLS, tool_choice="none",
                                                   response_format={"type": "json_schema", "json_schema": {
                                                       "name": "weather", "schema": WEATHER}})
    jsonschema.validate(json.loads(as_json.choices[0].message.content), WEATHER)
    gateway.assert_freed()


def _tools(count: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{i}"}} for i in range(count)]


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
         "no function named 'nope' in tools (tools: get_weather, count)"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "'sometimes' is not one of"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "tool_choice.function: Field required"),
        ({"tool_choice": "auto"}, "tool_choice", "only allowed when tools are given"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type", "tools.0.type: Input should be 'function'"),
        ({"tools": {"get_weather": WEATHER}}, "tools", "tools: Input should be a valid list"),
        ({"tools": []}, "tools", "tools: an empty list"),
        ({"tools": _tools(MAX_TOOLS + 1)}, "tools", f"tools: at most {MAX_TOOLS} functions, got {MAX_TOOLS + 1}"),
        ({"tools": [*_tools(2), *_tools(1)]}, "tools[2].function.name", "'f0' is given twice"),
        ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name",
         "must be 1 to 64 letters"),
        ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "g", "parameters": {
            "type": "object", "properties": {"a": {"type": "wrong"}}}}}]}, "tools[1].function.parameters",
         "tools[1].function.parameters: the JSON schema was rejected by llguidance"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format",
         "a JSON response_format with tools is not supported"),
        ({"messages": [{"role": "tool", "content": "21 C"}]}, "messages[0].tool_call_id", "give its id"),
    ],
)
async def test_bad_tool_requests_get_400s_naming_the_param(tmp_path: Path, extra, param, words) -> None:  # type: ignore[no-untyped-def]
    gateway = _gateway(tmp_path)
    response = await gateway.raw("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"
    gateway.assert_freed()
