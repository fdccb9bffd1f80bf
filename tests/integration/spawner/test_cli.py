"""`python -m l4m.spawner` as the cluster launcher runs it, next to a real scheduler and a real OTLP
receiver: health and reflection, one trace per launch continuing the user's `traceparent` (with the
controller's own span exported from inside its sandbox through the spawner), Prometheus metrics over
loopback, and SIGTERM ending every instance and freeing its pages in the scheduler."""

from __future__ import annotations

import asyncio
import signal
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from l4m.v1 import spawner_pb2, spawner_pb2_grpc
from tests.integration.harness import ServiceProcess, free_port
from tests.integration.otlp_receiver import OtlpReceiver
from tests.integration.spawner.conftest import SchedulerCluster
from tests.integration.spawner.harness import attach, exit_of, upload
from tests.integration.spawner.test_with_scheduler import GENERATE_FOREVER, _kv_pages, _scheduler_stats

USER_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
USER_SPAN_ID = "00f067aa0ba902b7"
USER_TRACEPARENT = f"00-{USER_TRACE_ID}-{USER_SPAN_ID}-01"

TRACED = """
import os
from opentelemetry import trace
from l4m import telemetry
from l4m.wire import tracecontext

async def main(ctx):
    if not hasattr(trace.get_tracer_provider(), "force_flush"):  # the runner may have set it up
        assert telemetry.configure_tracing("unused: OTEL_SERVICE_NAME is set")
    parent = tracecontext.context_from_traceparent(os.environ["TRACEPARENT"])
    with trace.get_tracer("test").start_as_current_span("controller.work", context=parent):
        c = ctx.new_context()
        c.fill([1, 2, 3])
        await c.next_token()
    trace.get_tracer_provider().force_flush()
    await ctx.send("traced")
"""


def _metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    series = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            series[name] = float(value)
    return series


def test_the_spawner_process_traces_meters_and_stops_cleanly(
    scheduler_cluster: SchedulerCluster, tmp_path: Path
) -> None:
    metrics_port = free_port()
    with OtlpReceiver() as receiver:
        spawner = ServiceProcess(
            "l4m.spawner",
            ["--listen", "127.0.0.1:0", "--scheduler", scheduler_cluster.registry_address, "--insecure-local",
             "--cluster-secret-file", str(scheduler_cluster.cluster_secret_file),
             "--socket-dir", str(scheduler_cluster.socket_dir), "--state-dir", str(tmp_path / "spawner"),
             "--sandbox", "process", "--metrics-port", str(metrics_port), "--spawner-id", "cli-test"],
            tmp_path / "spawner.log",
            env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"},
        )  # fmt: skip
        try:
            address = spawner.wait_listening(30)
            asyncio.run(_check_running_spawner(address, metrics_port, receiver, spawner, scheduler_cluster))
        finally:
            spawner.stop()
            print(f"---- spawner.log ----\n{spawner.log_tail()}")


async def _check_running_spawner(
    address: str,
    metrics_port: int,
    receiver: OtlpReceiver,
    spawner: ServiceProcess,
    cluster: SchedulerCluster,
) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "l4m.v1.SpawnerService"):
            answer = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(address) as sync_channel:
            services = ProtoReflectionDescriptorDatabase(sync_channel).get_services()
        assert "l4m.v1.SpawnerService" in services and "l4m.v1.RuntimeService" not in services, services

        stub = spawner_pb2_grpc.SpawnerServiceStub(channel)
        sha = await upload(stub, TRACED)
        launched = await stub.Launch(
            spawner_pb2.LaunchRequest(program=sha), metadata=(("traceparent", USER_TRACEPARENT),), timeout=30
        )
        events = await attach(stub, launched.instance_id)
        assert exit_of(events).reason == spawner_pb2.EXIT_REASON_EXITED, events
        _check_trace(receiver, launched.instance_id)

        series = _metrics(metrics_port)
        assert series['l4m_spawner_launch_latency_seconds_count{sandbox="process"}'] == 1, series
        assert series['l4m_spawner_sandbox_exits_total{reason="exited"}'] == 1, series
        assert series["l4m_spawner_output_bytes_total"] >= len("traced"), series
        assert series['l4m_spawner_instances{state="running"}'] == 0, series

        # SIGTERM while an instance generates: it is ended and destroyed in the scheduler.
        sha = await upload(stub, GENERATE_FOREVER)
        launched = await stub.Launch(spawner_pb2.LaunchRequest(program=sha), timeout=30)
        async for event in stub.Attach(
            spawner_pb2.AttachRequest(instance_id=launched.instance_id), timeout=60
        ):
            assert not event.HasField("exit"), event
            if event.HasField("message"):
                break
        assert _metrics(metrics_port)['l4m_spawner_instances{state="running"}'] == 1
        free, total = _kv_pages(await _scheduler_stats(cluster.scheduler_address))
        assert free < total
    spawner.process.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(spawner.process.wait, 30) == 0, spawner.log_tail()
    assert _kv_pages(await _scheduler_stats(cluster.scheduler_address)) == (total, total)


def _check_trace(receiver: OtlpReceiver, instance_id: str) -> None:
    names = {"spawner.launch", "spawner.instance", "controller.work"}
    spans = receiver.wait_for(lambda got: names <= {s.name for s in got if s.trace_id == USER_TRACE_ID})
    by_name = {s.name: s for s in spans if s.trace_id == USER_TRACE_ID}
    launch, run, work = (by_name[name] for name in ("spawner.launch", "spawner.instance", "controller.work"))
    assert launch.service == "l4m.spawner" and launch.parent_span_id == USER_SPAN_ID, launch
    assert launch.attributes["l4m.instance_id"] == instance_id, launch
    assert launch.attributes["l4m.sandbox"] == "process", launch
    assert run.parent_span_id == launch.span_id and run.attributes["l4m.exit_reason"] == "exited", run
    # Exported from inside the sandbox (no network) through the spawner's runtime socket.
    assert work.service == "l4m.controller" and work.parent_span_id == launch.span_id, work
