"""Unit tests run with no network: opening any socket fails, so a unit test cannot reach a service."""

from __future__ import annotations

import socket

import pytest


class SocketOpenedInUnitTest(RuntimeError):
    """A unit test tried to open a socket; it belongs in tests/integration."""


@pytest.fixture(autouse=True)
def _no_sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise SocketOpenedInUnitTest("unit tests may not open sockets; move this test to tests/integration")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "socketpair", refuse)
