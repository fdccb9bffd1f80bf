"""Chat templates rendered as transformers' `apply_chat_template` renders them.

Imported on first use only: jinja2's import is ~20 ms of a controller's start-up. The environment is
transformers' (`transformers.utils.chat_template_utils._compile_jinja_template`): a sandbox with
trim_blocks and lstrip_blocks, the loopcontrols extension (`{% break %}`), a `tojson` that keeps
non-ASCII text and escapes no HTML, the globals `raise_exception` and `strftime_now`, and a
`{% generation %}` block (transformers marks the assistant's tokens with it; it renders its body).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from l4m.errors import ChatTemplateError


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers' filter: jinja2's own escapes HTML (<, >, &, ') and takes no ensure_ascii.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the model's chat template refused the conversation: {message}")


def _strftime_now(format: str) -> str:  # noqa: A002 (the name templates pass it by)
    return datetime.now().strftime(format)


def compile_template(source: str) -> jinja2.Template:
    """The template, compiled; ChatTemplateError when it is not valid Jinja."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(
            f"the model's chat template is not valid Jinja (line {error.lineno}): {error.message}"
        ) from error


def render(
    template: jinja2.Template,
    messages: Sequence[Mapping[str, object]],
    add_generation_prompt: bool,
    tools: Sequence[Mapping[str, object]] | None,
    variables: Mapping[str, object],
) -> str:
    """The prompt text. Like transformers, keys whose value is None are dropped from each message (many
    templates test `'key' in message`), and `tools` and `documents` are always defined."""
    messages = [{key: value for key, value in m.items() if value is not None} for m in messages]
    try:
        return template.render(
            messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.TemplateError as error:  # an undefined name, a sandbox refusal
        raise ChatTemplateError(f"the model's chat template failed on this conversation: {error}") from error
