"""The program store: content addressing, re-upload no-op, chunked uploads, size limit, zip checks, tags."""

from __future__ import annotations

import hashlib
import io
import stat
import zipfile
from pathlib import Path

import pytest

from l4m.spawner.programs import (
    DigestMismatch,
    InvalidProgram,
    InvalidTag,
    ProgramKind,
    ProgramNotFound,
    ProgramStore,
    ProgramTooLarge,
    validate_program,
)

SOURCE = b"print('hello')\n"


def make_zip(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


@pytest.fixture
def store(tmp_path: Path) -> ProgramStore:
    return ProgramStore(tmp_path / "store", max_program_bytes=1024)


def test_programs_are_stored_under_their_sha256(store: ProgramStore) -> None:
    result = store.put(SOURCE)
    sha256 = hashlib.sha256(SOURCE).hexdigest()
    assert result.program.sha256 == sha256
    assert result.program.path == store.root / "programs" / sha256
    assert result.program.path.read_bytes() == SOURCE
    assert result.program.kind is ProgramKind.PYTHON_SOURCE
    assert result.program.size_bytes == len(SOURCE)
    assert not result.already_present


def test_program_files_are_world_readable_for_the_sandbox_uid(store: ProgramStore) -> None:
    mode = stat.S_IMODE(store.put(SOURCE).program.path.stat().st_mode)
    assert mode == 0o644


def test_reuploading_the_same_bytes_is_a_noop(store: ProgramStore) -> None:
    first = store.put(SOURCE)
    mtime = first.program.path.stat().st_mtime_ns
    second = store.put(SOURCE)
    assert second.already_present
    assert second.program.sha256 == first.program.sha256
    assert second.program.path.stat().st_mtime_ns == mtime
    assert len(store.list_programs()) == 1


def test_chunks_are_assembled_in_order(store: ProgramStore) -> None:
    data = b"x = 1\n" * 100
    upload = store.begin_upload()
    for start in range(0, len(data), 7):
        upload.write(data[start : start + 7])
    result = store.finish_upload(upload, expected_sha256=hashlib.sha256(data).hexdigest())
    assert result.program.path.read_bytes() == data
    assert list((store.root / "uploads").iterdir()) == []


def test_an_upload_over_the_size_limit_is_refused_and_discarded(store: ProgramStore) -> None:
    upload = store.begin_upload()
    upload.write(b"#" * 1000)
    with pytest.raises(ProgramTooLarge, match="1024"):
        upload.write(b"#" * 100)
    assert list((store.root / "uploads").iterdir()) == []


def test_a_wrong_announced_digest_is_refused(store: ProgramStore) -> None:
    upload = store.begin_upload()
    upload.write(SOURCE)
    with pytest.raises(DigestMismatch):
        store.finish_upload(upload, expected_sha256="0" * 64)
    assert store.list_programs() == []


def test_a_zip_with_main_is_a_program() -> None:
    assert validate_program(make_zip({"__main__.py": SOURCE, "lib.py": b""})) is ProgramKind.ZIP


def test_a_zip_without_main_is_refused_with_a_clear_reason(store: ProgramStore) -> None:
    with pytest.raises(InvalidProgram, match="no __main__.py"):
        store.put(make_zip({"app.py": SOURCE}))
    assert store.list_programs() == []


def test_a_zip_with_main_in_a_subdirectory_is_refused() -> None:
    with pytest.raises(InvalidProgram, match="__main__.py"):
        validate_program(make_zip({"pkg/__main__.py": SOURCE}))


@pytest.mark.parametrize(
    ("data", "reason"),
    [(b"", "empty"), (b"def broken(:\n", "not valid Python"), (b"\xff\xfe\x00garbage", "UTF-8")],
)
def test_invalid_programs_are_refused(data: bytes, reason: str) -> None:
    with pytest.raises(InvalidProgram, match=reason):
        validate_program(data)


def test_tags_resolve_and_move(store: ProgramStore) -> None:
    first = store.put(SOURCE, tags=("demo:v1",)).program
    second = store.put(b"print(2)\n").program
    assert store.resolve("demo:v1").sha256 == first.sha256
    assert store.resolve(first.sha256).tags == ("demo:v1",)
    store.set_tag("demo:v1", second.sha256)
    assert store.resolve("demo:v1").sha256 == second.sha256
    assert store.tags() == {"demo:v1": second.sha256}


def test_a_bare_name_means_latest(store: ProgramStore) -> None:
    program = store.put(SOURCE, tags=("demo",)).program
    assert store.resolve("demo:latest").sha256 == program.sha256


def test_tags_survive_a_restart(store: ProgramStore) -> None:
    program = store.put(SOURCE, tags=("demo:v1",)).program
    assert ProgramStore(store.root).resolve("demo:v1").sha256 == program.sha256


def test_removed_and_unknown_tags_are_not_found(store: ProgramStore) -> None:
    store.put(SOURCE, tags=("demo:v1",))
    store.remove_tag("demo:v1")
    with pytest.raises(ProgramNotFound):
        store.resolve("demo:v1")
    with pytest.raises(ProgramNotFound):
        store.resolve("f" * 64)


@pytest.mark.parametrize("tag", ["Upper:v1", "bad tag:v1", "demo:", ":v1", "demo:v 1"])
def test_malformed_tags_are_refused(store: ProgramStore, tag: str) -> None:
    program = store.put(SOURCE).program
    with pytest.raises(InvalidTag):
        store.set_tag(tag, program.sha256)


def test_tagging_an_unknown_program_is_not_found(store: ProgramStore) -> None:
    with pytest.raises(ProgramNotFound):
        store.set_tag("demo:v1", "a" * 64)


def test_listing_shows_every_program_with_its_tags(store: ProgramStore) -> None:
    store.put(SOURCE, tags=("a:1", "b:2"))
    store.put(make_zip({"__main__.py": SOURCE}))
    programs = store.list_programs()
    assert sorted(p.kind.value for p in programs) == ["python", "zip"]
    assert [p.tags for p in programs if p.kind is ProgramKind.PYTHON_SOURCE] == [("a:1", "b:2")]
