"""The unit-test guard really refuses network access."""

from __future__ import annotations

import socket

import grpc
import grpc.aio
import pytest

from tests.unit.conftest import SocketOpenedInUnitTest


@pytest.mark.parametrize(
    "open_it",
    [
        lambda: socket.socket().bind(("127.0.0.1", 0)),
        lambda: socket.create_connection(("127.0.0.1", 1)),
        lambda: grpc.insecure_channel("127.0.0.1:1"),
        lambda: grpc.aio.insecure_channel("127.0.0.1:1"),
        lambda: grpc.aio.server(),
    ],
)
def test_network_entry_points_are_refused(open_it) -> None:
    with pytest.raises(SocketOpenedInUnitTest):
        open_it()
