"""Requests that name a stored program (`"model": "l4m/<tag or sha256>"`): the spawner runs it sandboxed,
as `l4m run` does, and its messages are the answer.

Identity: the gateway calls the spawner with the caller's own API key (the one it authenticated; none
under --insecure-local), so the spawner decides what the caller may run, with the caller's quotas and
limits, exactly as for `l4m run`: the gateway adds no power of its own. Another user's program is not
found, like an unknown one (the spawner's rule), so a 404 reveals nothing.

The contract with the program (`l4m.openai_compat` is its side): its first user message is the request
as JSON, `{"endpoint": "chat.completions" | "completions", "request": {fields the client sent}}`; each
message it sends is the next piece of the answer's text; a message starting with `FINISH_PREFIX` carries
the finish_reason and usage; exit 0 ends the answer, any other end is an OpenAI-shaped error naming the
exit (500; 503 when the sandbox could not start or the spawner killed it). The instance lives as long as
the request: a stream the client leaves, or any error, terminates it (its sandbox and pages are freed).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpc
from fastapi import Request
from fastapi.responses import StreamingResponse

from l4m.gateway import tracing
from l4m.gateway.backend import GatewayError
from l4m.gateway.handlers import Choice
from l4m.gateway.schemas import ChatCompletionRequest, CompletionRequest, Usage, error_body
from l4m.session import call_metadata
from l4m.v1 import spawner_pb2, spawner_pb2_grpc
from l4m.wire.credentials import bearer_metadata, open_channel
from l4m.wire.openai_program import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, FINISH_PREFIX
from l4m.wire.tracecontext import traceparent_of

PROGRAM_PREFIX = "l4m/"
SPAWNER_DEADLINE_S = 30.0
MAX_REASON_CHARS = 2000  # of a failed program's exit message in the error

# gRPC refusals of the spawner as OpenAI statuses: (status, type, code).
_REFUSAL_STATUS = {
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "too_many_requests"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (503, "server_error", "unavailable"),
    grpc.StatusCode.FAILED_PRECONDITION: (503, "server_error", "unavailable"),
}
# Ends that are the cluster's doing, not the program's.
_UNAVAILABLE_EXITS = (spawner_pb2.EXIT_REASON_LAUNCH_FAILED, spawner_pb2.EXIT_REASON_KILLED)


class SpawnerRefused(Exception):
    """The spawner refused a call: its gRPC status code and details."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class Spawner(Protocol):
    """The spawner's user API, every call as the user whose API key it carries (None: no key)."""

    async def launch(self, api_key: str | None, program: str) -> str:
        """Starts `program` (tag or sha256), not detached; its instance id."""

    async def send(self, api_key: str | None, instance_id: str, text: str) -> None: ...

    def attach(self, api_key: str | None, instance_id: str) -> AsyncIterator[spawner_pb2.AttachResponse]:
        """Its events from the start, one by one, the exit last; closing it ends the Attach stream."""

    async def terminate(self, api_key: str | None, instance_id: str) -> None: ...

    async def program_tags(self, api_key: str | None) -> list[str]:
        """The tags of the programs the caller may run."""

    async def close(self) -> None: ...


class SpawnerClient:
    """`Spawner` over gRPC: one channel, the caller's key on each call."""

    def __init__(self, address: str, tls_ca: Any = None) -> None:
        self._channel = open_channel(address, tls_ca)
        self._stub = spawner_pb2_grpc.SpawnerServiceStub(self._channel)

    async def launch(self, api_key: str | None, program: str) -> str:
        request = spawner_pb2.LaunchRequest(program=program)
        response = await self._call(self._stub.Launch(request, timeout=SPAWNER_DEADLINE_S,
                                                      metadata=launch_metadata(api_key)))
        return response.instance_id

    async def send(self, api_key: str | None, instance_id: str, text: str) -> None:
        request = spawner_pb2.SendMessageRequest(instance_id=instance_id, text=text)
        await self._call(self._stub.SendMessage(request, timeout=SPAWNER_DEADLINE_S, metadata=_metadata(api_key)))

    async def attach(self, api_key: str | None, instance_id: str) -> AsyncIterator[spawner_pb2.AttachResponse]:
        call = self._stub.Attach(spawner_pb2.AttachRequest(instance_id=instance_id, batch_events=True),
                                 metadata=_metadata(api_key))
        try:
            async for response in call:
                for event in response.events or [response]:
                    yield event
        except grpc.aio.AioRpcError as error:
            raise SpawnerRefused(error.code(), error.details() or "") from error
        finally:
            call.cancel()  # the spawner ends a non-detached instance whose last attacher went away

    async def terminate(self, api_key: str | None, instance_id: str) -> None:
        request = spawner_pb2.TerminateRequest(instance_id=instance_id)
        await self._call(self._stub.Terminate(request, timeout=SPAWNER_DEADLINE_S, metadata=_metadata(api_key)))

    async def program_tags(self, api_key: str | None) -> list[str]:
        response = await self._call(self._stub.ListPrograms(spawner_pb2.ListProgramsRequest(),
                                                            timeout=SPAWNER_DEADLINE_S, metadata=_metadata(api_key)))
        return sorted(tag for program in response.programs for tag in program.tags)

    async def close(self) -> None:
        await self._channel.close()

    @staticmethod
    async def _call(awaitable):  # type: ignore[no-untyped-def]
        try:
            return await awaitable
        except grpc.aio.AioRpcError as error:
            raise SpawnerRefused(error.code(), error.details() or "") from error


def _metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return tuple(bearer_metadata(api_key)) if api_key else ()


def launch_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """A Launch's: the caller's key and the current span's `traceparent` (the request's `gateway.request`),
    so `spawner.launch` and the program's run join the request's trace."""
    return (*_metadata(api_key), *call_metadata(traceparent=traceparent_of()[0]))


def program_of(model: str) -> str | None:
    """The program a request's `model` names (`l4m/<tag or sha256>`), or None for a model."""
    return model[len(PROGRAM_PREFIX):] if model.startswith(PROGRAM_PREFIX) else None


def api_key_of(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    return header[len("Bearer "):].strip() or None if header.startswith("Bearer ") else None


async def program_models(spawner: Spawner | None, request: Request) -> list[str]:
    """`l4m/<tag>` for every tagged program the caller may run; none when the spawner does not answer
    (the models still list)."""
    if spawner is None:
        return []
    try:
        return [PROGRAM_PREFIX + tag for tag in await spawner.program_tags(api_key_of(request))]
    except SpawnerRefused:
        return []


def refused_options(body: ChatCompletionRequest | CompletionRequest) -> list[str]:
    """Options whose answer a program's text cannot give (the rest go to the program as sent)."""
    named = [name for name, refused in (
        ("n", body.n != 1), ("logprobs", body.logprobs is not None and body.logprobs is not False),
        ("top_logprobs", bool(body.top_logprobs)), ("return_token_ids", body.return_token_ids),
        ("tools", bool(getattr(body, "tools", None))), ("echo", bool(getattr(body, "echo", False))),
        ("best_of", getattr(body, "best_of", None) not in (None, 1)), ("suffix", bool(getattr(body, "suffix", None))),
    ) if refused]
    if isinstance(body, CompletionRequest) and isinstance(body.prompt, list) and body.prompt \
            and not isinstance(body.prompt[0], int) and len(body.prompt) > 1:
        named.append("prompt (one prompt per request to a program)")
    return named


def request_message(body: ChatCompletionRequest | CompletionRequest) -> str:
    """The program's first message: the request as the client sent it (validated)."""
    endpoint = CHAT_ENDPOINT if isinstance(body, ChatCompletionRequest) else COMPLETIONS_ENDPOINT
    return json.dumps({"endpoint": endpoint, "request": body.model_dump(mode="json", exclude_unset=True)})


def _refusal(error: SpawnerRefused, model: str) -> GatewayError:
    status, kind, code = _REFUSAL_STATUS.get(error.code, (500, "server_error", None))
    if status == 404:
        return GatewayError(404, f"The model {model!r} does not exist or you do not have access to it "
                            f"({error.details})", "invalid_request_error", code, "model")
    return GatewayError(status, f"the spawner refused to run {model!r} ({error.code.name}): {error.details}",
                        kind, code)


def _failure(exit_: spawner_pb2.InstanceExit, model: str) -> GatewayError:
    reason = spawner_pb2.ExitReason.Name(exit_.reason).removeprefix("EXIT_REASON_")
    how = f"{reason}, exit code {exit_.exit_code}" if exit_.reason in (
        spawner_pb2.EXIT_REASON_EXITED, spawner_pb2.EXIT_REASON_CRASHED) else reason
    message = f"the program {model!r} failed ({how}): {exit_.message[-MAX_REASON_CHARS:] or 'no reason given'}"
    if exit_.reason in _UNAVAILABLE_EXITS:
        return GatewayError(503, message, "server_error", "unavailable")
    return GatewayError(500, message, "server_error", f"program_{reason.lower()}")


class ProgramRun:
    """One launched instance for one request: its text pieces, then how it finished; `close` ends it."""

    def __init__(self, spawner: Spawner, api_key: str | None, model: str) -> None:
        self._spawner, self._api_key, self.model = spawner, api_key, model
        self.instance_id: str | None = None
        self.finish_reason = "stop"
        self.usage: Usage | None = None
        self._events: AsyncIterator[spawner_pb2.AttachResponse] | None = None
        self._exited = False

    async def start(self, program: str, message: str) -> None:
        try:
            self.instance_id = await self._spawner.launch(self._api_key, program)
            tracing.note_instance(self.instance_id)
            self._events = self._spawner.attach(self._api_key, self.instance_id)
            await self._spawner.send(self._api_key, self.instance_id, message)
        except SpawnerRefused as error:
            await self.close()
            if self.instance_id is not None and error.code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise GatewayError(413, f"the request does not fit the program's inbox: {error.details}",
                                   code="request_too_large") from error
            raise _refusal(error, self.model) from error

    async def texts(self) -> AsyncIterator[str]:
        """The answer's pieces as the program sends them; raises GatewayError when it fails."""
        assert self._events is not None, "start() first"
        try:
            async for event in self._events:
                kind = event.WhichOneof("event")
                if kind == "message" and event.message.text.startswith(FINISH_PREFIX):
                    self._finish(event.message.text[len(FINISH_PREFIX):])
                elif kind == "message" and event.message.text:
                    yield event.message.text
                elif kind == "exit":
                    self._exited = True
                    if event.exit.reason != spawner_pb2.EXIT_REASON_EXITED or event.exit.exit_code != 0:
                        raise _failure(event.exit, self.model)
                    return
        except SpawnerRefused as error:
            raise _refusal(error, self.model) from error
        raise GatewayError(503, f"the spawner ended {self.model!r}'s output without its exit", "server_error",
                           "unavailable")

    def _finish(self, record: str) -> None:
        try:
            parsed = json.loads(record)
            if parsed.get("finish_reason") in ("stop", "length"):
                self.finish_reason = parsed["finish_reason"]
            usage = parsed.get("usage")
            if usage:
                prompt, completion = int(usage["prompt_tokens"]), int(usage["completion_tokens"])
                self.usage = Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
                tracing.note_usage(self.usage)
        except (ValueError, TypeError, KeyError, AttributeError):
            pass  # a malformed end record leaves the defaults: the text is the answer all the same

    async def close(self) -> None:
        """End the Attach stream and, unless it exited, the instance (idempotent)."""
        if self._events is not None:
            with contextlib.suppress(Exception):
                await self._events.aclose()  # type: ignore[attr-defined]
        if self.instance_id is not None and not self._exited:
            self._exited = True
            with contextlib.suppress(SpawnerRefused):
                await self._spawner.terminate(self._api_key, self.instance_id)


async def answer_program(spawner: Spawner | None, request: Request, body: ChatCompletionRequest | CompletionRequest,
                         answer: Any) -> Any:
    """Run the program `body.model` names for this request; the whole answer, or its stream. `answer`
    shapes it (the server's `_Answer`: `whole`, `chunk`, `usage_chunk`, `is_chat`)."""
    if spawner is None:
        raise GatewayError(503, "this gateway runs no programs (it was started without --spawner)", "server_error",
                           "unavailable")
    named = refused_options(body)
    if named:
        raise GatewayError(400, f"{named[0]} is not available for a program's answer (refused here: "
                           f"{', '.join(named)})", code="unsupported_option", param=named[0].split()[0])
    run = ProgramRun(spawner, api_key_of(request), body.model)
    await run.start(program_of(body.model) or "", request_message(body))
    texts = run.texts()
    if not body.stream:
        try:
            text = "".join([piece async for piece in texts])
        finally:
            await texts.aclose()
            await run.close()
        choice = Choice(index=0, text=text, token_ids=[], finish_reason=run.finish_reason, logprobs=[])
        whole = answer.whole([choice], run.usage or _NO_USAGE)
        return {**whole, "usage": run.usage.model_dump() if run.usage else None}
    try:
        first = await anext(texts, None)  # a program that fails at once is an HTTP error, not a broken stream
    except BaseException:
        await run.close()
        raise
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return StreamingResponse(_stream(run, texts, first, answer, include_usage), media_type="text/event-stream",
                             headers={"cache-control": "no-cache"})


_NO_USAGE = Usage(prompt_tokens=0, completion_tokens=0, total_tokens=0)


async def _stream(run: ProgramRun, texts: AsyncIterator[str], first: str | None, answer: Any,
                  include_usage: bool) -> AsyncIterator[str]:
    """The program's pieces as chunks; the instance ends with the stream, however it ends."""
    try:
        if answer.is_chat:
            yield _event(answer.chunk(0, "", role=True))
        if first is not None:
            yield _event(answer.chunk(0, first))
            try:
                async for text in texts:
                    yield _event(answer.chunk(0, text))
            except GatewayError as error:  # reported in the stream, which has already said 200
                tracing.note_error(error.status, error.code or error.kind, error.message, after_answer_began=True)
                yield _event(error_body(error.message, error.kind, error.code, error.param))
                yield "data: [DONE]\n\n"
                return
        yield _event(answer.chunk(0, None if answer.is_chat else "", run.finish_reason))
        if include_usage and run.usage is not None:
            yield _event(answer.usage_chunk(run.usage))
        yield "data: [DONE]\n\n"
    finally:
        await texts.aclose()  # type: ignore[attr-defined]
        await run.close()


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
