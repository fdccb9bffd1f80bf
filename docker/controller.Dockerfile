# The image every docker-sandboxed controller runs in: Python, the l4m SDK and what it imports.
# Built by l4m.spawner.docker_image.ensure_controller_image (the context is only this file and
# clients/python/l4m). PACKAGES comes in as a build arg: "name==version ..." pinned to the spawner's
# own installation, so the generated stubs, the SDK and the runtime agree. Needs PyPI during the
# build (network_mode=host). The SDK is copied last so an SDK change reuses the package layer.
FROM python:3.11-slim

ARG PACKAGES
RUN test -n "$PACKAGES" && pip install --no-cache-dir --disable-pip-version-check $PACKAGES

COPY clients/python/l4m /opt/l4m/python/l4m
# The container's root is read-only: compile now so imports need not write bytecode.
RUN python -m compileall -q /opt/l4m/python

ENV PYTHONPATH=/opt/l4m/python \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    L4M_SOCKET_DIR=/run/l4m
USER 65534:65534
WORKDIR /tmp
CMD ["python3", "-m", "l4m.controller"]
