"""The gateway's HTTP app (FastAPI): OpenAI's routes over the built-in handlers.

Thin, like the gRPC servicers: each route authenticates (`authorization: Bearer <API key>`, the
spawner's keys), validates the body (schemas.py), opens a model for the request (backend.py), runs a
handler (handlers.py) and shapes the answer; errors leave in OpenAI's shape (`error_body`) with the
status OpenAI uses: 400 bad request, 401 key, 404 unknown model or route, 413 body too large, 429
quota, 503 no executor. A streamed answer is server-sent events, `data: {chunk}` ... `data: [DONE]`;
the request's session lives inside the stream, so a client that disconnects mid-stream ends it and
the scheduler frees its pages. Every answer is counted by endpoint and status code and timed to its end,
and every answered completion's usage is added up (metrics.py); each completion request is one span
(tracing.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from l4m.common.users import Authenticator, Unauthenticated, User
from l4m.errors import ChatTemplateError, ConstraintError, SessionClosed, Trapped
from l4m.gateway import tools, tracing
from l4m.gateway.backend import Backend, GatewayError
from l4m.gateway.config import GatewayConfig
from l4m.gateway.handlers import Choice, GenerationParams, complete
from l4m.gateway.metrics import GatewayMetrics, RequestMetrics
from l4m.gateway.prefix_cache import PrefixScope
from l4m.gateway.programs import Spawner, answer_program, program_models, program_of
from l4m.gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidParam,
    Usage,
    error_body,
    unsupported_options,
)
from l4m.model import Model
from l4m.tokenizer import Tokenizer
from l4m.v1 import l4m_pb2

# Traps a request can meet, as OpenAI statuses: quotas are 429, a lost or busy executor 503.
_TRAP_STATUS = {
    l4m_pb2.TRAP_KIND_TOKEN_BUDGET: (429, "rate_limit_error", "rate_limit_exceeded"),
    l4m_pb2.TRAP_KIND_RESOURCE_EXHAUSTED: (429, "rate_limit_error", "insufficient_capacity"),
    l4m_pb2.TRAP_KIND_EVICTED: (503, "server_error", "evicted"),
    l4m_pb2.TRAP_KIND_EXECUTOR_LOST: (503, "server_error", "executor_lost"),
}


def _as_gateway_error(error: Exception) -> GatewayError:
    if isinstance(error, GatewayError):
        return error
    if isinstance(error, Trapped):
        status, kind, code = _TRAP_STATUS.get(error.kind, (500, "server_error", "trapped"))
        return GatewayError(status, f"the request was stopped ({error.kind_name}): {error.reason}", kind, code)
    if isinstance(error, ChatTemplateError):
        return GatewayError(400, str(error), param="messages")
    if isinstance(error, ConstraintError):
        return GatewayError(400, f"response_format: {error}", param="response_format")
    if isinstance(error, SessionClosed):
        return GatewayError(503, str(error), "server_error", "unavailable")
    return GatewayError(500, f"{type(error).__name__}: {error}", "server_error")


def _json_error(error: GatewayError) -> JSONResponse:
    tracing.note_error(error.status, error.code or error.kind, error.message)
    return JSONResponse(error_body(error.message, error.kind, error.code, error.param), status_code=error.status)


def create_app(config: GatewayConfig, backend: Backend, authenticator: Authenticator,
               spawner: Spawner | None = None, metrics: GatewayMetrics | None = None) -> FastAPI:
    # FastAPI's own OpenTelemetry (0.165+; older versions ignore the option) would add a server span to
    # every request, /health polls included, and three operation spans to each: the gateway's span is
    # tracing.py's one `gateway.request` per completion instead.
    app = FastAPI(title="l4m gateway", docs_url=None, redoc_url=None, openapi_url=None,
                  telemetry={"tracing": False, "metrics": False, "logs": False})
    metrics = metrics or GatewayMetrics()
    metrics.bind_prefix_cache(backend.prefix_cache.stats)
    backend = _PerUserLimit(backend, config.max_requests_per_user)
    app.state.backend = backend

    @app.exception_handler(GatewayError)
    async def on_gateway_error(request: Request, error: GatewayError) -> JSONResponse:
        return _json_error(error)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if p != "body")
        message = f"{where}: {first['msg']}" if where else first["msg"]
        if first["type"] == "extra_forbidden":
            message = f"{where}: unknown field (not part of the API this gateway serves)"
        return _json_error(GatewayError(400, message, param=where or None))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return _json_error(GatewayError(error.status_code, f"{request.method} {request.url.path}: {error.detail}",
                                        kind))

    @app.middleware("http")
    async def bounded_body(request: Request, call_next):  # type: ignore[no-untyped-def]
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > config.max_request_bytes:
            return _json_error(GatewayError(413, f"the request body is {length} bytes; at most "
                                            f"{config.max_request_bytes}", code="request_too_large"))
        return await call_next(request)

    app.add_middleware(RequestMetrics, metrics=metrics)  # it sees every answer, a 413 included
    app.add_middleware(tracing.RequestSpans)  # outermost: a completion's span holds all of its answer

    def user_of(request: Request) -> User:
        """The caller, before anything of the request is read: a dependency runs before body validation."""
        header = request.headers.get("authorization", "")
        key = header[len("Bearer "):].strip() if header.startswith("Bearer ") else None
        try:
            return authenticator.authenticate(key)
        except Unauthenticated as error:
            raise GatewayError(401, f"{error}", code="invalid_api_key") from None

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request, user: User = Depends(user_of)) -> dict[str, Any]:  # noqa: B008 (FastAPI's idiom)
        created = int(time.time())
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "l4m"}
                                           for name in [*await backend.model_names(),
                                                        *await program_models(spawner, request)]]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request,
                               user: User = Depends(user_of)) -> Any:  # noqa: B008
        tracing.note_request(body.model, body.stream)
        if program_of(body.model) is not None:  # a stored program answers (programs.py)
            return await answer_program(spawner, request, body, _Answer("chat.completion", body.model, 1))
        _check_options(body, config)
        max_new = body.max_completion_tokens or body.max_tokens
        try:
            plan = tools.plan_of(body)
            messages = tools.template_messages(body.messages)
            stops = body.stop_strings()
            schema = body.json_schema()
        except ValueError as error:
            raise GatewayError(400, str(error)) from None

        def prompts(model: Model) -> list[list[int]]:
            if plan is not None:
                plan.check(model)
            return [model.tokenizer.encode(tools.render_prompt(model.tokenizer, messages, plan))]

        return await _run(backend, user, body, prompts, max_new, stops, "chat.completion", config, metrics, schema,
                          plan)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request,
                          user: User = Depends(user_of)) -> Any:  # noqa: B008
        tracing.note_request(body.model, body.stream)
        if program_of(body.model) is not None:
            return await answer_program(spawner, request, body, _Answer("text_completion", body.model, 1))
        _check_options(body, config)
        try:
            entries = body.prompts()
            stops = body.stop_strings()
        except ValueError as error:
            raise GatewayError(400, str(error), param="prompt") from None

        def prompts(model: Model) -> list[list[int]]:
            out = []
            for entry in entries:
                ids = model.tokenizer.encode(entry) if isinstance(entry, str) else list(entry)
                bad = [t for t in ids if not 0 <= t < model.vocab_size]
                if bad:
                    raise GatewayError(400, f"prompt: token id {bad[0]} is not in [0, {model.vocab_size})",
                                       param="prompt")
                out.append(ids)
            return out

        return await _run(backend, user, body, prompts, body.max_tokens, stops, "text_completion", config, metrics)

    return app


class _PerUserLimit:
    """The backend, with at most `limit` requests of one user open at once (a key's own max_instances
    when it sets one): one user cannot hold every instance of the cluster through the gateway."""

    def __init__(self, backend: Backend, limit: int) -> None:
        self._backend, self._limit = backend, limit
        self._open: dict[str, int] = {}

    async def model_names(self) -> list[str]:
        return await self._backend.model_names()

    @contextlib.asynccontextmanager
    async def open(self, user: User, model: str) -> AsyncIterator[Model]:
        limit = user.max_instances or self._limit
        if self._open.get(user.name, 0) >= limit:
            raise GatewayError(429, f"user {user.name!r} has {limit} requests in flight, its limit; retry when one "
                               f"ends", "rate_limit_error", "too_many_requests")
        self._open[user.name] = self._open.get(user.name, 0) + 1
        try:
            async with self._backend.open(user, model) as opened:
                yield opened
        finally:
            self._open[user.name] -= 1
            if not self._open[user.name]:
                del self._open[user.name]

    async def close(self) -> None:
        await self._backend.close()

    def prefixes(self, user: User, model: str) -> PrefixScope | None:
        return self._backend.prefixes(user, model)


def _check_options(body: ChatCompletionRequest | CompletionRequest, config: GatewayConfig) -> None:
    named = unsupported_options(body)
    if named:
        raise GatewayError(400, f"{named[0]} is not supported by this gateway yet (unsupported here: "
                           f"{', '.join(named)})", code="unsupported_option", param=named[0].split()[0])
    try:
        body.num_top_logprobs()
        body.penalties()
    except InvalidParam as error:
        raise GatewayError(400, str(error), param=error.param) from None
    if body.n > config.max_n:
        raise GatewayError(400, f"n: at most {config.max_n} choices per request, got {body.n}", param="n")


async def _run(backend: Backend, user: User, body: ChatCompletionRequest | CompletionRequest, prompts_of,  # type: ignore[no-untyped-def]
               max_new: int | None, stops: list[str], kind: str, config: GatewayConfig, metrics: GatewayMetrics,
               json_schema: dict | bool | None = None, tool_plan: tools.ToolPlan | None = None) -> Any:
    """Open the request's model, tokenize, then answer at once or as a stream that owns the session."""
    stack = contextlib.AsyncExitStack()
    try:
        model = await stack.enter_async_context(backend.open(user, body.model))
        prompts = prompts_of(model)
        params = dataclasses.replace(_params(body, model, prompts, max_new, stops, config), json_schema=json_schema,
                                     grammar=tool_plan.grammar() if tool_plan is not None else None)
        params.constraint(model)  # a schema llguidance rejects is a 400 before anything runs
    except BaseException as error:
        await stack.aclose()
        if isinstance(error, Exception):
            raise _as_gateway_error(error) from error
        raise
    prefixes = backend.prefixes(user, body.model)
    answer = _Answer(kind, body.model, len(prompts) * body.n, body.return_token_ids,
                     model.tokenizer if body.wants_logprobs() else None)
    answer.num_top = params.top_logprobs
    answer.tool_plan = tool_plan if tool_plan is not None and tool_plan.parses_calls else None
    if not body.stream:
        async with stack:
            try:
                choices = await _complete_all(model, prompts, params, None, prefixes)
            except Exception as error:
                raise _as_gateway_error(error) from error
        usage = _usage(prompts, body.n, choices)
        metrics.observe_usage(usage)
        tracing.note_usage(usage)
        return answer.whole(choices, usage)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return StreamingResponse(_stream(stack, model, prompts, params, answer, body.n, include_usage, prefixes, metrics),
                             media_type="text/event-stream", headers={"cache-control": "no-cache"})


def _params(body: ChatCompletionRequest | CompletionRequest, model: Model, prompts: list[list[int]],
            max_new: int | None, stops: list[str], config: GatewayConfig) -> GenerationParams:
    longest = max(len(p) for p in prompts)
    room = model.max_context_tokens - longest
    if room <= 0 or (max_new is not None and max_new > room):
        asked = f" plus {max_new} completion tokens" if max_new is not None else ""
        raise GatewayError(400, f"This model's maximum context length is {model.max_context_tokens} tokens. However, "
                           f"you requested {longest} prompt tokens{asked}.", code="context_length_exceeded")
    if not all(prompts):
        raise GatewayError(400, "the prompt is empty", param="prompt")
    temperature = 1.0 if body.temperature is None else body.temperature
    try:
        logit_bias = body.logit_biases(model.vocab_size)
    except InvalidParam as error:
        raise GatewayError(400, str(error), param=error.param) from None
    presence_penalty, frequency_penalty = body.penalties()
    return GenerationParams(n=body.n, max_tokens=max_new or min(room, config.max_tokens_default),
                            stop_strings=tuple(stops), temperature=temperature,
                            top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
                            ignore_eos=body.ignore_eos, logit_bias=tuple(sorted(logit_bias.items())),
                            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                            top_logprobs=body.num_top_logprobs())


async def _complete_all(model: Model, prompts: Sequence[list[int]], params: GenerationParams, on_delta,  # type: ignore[no-untyped-def]
                        prefixes: PrefixScope | None = None) -> list[Choice]:
    groups = await asyncio.gather(*(complete(model, prompt, params, on_delta, first_index=i * params.n,
                                             prefixes=prefixes)
                                    for i, prompt in enumerate(prompts)))
    return [choice for group in groups for choice in group]


def _usage(prompts: Sequence[list[int]], n: int, choices: Sequence[Choice]) -> Usage:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for c in choices)
    cached_tokens = sum(c.cached_tokens for c in choices if c.index % n == 0)  # once per prompt
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details={"cached_tokens": cached_tokens})


class _Answer:
    """Shapes a chat or text completion, whole or as chunks."""

    def __init__(self, kind: str, model: str, num_choices: int, with_token_ids: bool = False,
                 tokenizer: Tokenizer | None = None) -> None:
        self.kind, self.model, self.num_choices = kind, model, num_choices
        self.with_token_ids = with_token_ids
        self.tokenizer = tokenizer  # set when the request asked for logprobs
        self.num_top = 0  # alternatives asked for beside each token (top_logprobs, a completion's logprobs: k)
        prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.is_chat = kind == "chat.completion"
        self.tool_plan: tools.ToolPlan | None = None  # set when the answer may hold tool calls
        self._tool_parsers: tools.ChoiceParsers | None = None

    def logprobs(self, token_ids: Sequence[int], logprobs: Sequence[float],
                 tops: Sequence[Sequence[tuple[int, float]]] = ()) -> dict[str, Any] | None:
        """OpenAI's logprobs object of these tokens, with each one's alternatives `tops` when the request
        asked for some (chat `top_logprobs`, a completion's `logprobs: k`), or None when not asked for."""
        if self.tokenizer is None:
            return None
        token_to_str = self.tokenizer.token_to_str
        texts = [token_to_str(t) for t in token_ids]
        tops = tops or [()] * len(texts)
        if self.is_chat:
            return {"content": [{"token": text, "logprob": lp, "bytes": list(text.encode()),
                                 "top_logprobs": [{"token": (alt := token_to_str(t)), "logprob": alt_lp,
                                                   "bytes": list(alt.encode())} for t, alt_lp in top]}
                                for text, lp, top in zip(texts, logprobs, tops, strict=True)], "refusal": None}
        offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
        # The legacy shape: per token a {text: logprob} of its alternatives (None when none were asked); two
        # tokens of one text (parts of a character both show U+FFFD) keep the more probable.
        top_logprobs = [_by_text(top, token_to_str) for top in tops] if self.num_top else None
        return {"tokens": texts, "token_logprobs": list(logprobs), "top_logprobs": top_logprobs,
                "text_offset": offsets}

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                "system_fingerprint": None}

    def whole(self, choices: Sequence[Choice], usage: Usage) -> dict[str, Any]:
        if self.is_chat:
            shaped = [{"index": c.index, "message": {"role": "assistant", "content": c.text, "refusal": None},
                       "logprobs": self.logprobs(c.token_ids, c.logprobs, c.top_logprobs),
                       "finish_reason": c.finish_reason}
                      for c in choices]
        else:
            shaped = [{"index": c.index, "text": c.text,
                       "logprobs": self.logprobs(c.token_ids, c.logprobs, c.top_logprobs),
                       "finish_reason": c.finish_reason} for c in choices]
        if self.tool_plan is not None:
            for shape, choice in zip(shaped, choices, strict=True):
                parsed = tools.parse(self.tool_plan, choice.text)
                shape["message"].update(parsed.message())
                shape["finish_reason"] = parsed.finish_reason(choice.finish_reason)
        if self.with_token_ids:
            for shape, choice in zip(shaped, choices, strict=True):
                shape["token_ids"] = choice.token_ids
        return {**self._envelope(self.kind, shaped), "usage": usage.model_dump()}

    def chunk(self, index: int, text: str | None = None, finish_reason: str | None = None,
              role: bool = False, token_ids: list[int] | None = None,
              logprobs: list[float] | None = None, tool_calls: list[dict[str, Any]] | None = None,
              tops: Sequence[Sequence[tuple[int, float]]] = ()) -> dict[str, Any]:
        shaped_logprobs = self.logprobs(token_ids, logprobs, tops) if token_ids and logprobs is not None else None
        if self.is_chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            if tool_calls is not None:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta, "logprobs": shaped_logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": shaped_logprobs, "finish_reason": finish_reason}
        if self.with_token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        return self._envelope("chat.completion.chunk" if self.is_chat else "text_completion", [choice])

    def pieces(self, index: int, text: str, token_ids: list[int], logprobs: list[float],
               tops: Sequence[Sequence[tuple[int, float]]] = ()) -> list[dict[str, Any]]:
        """The chunks a generated piece of a choice makes: its text, or with tools the deltas it releases
        (the piece's tokens ride on the first; alone, on an empty delta, when the request reads them)."""
        if self.tool_plan is None:
            return [self.chunk(index, text, token_ids=token_ids, logprobs=logprobs, tops=tops)]
        self._tool_parsers = self._tool_parsers or tools.ChoiceParsers(self.tool_plan)
        deltas = self._tool_parsers.push(index, text)
        if not deltas and (self.with_token_ids or self.tokenizer is not None):
            return [self.chunk(index, None, token_ids=token_ids, logprobs=logprobs, tops=tops)]
        return [self.chunk(index, d.get("content"), tool_calls=d.get("tool_calls"), token_ids=token_ids if k == 0
                           else [], logprobs=logprobs if k == 0 else [], tops=tops if k == 0 else ())
                for k, d in enumerate(deltas)]

    def last_pieces(self, choice: Choice) -> list[dict[str, Any]]:
        """A choice's last chunks: what its tool-call parser held back, then its finish_reason."""
        if self.tool_plan is None:
            return [self.chunk(choice.index, None if self.is_chat else "", choice.finish_reason)]
        self._tool_parsers = self._tool_parsers or tools.ChoiceParsers(self.tool_plan)
        deltas, reason = self._tool_parsers.finish(choice.index, choice.finish_reason)
        return [*(self.chunk(choice.index, d.get("content"), tool_calls=d.get("tool_calls")) for d in deltas),
                self.chunk(choice.index, None, reason)]

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.is_chat else "text_completion"
        return {**self._envelope(kind, []), "usage": usage.model_dump()}


def _by_text(top: Sequence[tuple[int, float]], token_to_str) -> dict[str, float]:  # type: ignore[no-untyped-def]
    shaped: dict[str, float] = {}
    for token_id, logprob in top:  # most probable first
        shaped.setdefault(token_to_str(token_id), logprob)
    return shaped


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _stream(stack: contextlib.AsyncExitStack, model: Model, prompts: list[list[int]], params: GenerationParams,
                  answer: _Answer, n: int, include_usage: bool, prefixes: PrefixScope | None,
                  metrics: GatewayMetrics) -> AsyncIterator[str]:
    """The chunks as the choices generate; the session (in `stack`) ends when the stream does, however."""
    queue: asyncio.Queue[tuple[int, str, list[int], list[float], list[tuple[tuple[int, float], ...]]] | None] = \
        asyncio.Queue()
    outcome: list[Any] = []

    async def run() -> None:
        try:
            outcome.append(await _complete_all(model, prompts, params,
                                               lambda *delta: queue.put_nowait(delta),
                                               prefixes))
        except Exception as error:  # reported in the stream, which has already said 200
            outcome.append(error)
        queue.put_nowait(None)

    task = asyncio.create_task(run())
    try:
        if answer.is_chat:
            for index in range(answer.num_choices):
                yield _event(answer.chunk(index, "", role=True))
        while (item := await queue.get()) is not None:
            for chunk in answer.pieces(*item):
                yield _event(chunk)
        result = outcome[0]
        if isinstance(result, Exception):
            error = _as_gateway_error(result)
            tracing.note_error(error.status, error.code or error.kind, error.message, after_answer_began=True)
            yield _event(error_body(error.message, error.kind, error.code, error.param))
        else:
            for choice in result:
                for chunk in answer.last_pieces(choice):
                    yield _event(chunk)
            usage = _usage(prompts, n, result)
            metrics.observe_usage(usage)
            tracing.note_usage(usage)
            if include_usage:
                yield _event(answer.usage_chunk(usage))
        yield "data: [DONE]\n\n"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await stack.aclose()
