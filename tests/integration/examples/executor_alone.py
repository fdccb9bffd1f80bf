"""Greedy decoding straight on an executor (no scheduler, no SDK): the reference for the examples."""

from __future__ import annotations

import queue
from collections.abc import Iterator, Sequence

import grpc

from l4m.v1 import common_pb2, executor_pb2, executor_pb2_grpc


def executor_greedy(address: str, prompt: Sequence[int], max_tokens: int, stop_token_ids: Sequence[int]) -> list[int]:
    """Feed the prompt in one forward pass, then one token per pass, greedy, on fresh pages."""
    with grpc.insecure_channel(address) as channel:
        stub = executor_pb2_grpc.ExecutorServiceStub(channel)
        info = stub.GetInfo(executor_pb2.ExecutorServiceGetInfoRequest(), timeout=60)
        page_size = info.kv_page_size
        num_pages = -(-(len(prompt) + max_tokens) // page_size)
        requests: queue.Queue[executor_pb2.ExecuteRequest | None] = queue.Queue()

        def request_iterator() -> Iterator[executor_pb2.ExecuteRequest]:
            while (request := requests.get()) is not None:
                yield request

        responses = stub.Execute(request_iterator(), timeout=600)
        page_ids = list(range(num_pages))
        requests.put(executor_pb2.ExecuteRequest(correlation_id=1, allocate=executor_pb2.BatchAllocate(
            items=[common_pb2.AllocateItem(kind=common_pb2.RESOURCE_KIND_KV_PAGE, ids=page_ids)])))
        tokens, new_tokens, out = list(prompt), list(prompt), []
        for step in range(max_tokens):
            length = len(tokens)
            item = common_pb2.ForwardTextItem(
                kv_page_ids=page_ids[: -(-length // page_size)],
                kv_last_page_length=length - page_size * (-(-length // page_size) - 1),
                token_ids=new_tokens, position_ids=list(range(length - len(new_tokens), length)),
                output_indices=[len(new_tokens) - 1],
                samplers=[common_pb2.SamplerSpec(kind=common_pb2.SAMPLER_KIND_GREEDY)])
            requests.put(executor_pb2.ExecuteRequest(correlation_id=2 + step,
                                                     forward_text=executor_pb2.BatchForwardText(items=[item])))
            response = next(responses)
            assert response.WhichOneof("result") == "forward_text", response
            token = response.forward_text.items[0].outputs[0].token.token_id
            out.append(token)
            if token in stop_token_ids:
                break
            tokens.append(token)
            new_tokens = [token]
        requests.put(None)
        responses.cancel()
        return out
