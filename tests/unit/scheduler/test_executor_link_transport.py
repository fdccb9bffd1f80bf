"""Which executors the scheduler may reach on their framed Execute socket: only those on this host (a
GetInfo path names a file on the executor's host), and only when the link is not told to keep to gRPC."""

from __future__ import annotations

import pytest

from l4m.scheduler.links import EXECUTOR_TRANSPORTS, GrpcExecutorLink, is_on_this_host


@pytest.mark.parametrize(("address", "local"), [
    ("unix:/run/l4m/internal/executor-0.sock", True),
    ("unix:///run/l4m/internal/executor-0.sock", True),
    ("127.0.0.1:50061", True),
    ("127.20.0.3:50061", True),  # the whole loopback range
    ("localhost:50061", True),
    ("[::1]:50061", True),
    ("10.0.0.7:50061", False),
    ("executor-0.l4m.svc:50061", False),  # a name may resolve anywhere: not trusted to be this host
    ("[2001:db8::1]:50061", False),
])
def test_only_executors_on_this_host_may_be_reached_on_frames(address: str, local: bool) -> None:
    assert is_on_this_host(address) is local


def test_an_unknown_executor_transport_is_named() -> None:
    assert EXECUTOR_TRANSPORTS == ("auto", "grpc")
    with pytest.raises(ValueError, match="executor transport 'quic' is not one of auto, grpc"):
        GrpcExecutorLink("127.0.0.1:1", transport="quic")
