"""The executor as a real subprocess on loopback, as `l4m up` runs it (cluster secret, here with TLS too):
GetInfo, health, a few batches incl. malformed ones; callers without the secret or without TLS are
refused; the scheduler reaches it with the secret and the CA."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from l4m.v1 import common_pb2, executor_pb2, executor_pb2_grpc, l4m_pb2, l4m_pb2_grpc
from l4m.wire.credentials import bearer_metadata, write_secret_file
from tests.integration.harness import ServiceProcess
from tests.integration.tls_certs import make_certificates

DEADLINE_S = 60


@dataclass(frozen=True)
class SecuredExecutor:
    address: str
    secret_file: Path
    secret: str
    ca_path: Path

    def channel(self) -> grpc.Channel:
        return grpc.secure_channel(self.address, grpc.ssl_channel_credentials(self.ca_path.read_bytes()))


@pytest.fixture(scope="module")
def executor(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    directory = tmp_path_factory.mktemp("executor")
    secret_file = directory / "cluster.secret"
    secret = write_secret_file(secret_file)
    certificates = make_certificates(directory / "tls")
    process = ServiceProcess(
        "l4m.executor",
        ["--listen", "127.0.0.1:0", "--num-pages", "64", "--page-size", "4", "--num-embed-slots", "8",
         "--cluster-secret-file", str(secret_file),
         "--tls-cert", str(certificates.cert_path), "--tls-key", str(certificates.key_path)],
        directory / "executor.log",
    )  # fmt: skip
    try:
        address = process.wait_listening(300)  # the model loads first: minutes on a busy 2-core box
        yield SecuredExecutor(address, secret_file, secret, certificates.ca_path)
    finally:
        process.stop()
        print("executor log:\n" + process.output())


def greedy() -> common_pb2.SamplerSpec:
    return common_pb2.SamplerSpec(kind=common_pb2.SAMPLER_KIND_GREEDY)


def test_info_health_and_batches(executor: SecuredExecutor) -> None:
    secret = bearer_metadata(executor.secret)
    with executor.channel() as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="l4m.v1.ExecutorService"), timeout=DEADLINE_S
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = executor_pb2_grpc.ExecutorServiceStub(channel)
        info = stub.GetInfo(executor_pb2.ExecutorServiceGetInfoRequest(), timeout=DEADLINE_S, metadata=secret)
        assert info.model.vocab_size == 49152 and info.kv_page_size == 4 and info.num_kv_pages == 64
        assert info.model.special_token_ids["<|im_start|>"] == 1 and "text" in info.model.capabilities

        prompt = [1, 4093, 198, 6004, 2, 198, 1, 520, 9531, 198]  # 10 tokens -> 3 pages of 4
        requests = [
            executor_pb2.ExecuteRequest(
                correlation_id=1,
                allocate=executor_pb2.BatchAllocate(
                    items=[common_pb2.AllocateItem(kind=common_pb2.RESOURCE_KIND_KV_PAGE, ids=[0, 1, 2])]
                ),
            ),
            executor_pb2.ExecuteRequest(  # malformed: page 9 was never allocated
                correlation_id=2,
                forward_text=executor_pb2.BatchForwardText(
                    items=[
                        common_pb2.ForwardTextItem(
                            kv_page_ids=[0, 9],
                            kv_last_page_length=1,
                            token_ids=[5],
                            position_ids=[4],
                            output_indices=[0],
                            samplers=[greedy()],
                        )
                    ]
                ),
            ),
            executor_pb2.ExecuteRequest(
                correlation_id=3,
                trace_context=common_pb2.TraceContext(
                    traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
                ),
                forward_text=executor_pb2.BatchForwardText(
                    items=[
                        common_pb2.ForwardTextItem(
                            kv_page_ids=[0, 1, 2],
                            kv_last_page_length=2,
                            token_ids=prompt,
                            position_ids=list(range(10)),
                            output_indices=[9],
                            samplers=[greedy()],
                        )
                    ]
                ),
            ),
            executor_pb2.ExecuteRequest(correlation_id=4),  # no batch at all
            executor_pb2.ExecuteRequest(
                correlation_id=5,
                embed_image=executor_pb2.BatchEmbedImage(items=[common_pb2.EmbedImageItem()]),
            ),
            executor_pb2.ExecuteRequest(
                correlation_id=6, debug_query=executor_pb2.BatchDebugQuery(queries=["ping", "stats"])
            ),
        ]
        replies = list(stub.Execute(iter(requests), timeout=DEADLINE_S, metadata=secret))
    by_id = {r.correlation_id: r for r in replies}
    assert sorted(by_id) == [2, 3, 4, 5, 6], "allocate is fire-and-forget; every other batch answers"
    assert "kv page 9" in by_id[2].error.reason and not by_id[2].error.is_unsupported
    token = by_id[3].forward_text.items[0].outputs[0].token
    assert 0 <= token.token_id < 49152 and token.logprob <= 0
    assert "no batch" in by_id[4].error.reason
    assert by_id[5].error.is_unsupported
    assert (
        by_id[6].debug_query.responses[0] == "pong" and '"num_batches"' in by_id[6].debug_query.responses[1]
    )


@pytest.mark.parametrize("metadata", [(), bearer_metadata("not-the-cluster-secret-at-all")], ids=["none", "wrong"])
def test_calls_without_the_cluster_secret_are_refused(executor: SecuredExecutor,
                                                      metadata: tuple[tuple[str, str], ...]) -> None:
    allocate = executor_pb2.ExecuteRequest(correlation_id=1, allocate=executor_pb2.BatchAllocate(
        items=[common_pb2.AllocateItem(kind=common_pb2.RESOURCE_KIND_KV_PAGE, ids=[40])]))
    with executor.channel() as channel:
        stub = executor_pb2_grpc.ExecutorServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.GetInfo(executor_pb2.ExecutorServiceGetInfoRequest(), timeout=DEADLINE_S, metadata=metadata)
        with pytest.raises(grpc.RpcError) as execute:
            list(stub.Execute(iter([allocate]), timeout=DEADLINE_S, metadata=metadata))
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=DEADLINE_S)
    assert info.value.code() == execute.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    assert "cluster secret" in info.value.details()  # type: ignore[attr-defined]
    assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes stay open


def test_a_plaintext_client_cannot_reach_the_tls_executor(executor: SecuredExecutor) -> None:
    with grpc.insecure_channel(executor.address) as channel, pytest.raises(grpc.RpcError) as error:
        executor_pb2_grpc.ExecutorServiceStub(channel).GetInfo(
            executor_pb2.ExecutorServiceGetInfoRequest(), timeout=5, metadata=bearer_metadata(executor.secret))
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]


def _scheduler_info(executor: SecuredExecutor, *extra: str, wait_s: float) -> l4m_pb2.GetInfoResponse | None:
    """Starts a scheduler in front of the executor; its GetInfo once an executor connected, None when
    none did within `wait_s`."""
    scheduler = ServiceProcess("l4m.scheduler", ["--listen", "127.0.0.1:0", "--executor", executor.address,
                                                 "--allow-anonymous", *extra])
    try:
        address = scheduler.wait_listening(120)
        deadline = time.monotonic() + wait_s
        with grpc.insecure_channel(address) as channel:
            while time.monotonic() < deadline:
                try:
                    return l4m_pb2_grpc.L4MServiceStub(channel).GetInfo(l4m_pb2.GetInfoRequest(omit_tokenizer_json=True),
                                                                         timeout=DEADLINE_S)
                except grpc.RpcError:
                    time.sleep(0.2)
        return None
    finally:
        scheduler.stop()


def test_the_scheduler_reaches_the_executor_with_the_secret_over_tls(executor: SecuredExecutor) -> None:
    info = _scheduler_info(executor, "--cluster-secret-file", str(executor.secret_file), "--executor-tls-ca",
                           str(executor.ca_path), wait_s=30)
    assert info is not None and info.num_executors == 1 and info.model.vocab_size == 49152
    assert _scheduler_info(executor, "--executor-tls-ca", str(executor.ca_path), wait_s=3) is None  # no secret
