"""The executor's Reset RPC (the scheduler calls it on every connect): it needs the cluster secret, frees
every page and slot, and retires the Execute streams opened before it."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from l4m.executor.commands import Allocate, ResourceKind
from l4m.executor.server import ExecutorServicer
from l4m.v1 import common_pb2, executor_pb2
from l4m.wire.credentials import bearer_metadata

# Made at import: a loop opens a socketpair, which the unit-test socket guard forbids inside a test.
_LOOP = asyncio.new_event_loop()
SECRET = "a-cluster-secret-of-enough-length"


class Aborted(Exception):
    pass


class FakeContext:
    """The two things the servicer reads from a grpc.aio context."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata
        self.code: grpc.StatusCode | None = None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        raise Aborted(details)


def _reset(servicer: ExecutorServicer, metadata: tuple[tuple[str, str], ...]) -> executor_pb2.ExecutorServiceResetResponse:
    return _LOOP.run_until_complete(servicer.Reset(executor_pb2.ExecutorServiceResetRequest(), FakeContext(metadata)))


def _allocate(page_id: int) -> executor_pb2.ExecuteRequest:
    request = executor_pb2.ExecuteRequest(correlation_id=page_id)
    request.allocate.items.add(kind=common_pb2.RESOURCE_KIND_KV_PAGE, ids=[page_id])
    return request


def test_reset_needs_the_secret_then_frees_everything_and_retires_older_streams(make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(num_pages=8, num_embed_slots=4)
    servicer = ExecutorServicer(engine, cluster_secret=SECRET)
    engine.allocate([Allocate(ResourceKind.KV_PAGE, (1, 2, 3)), Allocate(ResourceKind.EMBED_SLOT, (0,))])
    for metadata in ((), bearer_metadata("not-the-secret-but-long-enough")):
        with pytest.raises(Aborted, match="cluster secret"):
            _reset(servicer, metadata)
    assert engine.cache.num_free_pages == 5  # refused: nothing freed
    stream_before = 0  # the generation an Execute stream opened now runs in
    reply = _reset(servicer, bearer_metadata(SECRET))
    assert (reply.num_kv_pages_freed, reply.num_embed_slots_freed) == (3, 1)
    assert engine.cache.num_free_pages == 8 and engine.cache.num_free_slots == 4
    # A batch of a stream opened before the reset does not run; one of a newer stream does.
    assert servicer._run_batch(_allocate(5), stream_before) is None
    assert not engine.cache.is_page_allocated[5]
    assert servicer._run_batch(_allocate(5), stream_before + 1) is None  # fire-and-forget: ran, no reply
    assert engine.cache.is_page_allocated[5]
    servicer.close()
