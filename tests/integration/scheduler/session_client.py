"""A minimal async L4M session client for the scheduler integration tests."""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from l4m.scheduler import requests as rq
from l4m.v1 import l4m_pb2, l4m_pb2_grpc


class Session:
    """One pipelined session: `write` commands, `wait` for replies by request id."""

    def __init__(self, channel: grpc.aio.Channel, token: str | None = None) -> None:
        metadata = (("l4m-instance-token", token),) if token else ()
        self.call = l4m_pb2_grpc.L4MServiceStub(channel).Session(metadata=metadata)
        self.events: list[l4m_pb2.SessionResponse] = []
        self.status: grpc.StatusCode | None = None
        self.details = ""
        self._waiters: dict[int, asyncio.Future[l4m_pb2.SessionResponse]] = {}
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for event in self.call:
                self.events.append(event)
                waiter = self._waiters.pop(event.request_id, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(event)
            self.status = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as error:
            self.status, self.details = error.code(), error.details() or ""
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(ConnectionError(f"session ended: {self.status} {self.details}"))

    async def write(self, request: l4m_pb2.SessionRequest) -> bool:
        try:
            await self.call.write(request)
            return True
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            return False

    def expect(self, request_id: int) -> asyncio.Future[l4m_pb2.SessionResponse]:
        future = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = future
        return future

    async def ask(self, request: l4m_pb2.SessionRequest) -> l4m_pb2.SessionResponse:
        future = self.expect(request.request_id)
        await self.write(request)
        return await future

    async def close(self) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await self.call.done_writing()
        await self._reader

    @property
    def trap(self) -> l4m_pb2.Trap | None:
        traps = [e.trap for e in self.events if e.WhichOneof("event") == "trap"]
        return traps[0] if traps else None


async def greedy_decode(session: Session, prompt: list[int], num_steps: int, page_size: int,
                        first_request_id: int = 1000) -> list[int]:
    """Allocate pages as needed, feed the prompt, then decode greedily; returns generated tokens."""
    request_id = first_request_id
    num_pages = 0
    tokens, generated = list(prompt), []
    fed = 0
    for _ in range(num_steps):
        new = tokens[fed:]
        total = len(tokens)
        needed = -(-total // page_size)
        if needed > num_pages:
            await session.write(rq.allocate(list(range(num_pages, needed)), request_id=request_id))
            request_id += 1
            num_pages = needed
        last = total - page_size * (num_pages - 1)
        reply = await session.ask(
            rq.forward_text(list(range(num_pages)), last, new, list(range(fed, total)), outputs=[len(new) - 1],
                            request_id=request_id)
        )
        request_id += 1
        if reply.WhichOneof("event") != "forward_text":
            raise AssertionError(f"expected a forward_text reply, got {reply}")
        token = reply.forward_text.outputs[0].token.token_id
        generated.append(token)
        fed = total
        tokens.append(token)
    return generated
