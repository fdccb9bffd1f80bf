"""The services' front door: one way to build a grpc.aio server and one way to serve until a signal.

`build_server` adds the servicers, the standard health service (grpc.health.v1) and server reflection,
and binds the listeners (TLS on a TCP one when its files are given, `l4m.wire.credentials.add_listener`); it
does not start the server, so that a service can finish wiring (a socket's mode, a task) first.
`GrpcServer` is what it returns: the server, the ports it bound and its health servicer. A service
that keeps more (its core, a background task) wraps one in a dataclass of its own rather than setting
attributes on the grpc server.

`serve_until_signal` is the shape of every `python -m l4m.<service>`: handlers for SIGINT and SIGTERM
first, then start, wait for either signal, and stop with the service's own grace.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection as grpc_reflection

from l4m.wire.credentials import TlsFiles, add_listener, is_unix_address

# A generated `add_<Service>Servicer_to_server` function and the servicer it adds.
Service = tuple[Callable[[Any, grpc.aio.Server], None], object]
# An address ("host:port", port 0 picks one, or "unix:/path") and the TLS files for a TCP one.
Listener = tuple[str, TlsFiles | None]


@dataclass
class GrpcServer:
    """A built grpc.aio server: `ports[i]` is what `listeners[i]` bound (0 for a Unix socket);
    `health` is None when it serves no health service."""

    server: grpc.aio.Server
    ports: tuple[int, ...]
    health: health.aio.HealthServicer | None
    health_names: tuple[str, ...]  # the services whose status `set_health` sets, besides "" (the server)

    @property
    def port(self) -> int:
        """The port of the first listener."""
        return self.ports[0]

    async def start(self) -> None:
        await self.server.start()

    async def set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        """Sets `status` for the whole server ("") and for each of `health_names`."""
        if self.health is None:
            raise ValueError("this server was built without a health service")
        for name in ("", *self.health_names):
            await self.health.set(name, status)

    async def stop(self, grace_s: float | None) -> None:
        await self.server.stop(grace_s)


def build_server(
    services: Sequence[Service],
    listeners: Sequence[Listener],
    *,
    options: Sequence[tuple[str, Any]] = (),
    health_names: Sequence[str] | None = None,
    reflection: bool = True,
) -> GrpcServer:
    """A grpc.aio server with `services`, bound to `listeners` (raises OSError when one cannot be
    bound), not started. With `health_names` (the full names of the services it reports on) it serves
    grpc.health.v1 too (a check answers NOT_FOUND until `set_health`); `reflection` lists those names, the
    health service and reflection itself (a server without health lists reflection alone)."""
    server = grpc.aio.server(options=list(options))
    for add_servicer, servicer in services:
        add_servicer(servicer, server)
    health_servicer = None
    names = tuple(health_names or ())
    if health_names is not None:
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if reflection:
        listed = (*names, health.SERVICE_NAME) if health_servicer is not None else ()
        grpc_reflection.enable_server_reflection(tuple(dict.fromkeys((*listed, grpc_reflection.SERVICE_NAME))), server)
    ports = tuple(add_listener(server, address, tls) for address, tls in listeners)
    return GrpcServer(server, ports, health_servicer, names)


def bound_address(address: str, port: int) -> str:
    """`address` with the port actually bound (port 0 picks one); a Unix address as given."""
    return address if is_unix_address(address) else f"{address.rsplit(':', 1)[0]}:{port}"


async def serve_until_signal(start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[None]]) -> None:
    """Installs SIGINT and SIGTERM handlers, awaits `start()` (start serving, print the address),
    waits for either signal, then awaits `stop()` (also when the wait is cancelled). A signal during
    `start()` is kept: the service stops as soon as it has started."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopping.set)
    await start()
    try:
        await stopping.wait()
    finally:
        await stop()
