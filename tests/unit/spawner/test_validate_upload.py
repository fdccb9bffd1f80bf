"""Upload validation in a bounded child process: verdicts, the memory and time limits, and what
compiling costs per MB of source (printed: it is what the default upload size is chosen from)."""

from __future__ import annotations

import asyncio
import io
import zipfile
from pathlib import Path

import pytest

from l4m.spawner.programs import InvalidProgram, ProgramKind
from l4m.spawner.validate_upload import MiB, UploadValidator, ValidationFailed, ValidatorLimits


def _write(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "upload"
    path.write_bytes(data)
    return path


def _validate(path: Path, limits: ValidatorLimits | None = None) -> ProgramKind:
    return asyncio.run(UploadValidator(limits or ValidatorLimits()).validate(path))


def test_valid_source_and_zip_are_accepted(tmp_path: Path) -> None:
    assert _validate(_write(tmp_path, b"print('hi')\n")) is ProgramKind.PYTHON_SOURCE
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("__main__.py", b"print('hi')\n")
    assert _validate(_write(tmp_path, buffer.getvalue())) is ProgramKind.ZIP


def test_a_syntax_error_names_its_line(tmp_path: Path) -> None:
    with pytest.raises(InvalidProgram, match=r"not valid Python: .*line 2") as caught:
        _validate(_write(tmp_path, b"x = 1\ndef (:\n"))
    assert not isinstance(caught.value, ValidationFailed)


def test_a_program_nested_too_deeply_is_invalid_not_a_crash(tmp_path: Path) -> None:
    with pytest.raises(InvalidProgram, match="not valid Python"):
        _validate(_write(tmp_path, b"x = " + b"+".join(b"1" for _ in range(200_000)) + b"\n"))


def test_compiling_past_the_memory_limit_is_refused_naming_it(tmp_path: Path) -> None:
    dense = _write(tmp_path, b"f()\n" * (MiB // 4))  # ~515 MiB peak to compile, measured
    with pytest.raises(ValidationFailed, match="ran out of memory.*limit of 128 MiB"):
        _validate(dense, ValidatorLimits(max_memory_bytes=128 * MiB))


def test_validation_past_the_time_limit_is_refused_naming_it(tmp_path: Path) -> None:
    dense = _write(tmp_path, b"f()\n" * (MiB // 4))
    with pytest.raises(ValidationFailed, match=r"took longer than its limit of 0\.05 s"):
        _validate(dense, ValidatorLimits(timeout_s=0.05))


def test_a_flood_of_validations_queues_behind_the_bound(tmp_path: Path) -> None:
    paths = [tmp_path / f"p{i}.py" for i in range(6)]
    for i, path in enumerate(paths):
        path.write_bytes(f"print({i})\n".encode())
    validator = UploadValidator(ValidatorLimits(max_concurrent=2))
    num_running, peak = 0, 0
    run_child = validator._run_child

    async def counting(path: Path):  # type: ignore[no-untyped-def]
        nonlocal num_running, peak
        num_running += 1
        peak = max(peak, num_running)
        try:
            return await run_child(path)
        finally:
            num_running -= 1

    validator._run_child = counting  # type: ignore[method-assign]

    async def all_of_them() -> list[ProgramKind]:
        return await asyncio.gather(*(validator.validate(path) for path in paths))

    assert asyncio.run(all_of_them()) == [ProgramKind.PYTHON_SOURCE] * 6
    assert peak == 2


def test_peak_memory_per_mb_of_source_is_within_the_default_limit(tmp_path: Path) -> None:
    """The worst case measured (one call per line) at 1 MiB of source: printed, and it must fit the
    default 1 GiB limit, so that programs up to ~2 MiB of the densest source still validate."""
    validator = UploadValidator()
    for name, source in {
        "calls": b"f()\n" * (MiB // 4),
        "one list": b"x = [" + b"1," * (MiB // 2) + b"]\n",
        "assignments": b"".join(b"a%d = 1\n" % (i % 1000) for i in range(MiB // 7)),
    }.items():
        measured = asyncio.run(validator.validate_measured(_write(tmp_path, source)))
        per_mb = measured.max_rss_bytes / MiB / (len(source) / MiB)
        print(f"validator peak RSS for 1 MiB of {name}: {measured.max_rss_bytes // MiB} MiB ({per_mb:.0f} MiB per MiB)")
        assert measured.max_rss_bytes < ValidatorLimits().max_memory_bytes
