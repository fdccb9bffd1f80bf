"""What the gateway's ASGI middlewares (metrics.py, tracing.py) share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Asgi = Callable[..., Any]


class NotingStatus:
    """An ASGI `send` that passes every message on and remembers the response's status code: 500 until
    the app starts a response (what the server answers when the app raises before it does)."""

    def __init__(self, send: Asgi) -> None:
        self._send = send
        self.status = 500

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        await self._send(message)
