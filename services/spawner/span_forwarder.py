"""Controllers' spans leave their sandbox through the spawner.

A sandbox has no network, so the controller's OTLP exporter points at the runtime socket
(`OTEL_EXPORTER_OTLP_ENDPOINT=unix:///run/l4m/runtime.sock`) and sends its instance token as an OTLP
header (`OTEL_EXPORTER_OTLP_HEADERS=l4m-instance-token=...`). `SpanForwarder` serves OTLP's
TraceService there: it authenticates the token like every runtime call, stamps the resource with the
instance id the spawner knows (a controller cannot pass its spans off as another's), and forwards the
request unchanged to the spawner's own OTLP endpoint. A shared controller process (spawner/shared.py) sends
its process token instead: its resource is stamped with the process's id (`l4m.shared_process`) and carries
no `l4m.instance_id`, since it speaks for several instances (each names its own on its `controller.run` span).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from urllib.parse import urlparse

import grpc
from google.protobuf.internal.containers import RepeatedCompositeFieldContainer
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2

from l4m.wire.metadata import TOKEN_METADATA_KEY

EXPORT_DEADLINE_S = 10.0
INSTANCE_ATTRIBUTE = "l4m.instance_id"
SHARED_PROCESS_ATTRIBUTE = "l4m.shared_process"


def otlp_grpc_target(endpoint: str) -> tuple[str, bool]:
    """(gRPC target, use TLS) for an OTLP endpoint as OTEL_EXPORTER_OTLP_ENDPOINT spells it."""
    parsed = urlparse(endpoint)
    if parsed.scheme == "unix":
        return endpoint, False
    if parsed.scheme in ("http", "https"):
        return parsed.netloc, parsed.scheme == "https"
    return endpoint, False  # host:port


class SpanForwarder(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(
        self,
        endpoint: str,
        instance_id_of_token: Callable[[str], str | None],
        headers: Sequence[tuple[str, str]] = (),
        process_id_of_token: Callable[[str], str | None] = lambda token: None,
    ) -> None:
        """`instance_id_of_token(token)` names the running instance holding `token`, or None;
        `process_id_of_token(token)` the shared controller process, or None."""
        self.endpoint = endpoint
        self._instance_id_of_token = instance_id_of_token
        self._process_id_of_token = process_id_of_token
        self._headers = tuple(headers)
        target, use_tls = otlp_grpc_target(endpoint)
        self._channel = (
            grpc.aio.secure_channel(target, grpc.ssl_channel_credentials())
            if use_tls
            else grpc.aio.insecure_channel(target)
        )
        self._stub = trace_service_pb2_grpc.TraceServiceStub(self._channel)

    async def Export(self, request, context):  # noqa: N802 - gRPC method name
        token = dict(context.invocation_metadata()).get(TOKEN_METADATA_KEY, "")
        instance_id = self._instance_id_of_token(token)
        process_id = self._process_id_of_token(token) if instance_id is None else None
        if instance_id is None and process_id is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"missing or unknown {TOKEN_METADATA_KEY}")
        for resource_spans in request.resource_spans:
            if instance_id is not None:
                stamp_instance_id(resource_spans.resource.attributes, instance_id)
            else:
                stamp_shared_process(resource_spans.resource.attributes, process_id)  # type: ignore[arg-type]
        try:
            return await self._stub.Export(request, metadata=self._headers, timeout=EXPORT_DEADLINE_S)
        except grpc.aio.AioRpcError as exc:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"the spawner could not forward spans to {self.endpoint}: {exc.code().name} {exc.details()}",
            )

    async def close(self) -> None:
        await self._channel.close()


def stamp_instance_id(
    attributes: RepeatedCompositeFieldContainer[common_pb2.KeyValue], instance_id: str
) -> None:
    """Sets `l4m.instance_id` among a resource's attributes, replacing any the controller sent (and any
    `l4m.shared_process`)."""
    _stamp(attributes, INSTANCE_ATTRIBUTE, instance_id)


def stamp_shared_process(
    attributes: RepeatedCompositeFieldContainer[common_pb2.KeyValue], process_id: str
) -> None:
    """Sets `l4m.shared_process` among a resource's attributes and drops any `l4m.instance_id` the process
    sent: its resource is the process's, not one instance's."""
    _stamp(attributes, SHARED_PROCESS_ATTRIBUTE, process_id)


def _stamp(attributes: RepeatedCompositeFieldContainer[common_pb2.KeyValue], key: str, value: str) -> None:
    for index in reversed(range(len(attributes))):
        if attributes[index].key in (INSTANCE_ATTRIBUTE, SHARED_PROCESS_ATTRIBUTE):
            del attributes[index]
    attributes.append(common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(string_value=value)))
