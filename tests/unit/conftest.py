"""Unit tests run with no network: opening a socket, a gRPC channel or a gRPC server fails, so a unit
test cannot reach a service by accident. Tests that need real services live in tests/integration."""

from __future__ import annotations

import socket

import grpc
import grpc.aio
import pytest


class SocketOpenedInUnitTest(RuntimeError):
    """A unit test tried to open a socket or a gRPC connection; it belongs in tests/integration."""


def _refuse(*args: object, **kwargs: object) -> None:
    raise SocketOpenedInUnitTest("unit tests may not open sockets; move this test to tests/integration")


@pytest.fixture(autouse=True)
def _no_sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    # Connecting, binding and listening are refused; socketpair() (asyncio's self-pipe) stays usable.
    for name in ("connect", "connect_ex", "bind", "listen"):
        monkeypatch.setattr(socket.socket, name, _refuse)
    # gRPC's core opens its own sockets, below Python's socket module: refuse its entry points too.
    for module, names in (
        (grpc, ("insecure_channel", "secure_channel", "server")),
        (grpc.aio, ("insecure_channel", "secure_channel", "server")),
    ):
        for name in names:
            monkeypatch.setattr(module, name, _refuse)
