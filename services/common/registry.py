"""The scheduler's InstanceRegistryService as its callers (the spawner, the gateway) use it: register an
instance before anything of it runs, destroy it when it ends.

Every call has a deadline and carries the cluster secret as `authorization: Bearer` metadata, over TLS
when a CA is given (a TCP registry address). A registration the scheduler could not be asked (UNAVAILABLE,
a missed deadline) is `RegistryUnreachable`; one it refused is `RegistryRefused`, with its status code,
so each caller can say it in its own terms (the spawner's Launch, the gateway's HTTP status).
"""

from __future__ import annotations

from pathlib import Path

import grpc

from l4m.v1 import registry_pb2, registry_pb2_grpc
from l4m.wire.credentials import bearer_metadata, open_channel

REGISTRY_DEADLINE_S = 10.0
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class RegistryUnreachable(Exception):
    """The registry could not be asked: nothing was registered."""


class RegistryRefused(Exception):
    """The registry answered and would not register the instance."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class RegistryClient:
    def __init__(self, address: str, secret: str = "", tls_ca: Path | None = None,
                 deadline_s: float = REGISTRY_DEADLINE_S) -> None:
        self.address = address
        self._deadline_s = deadline_s
        self._metadata = bearer_metadata(secret) if secret else ()
        self._channel = open_channel(address, tls_ca)
        self._stub = registry_pb2_grpc.InstanceRegistryServiceStub(self._channel)

    async def register(
        self, instance_id: str, token: str, max_tokens: int, launched_at_unix_ms: int, *, user: str = "",
        is_admin: bool = False, parent_instance_id: str = "", user_max_tokens_per_minute: int = 0,
    ) -> None:
        request = registry_pb2.RegisterInstanceRequest(
            instance_id=instance_id, token=token, max_tokens=max_tokens, launched_at_unix_ms=launched_at_unix_ms,
            user=user, is_admin=is_admin, parent_instance_id=parent_instance_id,
            user_max_tokens_per_minute=user_max_tokens_per_minute,
        )
        try:
            await self._stub.RegisterInstance(request, timeout=self._deadline_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _UNREACHABLE:
                raise RegistryUnreachable(f"the scheduler at {self.address} is unreachable: {exc.details()}") from exc
            raise RegistryRefused(exc.code(), exc.details() or "") from exc

    async def destroy(self, instance_id: str, reason: str) -> None:
        request = registry_pb2.DestroyInstanceRequest(instance_id=instance_id, reason=reason)
        await self._stub.DestroyInstance(request, timeout=self._deadline_s, metadata=self._metadata)

    async def close(self) -> None:
        await self._channel.close()
