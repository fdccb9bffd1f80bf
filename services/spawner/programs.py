"""Content-addressed store of controller programs.

A program is either Python source (one file) or a zip archive holding `__main__.py` at its top
level; both run as `python <file>`. Programs live at `<root>/programs/<sha256 of the bytes>`, so the
same bytes are stored once and re-uploading them is a no-op. Tags (`name:tag` -> sha256) live in
`<root>/tags.json`, replaced atomically on every change. Uploads arrive in chunks, are assembled in
`<root>/uploads/` while being hashed and size-checked, and move into place with one rename. The server
validates an upload in a bounded child process (`validate_upload.py`), never on its event loop.

Program files are written 0644: the sandbox runs them as an unprivileged uid, while the store
directories stay private to the spawner (the sandbox sees only the one file bound into it).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import threading
import time
import uuid
import zipfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

# 4 MiB: see validate_upload.py for what compiling costs per MB of source.
DEFAULT_MAX_PROGRAM_BYTES = 4 * 1024 * 1024
DEFAULT_TAG = "latest"
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_TAG_RE = re.compile(r"^[a-z0-9][a-z0-9._/-]{0,127}:[A-Za-z0-9._-]{1,128}$")


class ProgramError(Exception):
    """Base class of the store's errors; each subclass maps to one gRPC status in the server."""


class InvalidProgram(ProgramError):
    """The bytes are neither valid Python source nor a zip holding `__main__.py`."""


class ProgramTooLarge(ProgramError):
    """An upload went past the store's maximum program size."""


class ProgramNotFound(ProgramError):
    """No program has that hash, or no tag has that name."""


class InvalidTag(ProgramError):
    """A tag is not of the form `name:tag`."""


class DigestMismatch(ProgramError):
    """The client announced a sha256 that the uploaded bytes do not have."""


class ProgramKind(StrEnum):
    PYTHON_SOURCE = "python"
    ZIP = "zip"


@dataclass(frozen=True)
class ProgramInfo:
    sha256: str
    size_bytes: int
    kind: ProgramKind
    path: Path
    tags: tuple[str, ...] = ()
    created_at_unix_s: float = 0.0


@dataclass(frozen=True)
class StoreResult:
    program: ProgramInfo
    already_present: bool


def validate_program(data: bytes) -> ProgramKind:
    """Says what kind of program `data` is, or raises InvalidProgram with a reason a user can act on."""
    if not data:
        raise InvalidProgram("the program is empty")
    if data[:4] == b"PK\x03\x04" or zipfile.is_zipfile(io.BytesIO(data)):
        return _validate_zip(data)
    try:
        source = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidProgram(f"the program is not UTF-8 Python source nor a zip archive ({exc})") from exc
    try:
        compile(source, "<program>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
        raise InvalidProgram(f"the program is not valid Python: {exc}") from exc
    return ProgramKind.PYTHON_SOURCE


def _validate_zip(data: bytes) -> ProgramKind:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            names = set(archive.namelist())
            bad_member = archive.testzip()
    except (zipfile.BadZipFile, OSError) as exc:
        raise InvalidProgram(f"the program looks like a zip archive but cannot be read: {exc}") from exc
    if bad_member is not None:
        raise InvalidProgram(f"the zip archive is corrupt (member {bad_member!r} fails its CRC check)")
    if "__main__.py" not in names:
        raise InvalidProgram(
            "the zip archive has no __main__.py at its top level; "
            f"python runs a zip through its __main__.py (members: {sorted(names)[:10]})"
        )
    return ProgramKind.ZIP


def normalize_tag(tag: str) -> str:
    """`name` means `name:latest`; anything else must match `name:tag`."""
    full = tag if ":" in tag else f"{tag}:{DEFAULT_TAG}"
    if not _TAG_RE.match(full):
        raise InvalidTag(
            f"invalid tag {tag!r}: expected name:tag, name lower-case [a-z0-9._/-], tag [A-Za-z0-9._-]"
        )
    return full


@dataclass
class ProgramUpload:
    """One chunked upload in progress: bytes go to a temporary file, hashed and counted as they come."""

    upload_id: str
    temp_path: Path
    max_program_bytes: int
    num_bytes: int = 0
    _hasher: hashlib._Hash = field(default_factory=hashlib.sha256)
    _file: io.BufferedWriter | None = None

    def write(self, chunk: bytes) -> None:
        if self.num_bytes + len(chunk) > self.max_program_bytes:
            self.abort()
            raise ProgramTooLarge(
                f"the program is larger than the maximum of {self.max_program_bytes} bytes "
                f"(got at least {self.num_bytes + len(chunk)})"
            )
        if self._file is None:
            self._file = open(self.temp_path, "wb")  # noqa: SIM115 - closed in finish()/abort()
        self._file.write(chunk)
        self._hasher.update(chunk)
        self.num_bytes += len(chunk)

    @property
    def sha256(self) -> str:
        return self._hasher.hexdigest()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def abort(self) -> None:
        self.close()
        self.temp_path.unlink(missing_ok=True)


class ProgramStore:
    """Programs by sha256 on disk, with tags. Thread-safe within one process."""

    def __init__(self, root: Path, max_program_bytes: int = DEFAULT_MAX_PROGRAM_BYTES) -> None:
        self.root = Path(root)
        self.max_program_bytes = max_program_bytes
        self._programs_dir = self.root / "programs"
        self._uploads_dir = self.root / "uploads"
        self._tags_path = self.root / "tags.json"
        self._lock = threading.Lock()
        for directory in (self.root, self._programs_dir, self._uploads_dir):
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Uploads interrupted by a restart are garbage: nobody can finish them.
        for stale in self._uploads_dir.iterdir():
            stale.unlink(missing_ok=True)

    # -- uploads ---------------------------------------------------------------------------------

    def begin_upload(self) -> ProgramUpload:
        upload_id = uuid.uuid4().hex
        return ProgramUpload(upload_id, self._uploads_dir / upload_id, self.max_program_bytes)

    def finish_upload(
        self, upload: ProgramUpload, expected_sha256: str = "", tags: tuple[str, ...] = ()
    ) -> StoreResult:
        """Validates the assembled bytes in this process and stores them: for trusted callers (tests,
        tools). The server validates untrusted uploads in a bounded child process (`finish_upload_with`)."""
        try:
            self._check_digest(upload, expected_sha256)
            data = upload.temp_path.read_bytes() if upload.num_bytes else b""
            return self._commit(upload, validate_program(data), tags)
        finally:
            upload.abort()

    async def finish_upload_with(
        self,
        validate: Callable[[Path], Awaitable[ProgramKind]],
        upload: ProgramUpload,
        expected_sha256: str = "",
        tags: tuple[str, ...] = (),
    ) -> StoreResult:
        """Like `finish_upload`, with `await validate(path)` (e.g. `UploadValidator.validate`) judging
        the assembled file instead of an in-process `validate_program`."""
        try:
            self._check_digest(upload, expected_sha256)
            if not upload.num_bytes:
                raise InvalidProgram("the program is empty")
            full_tags = tuple(normalize_tag(t) for t in tags)  # a bad tag fails before the validator runs
            return self._commit(upload, await validate(upload.temp_path), full_tags)
        finally:
            upload.abort()

    def _check_digest(self, upload: ProgramUpload, expected_sha256: str) -> None:
        upload.close()
        if expected_sha256 and expected_sha256.lower() != upload.sha256:
            raise DigestMismatch(f"the upload's sha256 is {upload.sha256}, the client announced {expected_sha256}")

    def _commit(self, upload: ProgramUpload, kind: ProgramKind, tags: tuple[str, ...]) -> StoreResult:
        """Moves the validated upload into place (or drops it if already stored) and sets its tags."""
        full_tags = tuple(normalize_tag(t) for t in tags)
        target = self._programs_dir / upload.sha256
        with self._lock:
            already_present = target.exists()
            if not already_present:
                os.chmod(upload.temp_path, 0o644)
                os.replace(upload.temp_path, target)
            for tag in full_tags:
                self._set_tag_locked(tag, upload.sha256)
        return StoreResult(self._info(upload.sha256, kind), already_present)

    def put(self, data: bytes, tags: tuple[str, ...] = ()) -> StoreResult:
        """Stores `data` in one piece (the same path as a one-chunk upload)."""
        upload = self.begin_upload()
        upload.write(data)
        return self.finish_upload(upload, tags=tags)

    # -- lookups ---------------------------------------------------------------------------------

    def resolve(self, ref: str) -> ProgramInfo:
        """A sha256 (hex) or a tag (`name:tag`, or `name` for `name:latest`) -> the program."""
        ref = ref.strip()
        if _SHA256_RE.match(ref.lower()):
            return self.get(ref.lower())
        full = normalize_tag(ref)
        sha256 = self._read_tags().get(full)
        if sha256 is None:
            raise ProgramNotFound(f"no program is tagged {full!r}")
        return self.get(sha256)

    def get(self, sha256: str) -> ProgramInfo:
        if not _SHA256_RE.match(sha256) or not (self._programs_dir / sha256).exists():
            raise ProgramNotFound(f"no program with sha256 {sha256!r}")
        return self._info(sha256, None)

    def list_programs(self) -> list[ProgramInfo]:
        """Every stored program, newest first."""
        infos = [self._info(path.name, None) for path in self._programs_dir.iterdir()]
        return sorted(infos, key=lambda info: info.created_at_unix_s, reverse=True)

    # -- tags ------------------------------------------------------------------------------------

    def set_tag(self, tag: str, sha256: str) -> str:
        """Points `tag` at a stored program (moving it if it pointed elsewhere); returns the full tag."""
        full = normalize_tag(tag)
        self.get(sha256)
        with self._lock:
            self._set_tag_locked(full, sha256)
        return full

    def remove_tag(self, tag: str) -> None:
        full = normalize_tag(tag)
        with self._lock:
            tags = self._read_tags()
            if tags.pop(full, None) is None:
                raise ProgramNotFound(f"no program is tagged {full!r}")
            self._write_tags(tags)

    def tags(self) -> dict[str, str]:
        return self._read_tags()

    # -- internals -------------------------------------------------------------------------------

    def _info(self, sha256: str, kind: ProgramKind | None) -> ProgramInfo:
        path = self._programs_dir / sha256
        stat = path.stat()
        if kind is None:
            kind = ProgramKind.ZIP if zipfile.is_zipfile(path) else ProgramKind.PYTHON_SOURCE
        tags = tuple(sorted(tag for tag, target in self._read_tags().items() if target == sha256))
        return ProgramInfo(sha256, stat.st_size, kind, path, tags, stat.st_mtime)

    def _set_tag_locked(self, full_tag: str, sha256: str) -> None:
        tags = self._read_tags()
        tags[full_tag] = sha256
        self._write_tags(tags)

    def _read_tags(self) -> dict[str, str]:
        try:
            return dict(json.loads(self._tags_path.read_text()))
        except FileNotFoundError:
            return {}

    def _write_tags(self, tags: dict[str, str]) -> None:
        temp = self._tags_path.with_suffix(f".{os.getpid()}.{time.monotonic_ns()}.tmp")
        temp.write_text(json.dumps(tags, indent=1, sort_keys=True))
        os.replace(temp, self._tags_path)
