"""Status codes and the error of a failed call, for the framed transports, without importing grpc.

A controller that speaks only frames (its L4M session and its runtime calls) never opens a gRPC channel,
and grpc's import alone is ~2.8 MiB of an idle controller's memory (docs/benchmarks.md, "Controller
memory"). The codes are gRPC's, by number and name, so a status frame means what a gRPC status would, and
`StatusError` has the two methods code that handles `grpc.RpcError` calls (`code()`, `details()`).
"""

from __future__ import annotations

import enum
import sys


class StatusCode(enum.IntEnum):
    """gRPC's status codes (the numbers a status frame carries)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16

    @classmethod
    def of(cls, number: int) -> StatusCode:
        """The code numbered `number`; UNKNOWN for a number gRPC does not define."""
        try:
            return cls(number)
        except ValueError:
            return cls.UNKNOWN


class StatusError(Exception):
    """A framed call that ended with a status other than OK (as `grpc.aio.AioRpcError` on gRPC)."""

    def __init__(self, code: StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _EndOfStream(enum.Enum):
    EOF = "EOF"


# What a framed call's `read` returns once the peer ended the stream with OK (`grpc.aio.EOF` on gRPC).
EOF = _EndOfStream.EOF


def is_eof(value: object) -> bool:
    """Whether `value` is the end of a stream: this module's EOF or grpc.aio's (which exists only once grpc
    is imported)."""
    if value is EOF:
        return True
    aio = sys.modules.get("grpc.aio")
    return aio is not None and value is aio.EOF


def code_name(error: BaseException) -> str | None:
    """The status code's name of a failed call, ours or grpc's; None for any other exception (a grpc error
    exists only once grpc is imported, so nothing imports it here)."""
    if isinstance(error, StatusError):
        return error.code().name
    grpc = sys.modules.get("grpc")
    if grpc is not None and isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        return error.code().name
    return None
