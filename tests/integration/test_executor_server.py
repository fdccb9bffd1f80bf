"""The executor as a real subprocess on loopback: GetInfo, health, a few batches incl. malformed ones."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from l4m.v1 import common_pb2, executor_pb2, executor_pb2_grpc

DEADLINE_S = 60


@pytest.fixture(scope="module")
def executor_address():
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "l4m.executor",
            "--listen",
            "127.0.0.1:0",
            "--num-pages",
            "64",
            "--page-size",
            "4",
            "--num-embed-slots",
            "8",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    start = time.monotonic()
    address = None
    while time.monotonic() - start < 120:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "listening on" in line:
            address = line.rsplit(" ", 1)[1].strip()
            break
    if address is None:
        proc.kill()
        pytest.fail("executor did not start:\n" + "".join(lines))
    yield address
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    print("executor log:\n" + "".join(lines) + out)


def greedy() -> common_pb2.SamplerSpec:
    return common_pb2.SamplerSpec(kind=common_pb2.SAMPLER_KIND_GREEDY)


def test_info_health_and_batches(executor_address) -> None:
    with grpc.insecure_channel(executor_address) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="l4m.v1.ExecutorService"), timeout=DEADLINE_S
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = executor_pb2_grpc.ExecutorServiceStub(channel)
        info = stub.GetInfo(executor_pb2.ExecutorServiceGetInfoRequest(), timeout=DEADLINE_S)
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
        replies = list(stub.Execute(iter(requests), timeout=DEADLINE_S))
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
