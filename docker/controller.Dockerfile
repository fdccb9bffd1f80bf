# The image every docker-sandboxed controller runs in: Python, the l4m SDK and what it imports.
# Built by l4m.spawner.docker_image.ensure_controller_image (the context is only this file and
# clients/python/l4m); versions come in as build args, pinned to the spawner's own so the generated
# stubs and the runtime agree. Needs PyPI during the build (network_mode=host).
FROM python:3.11-slim

ARG GRPCIO_VERSION
ARG PROTOBUF_VERSION
ARG NUMPY_VERSION
ARG OTEL_API_VERSION

RUN pip install --no-cache-dir --disable-pip-version-check \
      "grpcio==${GRPCIO_VERSION}" \
      "grpcio-health-checking==${GRPCIO_VERSION}" \
      "protobuf==${PROTOBUF_VERSION}" \
      "numpy==${NUMPY_VERSION}" \
      "opentelemetry-api==${OTEL_API_VERSION}"

COPY clients/python/l4m /opt/l4m/python/l4m
# The container's root is read-only: compile now so imports need not write bytecode.
RUN python -m compileall -q /opt/l4m/python

ENV PYTHONPATH=/opt/l4m/python \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    L4M_SOCKET_DIR=/run/l4m
USER 65534:65534
WORKDIR /tmp
CMD ["python3"]
