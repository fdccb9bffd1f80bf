"""`python -m l4m.scheduler.simulated` is served like every l4m service (`l4m.common.serving`): grpc
health says SERVING for ExecutorService once it listens, and SIGTERM stops it cleanly."""

from __future__ import annotations

import signal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from l4m.v1 import executor_pb2, executor_pb2_grpc
from tests.integration.harness import ServiceProcess

SERVICE = executor_pb2.DESCRIPTOR.services_by_name["ExecutorService"].full_name


def test_the_simulated_executor_serves_health_and_stops_on_sigterm() -> None:
    process = ServiceProcess("l4m.scheduler.simulated", ["--listen", "127.0.0.1:0", "--num-kv-pages", "8"],
                             name="simulated-executor")
    try:
        address = process.wait_listening(30)
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", SERVICE):
                answer = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING, name
            info = executor_pb2_grpc.ExecutorServiceStub(channel).GetInfo(
                executor_pb2.ExecutorServiceGetInfoRequest(), timeout=10)
            assert info.num_kv_pages == 8
        process.process.send_signal(signal.SIGTERM)
        assert process.process.wait(15) == 0, process.log_tail()
    finally:
        process.stop()
