"""l4m.telemetry: the standard OTEL_* variables alone turn tracing on; spans reach a real OTLP receiver
from another process, continuing a W3C traceparent, over TCP and over a Unix socket."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from concurrent import futures
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from l4m import telemetry
from l4m.wire import tracecontext
from tests.integration.otlp_receiver import OtlpReceiver

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

CHILD = textwrap.dedent(
    """
    from opentelemetry import trace
    from l4m import telemetry
    from l4m.wire import tracecontext
    assert telemetry.configure_tracing("l4m.test-child")
    ctx = tracecontext.context_from_traceparent(PARENT)
    with trace.get_tracer("t").start_as_current_span("child.work", context=ctx):
        pass
    telemetry.shutdown_tracing()
    """
).replace("PARENT", repr(PARENT))


def _run_child(env_extra: dict[str, str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(env_extra)
    subprocess.run([sys.executable, "-c", CHILD], env=env, check=True, timeout=60)


def test_no_variables_means_no_tracing() -> None:
    assert not telemetry.tracing_requested({})
    assert not telemetry.tracing_requested({"OTEL_TRACES_EXPORTER": "none"})
    assert telemetry.tracing_requested({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"})


def test_spans_are_recorded_only_under_a_real_provider() -> None:
    """What the hot paths ask before building spans (the executor's per batch, the scheduler's per command)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    assert not telemetry.tracing_enabled(trace.ProxyTracerProvider())
    assert not telemetry.tracing_enabled(trace.NoOpTracerProvider())
    assert telemetry.tracing_enabled(TracerProvider())


def test_spans_reach_the_receiver_with_the_parent_trace() -> None:
    with OtlpReceiver() as receiver:
        _run_child({"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint})
        spans = receiver.wait_for(lambda s: any(x.name == "child.work" for x in s))
    span = next(s for s in spans if s.name == "child.work")
    assert span.service == "l4m.test-child"
    assert span.trace_id == PARENT.split("-")[1]
    assert span.parent_span_id == PARENT.split("-")[2]


def test_spans_travel_over_a_unix_socket(tmp_path: Path) -> None:
    receiver = OtlpReceiver()
    unix_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, unix_server)
    sock = tmp_path / "otlp.sock"
    unix_server.add_insecure_port(f"unix:{sock}")
    unix_server.start()
    try:
        _run_child({"OTEL_EXPORTER_OTLP_ENDPOINT": f"unix://{sock}"})
        spans = receiver.wait_for(lambda s: any(x.name == "child.work" for x in s))
    finally:
        unix_server.stop(grace=None)
    assert spans[0].trace_id == PARENT.split("-")[1]


def test_traceparent_round_trip() -> None:
    ctx = tracecontext.context_from_traceparent(PARENT)
    assert tracecontext.traceparent_of(ctx)[0] == PARENT
    assert tracecontext.traceparent_of(tracecontext.context_from_traceparent("")) == ("", "")
