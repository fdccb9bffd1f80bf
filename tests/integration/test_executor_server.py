"""The executor as a real subprocess on loopback, as `l4m up` runs it (cluster secret, here with TLS too,
and the framed Execute socket): GetInfo, health, a few batches incl. malformed ones; callers without the
secret or without TLS are refused; the framed socket is the operator's (0600) and needs the secret too,
and answers batches as gRPC does; the scheduler reaches it with the secret and the CA, on frames where
the executor offers them."""

from __future__ import annotations

import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from l4m.v1 import common_pb2, executor_pb2, executor_pb2_grpc, l4m_pb2, l4m_pb2_grpc
from l4m.wire import frames
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
    framed_path: Path
    pid: int
    log: ServiceProcess

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
         "--tls-cert", str(certificates.cert_path), "--tls-key", str(certificates.key_path),
         "--listen-framed", str(directory / "executor.frames.sock")],
        directory / "executor.log",
    )  # fmt: skip
    try:
        address = process.wait_listening(300)  # the model loads first: minutes on a busy 2-core box
        yield SecuredExecutor(address, secret_file, secret, certificates.ca_path, directory / "executor.frames.sock",
                              process.process.pid, process)
    finally:
        process.stop()
        print("executor log:\n" + process.output())


def greedy() -> common_pb2.SamplerSpec:
    return common_pb2.SamplerSpec(kind=common_pb2.SAMPLER_KIND_GREEDY)


def resident_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_the_loaded_executor_holds_no_copy_it_does_not_use(executor: SecuredExecutor) -> None:
    """After loading, the executor keeps no float32 weights that no call reads (where the 4-bit blocks
    serve every batch) and hands the loader's freed heap back: SmolLM2's executor held ~1.2 GiB before
    either (docs/benchmarks.md, "no dense copy"), ~0.5 GiB with both; AVX2 keeps its dense weights."""
    log = executor.log.output()
    isa = next((name for name in ("amx", "avx512_bf16", "avx512") if f"CPU kernels use {name} " in log), "avx2")
    limit = {"amx": 800, "avx512_bf16": 800, "avx512": 800, "avx2": 1100}[isa]
    assert resident_mib(executor.pid) < limit, (isa, resident_mib(executor.pid))


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


def _framed_exchange(path: Path, data: bytes) -> list[tuple[int, bytes]]:
    """Sends `data` on the executor's framed socket, shuts the write half and reads every frame until the
    executor closes the connection."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(DEADLINE_S)
        sock.connect(str(path))
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        received = b""
        while chunk := sock.recv(1 << 16):
            received += chunk
    return frames.FrameDecoder(1 << 30).feed(received)


def _opening(secret: str, version: str = frames.PROTOCOL_VERSION) -> bytes:
    return frames.encode(frames.EXECUTE_OPEN, executor_pb2.FramedExecuteOpen(protocol_version=version,
                                                                              cluster_secret=secret))


def _status(frame: tuple[int, bytes]) -> tuple[grpc.StatusCode, str]:
    assert frame[0] == frames.STATUS, frame
    status = l4m_pb2.FramedSessionStatus.FromString(frame[1])
    return frames.STATUS_CODES[status.code], status.message


def _prompt_batches(pages: list[int], first_id: int) -> list[executor_pb2.ExecuteRequest]:
    """Allocate `pages`, one forward pass over a 10-token prompt with a greedy output, free the pages."""
    prompt = [1, 4093, 198, 6004, 2, 198, 1, 520, 9531, 198]
    kv_page = common_pb2.RESOURCE_KIND_KV_PAGE
    return [
        executor_pb2.ExecuteRequest(correlation_id=first_id, allocate=executor_pb2.BatchAllocate(
            items=[common_pb2.AllocateItem(kind=kv_page, ids=pages)])),
        executor_pb2.ExecuteRequest(correlation_id=first_id + 1, forward_text=executor_pb2.BatchForwardText(items=[
            common_pb2.ForwardTextItem(kv_page_ids=pages, kv_last_page_length=2, token_ids=prompt,
                                       position_ids=list(range(10)), output_indices=[9], samplers=[greedy()])])),
        executor_pb2.ExecuteRequest(correlation_id=first_id + 2, deallocate=executor_pb2.BatchDeallocate(
            items=[common_pb2.DeallocateItem(kind=kv_page, ids=pages)])),
    ]


def test_the_framed_execute_socket_is_the_operators_and_needs_the_cluster_secret(executor: SecuredExecutor) -> None:
    # Who may use it: the operator's user (mode 0600), and only with the cluster secret in the first frame.
    assert stat.S_IMODE(executor.framed_path.stat().st_mode) == 0o600
    with executor.channel() as channel:
        info = executor_pb2_grpc.ExecutorServiceStub(channel).GetInfo(
            executor_pb2.ExecutorServiceGetInfoRequest(), timeout=DEADLINE_S, metadata=bearer_metadata(executor.secret))
    assert info.framed_execute_path == str(executor.framed_path)
    batches = b"".join(frames.encode(frames.EXECUTE, r) for r in _prompt_batches([44, 45, 46], 1))
    for opening in (_opening(""), _opening("not-the-cluster-secret-at-all")):
        (refusal,) = _framed_exchange(executor.framed_path, opening + batches)  # nothing ran: no reply
        code, message = _status(refusal)
        assert code == grpc.StatusCode.UNAUTHENTICATED and "cluster secret" in message
    (refusal,) = _framed_exchange(executor.framed_path, _opening(executor.secret, "l4m.v0") + batches)
    assert _status(refusal)[0] == grpc.StatusCode.FAILED_PRECONDITION
    (refusal,) = _framed_exchange(executor.framed_path, batches)  # a batch before any opening
    code, message = _status(refusal)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "FramedExecuteOpen" in message
    oversized = frames.HEADER.pack(info.max_request_bytes + 1, frames.EXECUTE)
    opened, refusal = _framed_exchange(executor.framed_path, _opening(executor.secret) + oversized)
    assert _status(opened)[0] == grpc.StatusCode.OK
    code, message = _status(refusal)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "larger than" in message


def test_framed_batches_are_answered_as_grpc_ones(executor: SecuredExecutor) -> None:
    received = _framed_exchange(executor.framed_path, _opening(executor.secret) + b"".join(
        frames.encode(frames.EXECUTE, r) for r in _prompt_batches([40, 41, 42], 11)))
    assert [kind for kind, _ in received] == [frames.STATUS, frames.EXECUTED]  # the forward pass answers
    assert _status(received[0])[0] == grpc.StatusCode.OK
    framed_reply = executor_pb2.ExecuteResponse.FromString(received[1][1])
    with executor.channel() as channel:
        (grpc_reply,) = executor_pb2_grpc.ExecutorServiceStub(channel).Execute(
            iter(_prompt_batches([40, 41, 42], 21)), timeout=DEADLINE_S, metadata=bearer_metadata(executor.secret))
    assert framed_reply.correlation_id == 12 and grpc_reply.correlation_id == 22
    framed_token = framed_reply.forward_text.items[0].outputs[0].token
    grpc_token = grpc_reply.forward_text.items[0].outputs[0].token
    assert framed_token.token_id == grpc_token.token_id and abs(framed_token.logprob - grpc_token.logprob) < 1e-5


@pytest.mark.parametrize(("extra", "transport"), [((), "framed"), (("--executor-transport", "grpc"), "grpc")])
def test_the_scheduler_sends_batches_on_frames_where_the_executor_offers_them(
        executor: SecuredExecutor, extra: tuple[str, ...], transport: str) -> None:
    scheduler = ServiceProcess("l4m.scheduler", ["--listen", "127.0.0.1:0", "--executor", executor.address,
                                                 "--allow-anonymous", "--cluster-secret-file", str(executor.secret_file),
                                                 "--executor-tls-ca", str(executor.ca_path), *extra])
    try:
        address = scheduler.wait_listening(120)
        deadline = time.monotonic() + 30
        while f"connected over {transport}" not in scheduler.output() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert f"connected over {transport}" in scheduler.output(), scheduler.output()
        with grpc.insecure_channel(address) as channel:  # a session's forward_text goes through the link
            stub = l4m_pb2_grpc.L4MServiceStub(channel)
            requests = [
                l4m_pb2.SessionRequest(request_id=1, allocate=common_pb2.AllocateItem(
                    kind=common_pb2.RESOURCE_KIND_KV_PAGE, ids=[0])),
                l4m_pb2.SessionRequest(request_id=2, forward_text=common_pb2.ForwardTextItem(
                    kv_page_ids=[0], kv_last_page_length=2, token_ids=[1, 4093], position_ids=[0, 1],
                    output_indices=[1], samplers=[greedy()])),
            ]
            responses = list(stub.Session(iter(requests), timeout=DEADLINE_S))
        (reply,) = [r for r in responses if r.request_id == 2]
        assert 0 <= reply.forward_text.outputs[0].token.token_id < 49152
    finally:
        scheduler.stop()
