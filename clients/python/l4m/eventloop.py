"""The event loop l4m's processes run on: uvloop where it is installed, asyncio's own otherwise.

uvloop takes 10-30 % off the CPU of a gRPC message or a framed session's frame (`bench/transport.py`), which
is most of what the scheduler and a stepwise controller spend per token. `L4M_EVENT_LOOP` picks it:
`auto` (the default: uvloop when it imports), `uvloop` (required: an error when it is missing) or `asyncio`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

ENV = "L4M_EVENT_LOOP"
CHOICES = ("auto", "uvloop", "asyncio")
T = TypeVar("T")


def loop_name(environ: Mapping[str, str] = os.environ) -> str:
    """"uvloop" or "asyncio": what `run` will use under `environ`. A value of L4M_EVENT_LOOP outside
    CHOICES, or `uvloop` where it is not installed, is a ValueError that says so."""
    choice = environ.get(ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{ENV}={environ[ENV]!r} is not one of {', '.join(CHOICES)}")
    if choice == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if choice == "uvloop":
            raise ValueError(f"{ENV}=uvloop, but uvloop is not installed (pip install uvloop)") from None
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T], environ: Mapping[str, str] = os.environ) -> T:
    """`asyncio.run(main)` on the loop `loop_name` picks."""
    if loop_name(environ) == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
