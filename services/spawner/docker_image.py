"""Builds the controller image for the docker sandbox, once per SDK version.

The tag carries a hash of everything that goes into the image (the Dockerfile, the SDK sources and
the pinned package versions), so a machine rebuilds only when one of them changed and otherwise
reuses the image it has. The build context is a tar made here holding just the Dockerfile and
`clients/python/l4m`, not the repository (whose .venv alone is gigabytes).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import tarfile
from pathlib import Path

import l4m

IMAGE_REPOSITORY = "l4m-controller"
# What `python -m l4m.controller` and the SDK import, installed at the spawner's own versions.
CONTROLLER_PACKAGES = (
    "grpcio",
    "grpcio-health-checking",
    "protobuf",
    "numpy",
    "tokenizers",
    "jinja2",
    "llguidance",
    "jsonschema",
    "opentelemetry-api",
    "opentelemetry-sdk",
    "opentelemetry-proto",
    "opentelemetry-exporter-otlp-proto-common",
    "opentelemetry-exporter-otlp-proto-grpc",
)


class ImageBuildError(RuntimeError):
    """The controller image could not be built (engine down, no PyPI, bad Dockerfile)."""


def repo_root() -> Path:
    # l4m is installed editable from clients/python/l4m.
    return Path(l4m.__file__).resolve().parents[3]


def build_args() -> dict[str, str]:
    pins = [f"{package}=={importlib.metadata.version(package)}" for package in CONTROLLER_PACKAGES]
    return {"PACKAGES": " ".join(pins)}


def _context_files(root: Path) -> list[tuple[str, Path]]:
    files = [("Dockerfile", root / "docker" / "controller.Dockerfile")]
    sdk = root / "clients" / "python" / "l4m"
    for path in sorted(sdk.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix in (".py", ".pyi"):
            files.append((str(path.relative_to(root)), path))
    return files


def controller_image_tag(root: Path | None = None) -> str:
    root = root or repo_root()
    digest = hashlib.sha256()
    for name, path in _context_files(root):
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(repr(sorted(build_args().items())).encode())
    return f"{IMAGE_REPOSITORY}:{digest.hexdigest()[:12]}"


def _context_tar(root: Path) -> io.BytesIO:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, path in _context_files(root):
            info = archive.gettarinfo(str(path), arcname=name)
            info.uid = info.gid = 0
            info.mode = 0o644
            with open(path, "rb") as file:
                archive.addfile(info, file)
    buffer.seek(0)
    return buffer


def ensure_controller_image(client: object, root: Path | None = None) -> str:
    """Returns the tag of an up-to-date controller image, building it if this engine lacks it.

    `client` is a `docker.DockerClient`. The base image `python:3.11-slim` must be present
    (`scripts/base-image.sh` in the shared scripts builds a stand-in when no registry is reachable).
    """
    import docker.errors

    root = root or repo_root()
    tag = controller_image_tag(root)
    try:
        client.images.get(tag)
        return tag
    except docker.errors.ImageNotFound:
        pass
    try:
        image, _ = client.images.build(
            fileobj=_context_tar(root),
            custom_context=True,
            tag=tag,
            buildargs=build_args(),
            network_mode="host",  # the engine has no bridge network; pip needs PyPI
            rm=True,
            pull=False,
        )
    except (docker.errors.BuildError, docker.errors.APIError) as exc:
        log = "".join(line.get("stream", "") for line in getattr(exc, "build_log", []) or [])
        raise ImageBuildError(f"building {tag} failed: {exc}\n{log[-4000:]}") from exc
    image.tag(IMAGE_REPOSITORY, "latest")
    return tag
