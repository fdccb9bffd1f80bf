"""The gateway's `gateway.request` span (tracing.py), in process: the app over a `FakeBackend` that notes
the trace context each request opens its model in, an SDK tracer exporting to memory. A completion is
one span, the child of the caller's `traceparent`, with its model, tokens and status (no user); the L4M
session and a program's Launch carry it as their parent; untraced, the caller's context passes through."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx2
import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, StatusCode, TraceFlags

from l4m.common.users import Authenticator, User
from l4m.gateway import tracing
from l4m.gateway.backend import FakeBackend
from l4m.gateway.programs import launch_metadata
from l4m.gateway.server import create_app
from l4m.model import Model
from l4m.wire.tracecontext import traceparent_of
from tests.unit.gateway.test_gateway import MESSAGES, MODEL, Gateway

TRACE_ID, CALLER_SPAN_ID = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
CALLER = f"00-{TRACE_ID:032x}-{CALLER_SPAN_ID:016x}-01"


class _NotingBackend(FakeBackend):
    """Notes the `traceparent` current when each request opens its model (what ClusterBackend's session sends)."""

    def __init__(self, fake: object) -> None:
        super().__init__(fake)
        self.traceparents: list[str] = []

    @contextlib.asynccontextmanager
    async def open(self, user: User, model: str) -> AsyncIterator[Model]:
        self.traceparents.append(traceparent_of()[0])
        async with super().open(user, model) as opened:
            yield opened


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("l4m.gateway"))
    return exporter


def _gateway(tmp_path: Path) -> tuple[Gateway, _NotingBackend]:
    gateway = Gateway(tmp_path)
    backend = _NotingBackend(gateway.fake)
    gateway.backend = backend
    gateway.app = create_app(gateway.config, backend, Authenticator(tmp_path / "keys.json"))
    gateway.http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=gateway.app), base_url="http://gateway")
    return gateway, backend


async def _post(gateway: Gateway, path: str, body: dict, traceparent: str | None = None) -> httpx2.Response:
    headers = {"authorization": f"Bearer {gateway.key}", "content-type": "application/json",
               **({"traceparent": traceparent} if traceparent else {})}
    return await gateway.http.post(path, content=json.dumps(body), headers=headers)


def _traceparent_of(span: ReadableSpan) -> str:
    return f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}-{int(span.context.trace_flags):02x}"


async def test_a_completion_is_one_span_under_the_callers_and_above_its_session(
        tmp_path: Path, exporter: InMemorySpanExporter) -> None:
    gateway, backend = _gateway(tmp_path)
    answer = await _post(gateway, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "temperature": 0,
                                                           "max_tokens": 5}, traceparent=CALLER)
    assert answer.status_code == 200, answer.text
    (span,) = exporter.get_finished_spans()
    assert (span.name, span.kind, span.context.trace_id, span.parent.span_id) == (
        "gateway.request", SpanKind.SERVER, TRACE_ID, CALLER_SPAN_ID)
    usage = answer.json()["usage"]
    assert {key: span.attributes[key] for key in ("http.route", "http.response.status_code", "l4m.model", "l4m.stream",
                                                   "l4m.prompt_tokens", "l4m.completion_tokens")} == {
        "http.route": "/v1/chat/completions", "http.response.status_code": 200, "l4m.model": MODEL,
        "l4m.stream": False, "l4m.prompt_tokens": usage["prompt_tokens"],
        "l4m.completion_tokens": usage["completion_tokens"]}
    assert "l4m.user" not in span.attributes and "alice" not in span.attributes.values()  # as the spawner's spans
    assert span.status.status_code == StatusCode.UNSET
    assert backend.traceparents == [_traceparent_of(span)]  # the session's parent: the scheduler's spans join
    gateway.assert_freed()


async def test_a_stream_is_spanned_to_its_end_and_without_a_caller_starts_a_trace(
        tmp_path: Path, exporter: InMemorySpanExporter) -> None:
    gateway, backend = _gateway(tmp_path)
    answer = await _post(gateway, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 4,
                                                      "stream": True, "stream_options": {"include_usage": True}})
    assert answer.status_code == 200 and answer.text.endswith("data: [DONE]\n\n"), answer.text
    (span,) = exporter.get_finished_spans()
    assert span.parent is None and span.attributes["l4m.stream"] is True
    last = json.loads(answer.text.split("data: ")[-2])  # the usage chunk: its tokens were noted before the end
    assert span.attributes["l4m.completion_tokens"] == last["usage"]["completion_tokens"] > 0
    assert backend.traceparents == [_traceparent_of(span)]


@pytest.mark.parametrize("bad", ["garbage", "00-" + "0" * 32 + "-" + "0" * 16 + "-01", "00-xyz-abc-01"])
async def test_a_malformed_traceparent_starts_a_trace_of_its_own(
        tmp_path: Path, exporter: InMemorySpanExporter, bad: str) -> None:
    """A caller's header joins its own request to a trace, nothing more; one the W3C format refuses (all-zero
    ids included) is ignored, as the rest of the cluster ignores it, and the request is answered."""
    gateway, backend = _gateway(tmp_path)
    answer = await _post(gateway, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 2},
                         traceparent=bad)
    assert answer.status_code == 200, answer.text
    (span,) = exporter.get_finished_spans()
    assert span.parent is None and span.context.trace_id != 0
    assert backend.traceparents == [_traceparent_of(span)]


async def test_refused_requests_carry_their_status_and_error_type(tmp_path: Path,
                                                                  exporter: InMemorySpanExporter) -> None:
    gateway, _ = _gateway(tmp_path)
    unknown = await _post(gateway, "/v1/chat/completions", {"model": "nope", "messages": MESSAGES})
    invalid = await _post(gateway, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "n": 0})
    assert (unknown.status_code, invalid.status_code) == (404, 400)
    await gateway.http.get("/health")  # not a completion: no span
    spans = exporter.get_finished_spans()
    assert [(s.attributes["http.response.status_code"], s.attributes["error.type"]) for s in spans] == [
        (404, "model_not_found"), (400, "invalid_request_error")]
    assert all(s.status.status_code == StatusCode.UNSET for s in spans)  # a caller's mistake is not the server's


async def test_untraced_the_callers_context_reaches_the_session_unchanged(tmp_path: Path) -> None:
    gateway, backend = _gateway(tmp_path)  # no provider: the API's no-op tracer
    answer = await _post(gateway, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 2},
                         traceparent=CALLER)
    assert answer.status_code == 200 and backend.traceparents == [CALLER]


def test_a_programs_launch_carries_the_current_span_as_its_parent() -> None:
    span = NonRecordingSpan(SpanContext(TRACE_ID, CALLER_SPAN_ID, is_remote=False, trace_flags=TraceFlags(1)))
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        assert dict(launch_metadata("l4m_key")) == {"authorization": "Bearer l4m_key", "traceparent": CALLER}
    finally:
        otel_context.detach(token)
    assert dict(launch_metadata(None)) == {}
