"""The scheduler's InstanceRegistryService as the spawner's core sees it (`InstanceRegistry`), on
`l4m.common.registry`'s client.

Every call has a deadline and a failure becomes a typed error of the core: UNAVAILABLE or a missed
deadline is `SchedulerUnavailable` (Launch answers UNAVAILABLE, nothing started), any other refusal is
`RegistrationRefused`. `forward_traps` watches the scheduler's own traps for the life of the spawner,
reconnecting with capped exponential backoff and logging only the first failure of a run of failures
(then every 2^n-th) and the recovery, so a scheduler that is down for hours does not flood the log.

The registry is the scheduler's control plane: every call carries the cluster secret as
`authorization: Bearer` metadata, over TLS when a CA is given (a TCP registry address).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc

from l4m.common.registry import REGISTRY_DEADLINE_S, RegistryClient, RegistryRefused, RegistryUnreachable
from l4m.spawner.instances import InstanceManager, RegistrationRefused, SchedulerUnavailable
from l4m.v1 import registry_pb2

log = logging.getLogger(__name__)


class GrpcInstanceRegistry(RegistryClient):
    def __init__(
        self,
        address: str,
        secret: str = "",
        tls_ca: Path | None = None,
        deadline_s: float = REGISTRY_DEADLINE_S,
        initial_backoff_s: float = 0.1,
        max_backoff_s: float = 5.0,
    ) -> None:
        super().__init__(address, secret, tls_ca, deadline_s)
        self._initial_backoff_s = initial_backoff_s
        self._max_backoff_s = max_backoff_s
        self._trap_tasks: set[asyncio.Task[None]] = set()

    async def register(
        self, instance_id: str, token: str, max_tokens: int, launched_at_unix_ms: int, *, user: str = "",
        is_admin: bool = False, parent_instance_id: str = "", user_max_tokens_per_minute: int = 0,
    ) -> None:
        try:
            await super().register(instance_id, token, max_tokens, launched_at_unix_ms, user=user, is_admin=is_admin,
                                   parent_instance_id=parent_instance_id,
                                   user_max_tokens_per_minute=user_max_tokens_per_minute)
        except RegistryUnreachable as exc:
            raise SchedulerUnavailable(f"{exc}, so the instance was not started") from exc
        except RegistryRefused as exc:
            raise RegistrationRefused(
                f"the scheduler refused to register the instance ({exc.code.name}): {exc.details}"
            ) from exc

    async def forward_traps(self, manager: InstanceManager) -> None:
        """Stops the instances the scheduler traps; runs until cancelled."""
        backoff_s = self._initial_backoff_s
        num_failures = 0
        while True:
            try:
                stream = self._stub.WatchInstanceEvents(registry_pb2.WatchInstanceEventsRequest(),
                                                        metadata=self._metadata)
                async for event in stream:
                    if num_failures:
                        log.info("watching scheduler traps again at %s", self.address)
                        num_failures, backoff_s = 0, self._initial_backoff_s
                    task = asyncio.create_task(manager.trap(event.instance_id, event.trap.reason))
                    self._trap_tasks.add(task)
                    task.add_done_callback(self._trap_tasks.discard)
                failure = "the stream ended"
            except grpc.aio.AioRpcError as exc:
                failure = f"{exc.code().name}: {exc.details()}"
            num_failures += 1
            if num_failures & (num_failures - 1) == 0:  # 1st, 2nd, 4th, 8th ... failure in a row
                log.warning(
                    "lost the scheduler's trap stream at %s (%s); retrying in %.1f s (failure %d)",
                    self.address, failure, backoff_s, num_failures,
                )  # fmt: skip
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, self._max_backoff_s)
