"""Where the gateway's handlers get a model: an L4M session per request, as an instance of the caller's user.

`ClusterBackend` registers each request as an instance with the scheduler's registry (the cluster
secret; the user, role and per-minute quota of the caller's API key, so the scheduler's quotas and
accounting see the request as that user's), opens a session with its token on the model the request
names, and destroys the instance when the request ends, which frees whatever it held (a client that
went away mid-stream included). GetInfo answers are cached briefly and each model's tokenizer is built
once. Unit tests use `FakeBackend` (over `l4m.fake.FakeL4M`), behind the same `Backend` interface.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Protocol

import grpc

from l4m.common.registry import RegistryClient, RegistryRefused, RegistryUnreachable
from l4m.common.users import User
from l4m.gateway import tracing
from l4m.gateway.config import GatewayConfig
from l4m.gateway.prefix_cache import PrefixCache, PrefixScope
from l4m.model import TOKENIZERS, Model, TokenizerCache
from l4m.session import Session
from l4m.tokenizer import Tokenizer
from l4m.v1 import l4m_pb2
from l4m.wire.tracecontext import traceparent_of

INFO_TTL_S = 5.0
MAINTENANCE_USER = "l4m-gateway"  # the user of the admin instances that evict cached prefixes

log = logging.getLogger("l4m.gateway")


class GatewayError(Exception):
    """A request the gateway answers with an OpenAI-shaped error: HTTP `status`, OpenAI `kind` and `code`."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param


def unknown_model(name: str, served: list[str]) -> GatewayError:
    return GatewayError(404, f"The model {name!r} does not exist; served: {', '.join(served)}",
                        code="model_not_found", param="model")


class Backend(Protocol):
    prefix_cache: PrefixCache  # the gateway's one cache (off with 0 pages); its metrics read `stats()`

    async def model_names(self) -> list[str]:
        """The served models, the default first."""

    def open(self, user: User, model: str) -> contextlib.AbstractAsyncContextManager[Model]:
        """A `Model` on a session of its own for one request of `user`; closed (and freed) on exit."""

    async def close(self) -> None: ...

    def prefixes(self, user: User, model: str) -> PrefixScope | None:
        """The request's part in the prefix cache, or None when the cache is off."""


class _ModelCache:
    """GetInfo per model (refreshed after INFO_TTL_S), with the model's tokenizer: fetched and built once per
    tokenizer (`l4m.model.TOKENIZERS`, by `ModelInfo.tokenizer_sha256`), so a model that is served anew
    with another tokenizer gets it at the next refresh."""

    def __init__(self, info_session: Session) -> None:
        self._session = info_session
        self._names: tuple[float, list[str]] | None = None
        self._infos: dict[str, tuple[float, l4m_pb2.GetInfoResponse, Tokenizer]] = {}

    async def names(self) -> list[str]:
        if self._names is None or time.monotonic() - self._names[0] > INFO_TTL_S:
            info = await self._session.get_info(omit_tokenizer_json=True)
            self._names = (time.monotonic(), list(info.model_names) or [info.model.name])
        return self._names[1]

    async def info(self, name: str) -> tuple[l4m_pb2.GetInfoResponse, Tokenizer]:
        cached = self._infos.get(name)
        if cached is None or time.monotonic() - cached[0] > INFO_TTL_S:
            info = await self._session.get_info(omit_tokenizer_json=True, model=name)
            key = TokenizerCache.key(info.model)
            if cached is not None and key is not None and TokenizerCache.key(cached[1].model) == key:
                tokenizer = cached[2]  # the same tokenizer as before (kept here past the process cache's bound)
            else:
                tokenizer = TOKENIZERS.get(info.model) or TOKENIZERS.build((await self._session.get_info(model=name)).model)
            cached = self._infos[name] = (time.monotonic(), info, tokenizer)
        return cached[1], cached[2]


class ClusterBackend:
    def __init__(self, config: GatewayConfig, info_session: Session) -> None:
        if not config.registry_address:
            raise ValueError("the gateway needs the scheduler's registry (--registry) to run requests as instances")
        self._config = config
        self._cache = _ModelCache(info_session)
        self._info_session = info_session
        self._registry = RegistryClient(config.registry_address, config.cluster_secret, config.registry_tls_ca)
        self.prefix_cache = PrefixCache(config.prefix_cache_pages, self._unexport)
        self._maintenance: dict[str, tuple[str, Session]] = {}  # model -> its admin instance and session

    @classmethod
    async def connect(cls, config: GatewayConfig) -> ClusterBackend:
        return cls(config, await Session.connect(config.scheduler_address))

    async def model_names(self) -> list[str]:
        try:
            return await self._cache.names()
        except Exception as error:  # the scheduler is down or has no executor yet
            raise GatewayError(503, f"the cluster cannot answer: {error}", "server_error", "unavailable") from error

    @contextlib.asynccontextmanager
    async def open(self, user: User, model: str) -> AsyncIterator[Model]:
        names = await self.model_names()
        if model not in names:
            raise unknown_model(model, names)
        info, tokenizer = await self._cache.info(model)
        instance_id, token = f"gateway-{uuid.uuid4().hex[:16]}", secrets.token_urlsafe(24)
        await self._register(instance_id, token, user)
        tracing.note_instance(instance_id)
        try:
            # The request's span is the session's parent: the scheduler's command spans join its trace.
            session = await Session.connect(self._config.scheduler_address, token, traceparent_of()[0] or None,
                                            model=model)
            try:
                yield Model(session, info, tokenizer)
            finally:
                await session.close()
        finally:
            await self._destroy(instance_id, "the request ended")

    def prefixes(self, user: User, model: str) -> PrefixScope | None:
        return PrefixScope(self.prefix_cache, model, user.name) if self.prefix_cache.enabled else None

    async def _unexport(self, model: str, name: str) -> None:
        """The prefix cache's evictions, which may be any user's exports: through one admin instance per
        model (only an export's user or an admin may unexport it), registered on first use and again
        after a failure. A failed unexport is logged, not retried."""
        try:
            if model not in self._maintenance:
                instance_id, token = f"gateway-maintenance-{uuid.uuid4().hex[:16]}", secrets.token_urlsafe(24)
                await self._register(instance_id, token, User(MAINTENANCE_USER, is_admin=True))
                try:
                    session = await Session.connect(self._config.scheduler_address, token, model=model)
                except BaseException:
                    await self._destroy(instance_id, "the gateway's maintenance session did not open")
                    raise
                self._maintenance[model] = (instance_id, session)
            session = self._maintenance[model][1]
            # missing_ok: the scheduler may have evicted it under memory pressure already.
            session.send("unexport_kv_pages", l4m_pb2.UnexportKvPagesCommand(name=name, missing_ok=True))
            await session.synchronize()
        except Exception as error:
            log.warning("prefix cache: could not unexport %s of %s: %s", name, model, error)
            await self._close_maintenance(model)

    async def _close_maintenance(self, model: str) -> None:
        instance_id, session = self._maintenance.pop(model, (None, None))
        if session is not None:
            with contextlib.suppress(Exception):
                await session.close()
            await self._destroy(instance_id, "the gateway closed its maintenance session")

    async def _destroy(self, instance_id: str, reason: str) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self._registry.destroy(instance_id, reason)

    async def _register(self, instance_id: str, token: str, user: User) -> None:
        try:
            await self._registry.register(instance_id, token, 0, int(time.time() * 1000), user=user.name,
                                          is_admin=user.is_admin,
                                          user_max_tokens_per_minute=user.max_tokens_per_minute)
        except RegistryRefused as error:
            if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise GatewayError(429, f"the cluster is at its limit of requests: {error.details}",
                                   "rate_limit_error", "too_many_requests") from error
            raise GatewayError(503, f"the scheduler did not take the request ({error.code.name}): {error.details}",
                               "server_error", "unavailable") from error
        except RegistryUnreachable as error:
            raise GatewayError(503, f"the scheduler did not take the request: {error}", "server_error",
                               "unavailable") from error

    async def close(self) -> None:
        for model in list(self._maintenance):
            await self._close_maintenance(model)
        await self._info_session.close()
        await self._registry.close()


class FakeBackend:
    """Unit tests: every request on `l4m.fake.FakeL4M` (one in-process "model"), no socket."""

    def __init__(self, fake: object, name: str = "fake-tiny", prefix_cache_pages: int = 0) -> None:
        self._fake = fake
        self.name = name
        self.num_open = 0  # requests whose session is open now
        self.prefix_cache = PrefixCache(prefix_cache_pages, self._unexport)

    def prefixes(self, user: User, model: str) -> PrefixScope | None:
        return PrefixScope(self.prefix_cache, model, user.name) if self.prefix_cache.enabled else None

    async def _unexport(self, model: str, name: str) -> None:
        async with self.open(User(MAINTENANCE_USER, is_admin=True), model) as opened:
            opened.unexport(name, missing_ok=True)
            await opened.session.synchronize()

    async def model_names(self) -> list[str]:
        return [self.name]

    @contextlib.asynccontextmanager
    async def open(self, user: User, model: str) -> AsyncIterator[Model]:
        if model != self.name:
            raise unknown_model(model, [self.name])
        fake = self._fake
        session = Session(fake.stub(), blocking_get_info=fake.get_info_blocking)  # type: ignore[attr-defined]
        self.num_open += 1
        try:
            yield Model(session, fake.info())  # type: ignore[attr-defined]
        finally:
            self.num_open -= 1
            await session.close()

    async def close(self) -> None:
        return None
