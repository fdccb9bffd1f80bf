"""Validates uploaded programs in a bounded child process, off the spawner's event loop.

Compiling Python source costs far more memory than the source: measured on the test machine (the
validator's peak RSS, printed by tests/unit/spawner/test_validate_upload.py), ~570 MiB per MiB of
source for a program of `f()` lines, ~440 MiB/MiB for one long list literal, ~210 MiB/MiB for
one-line assignments, and 66 MiB/MiB for real code (3.8 MiB of the standard library's modules). Run on
the event loop, one 2 MB upload grew the spawner by ~680 MiB and stalled every other client for a
second. So every upload is
validated by `python -I -m l4m.spawner.validate_upload FILE` under an address-space limit
(RLIMIT_AS, set by the child before it reads the file) and a wall-time limit (the parent kills it),
and at most `max_concurrent` run at once: a flood of uploads queues instead of exhausting memory.
The child prints one JSON line: {"kind": "python"|"zip", "max_rss_kib": N} or {"error": "..."}; the
parent awaits it asynchronously, so other calls are served meanwhile. With the defaults (1 GiB, and
uploads of at most 4 MiB, config.py) real programs validate with room to spare, and the densest
source past ~1.8 MiB is refused as out of memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import sys
from dataclasses import dataclass
from pathlib import Path

from l4m.spawner.programs import InvalidProgram, ProgramKind, validate_program

MiB = 1024 * 1024
DEFAULT_MAX_MEMORY_BYTES = 1024 * MiB
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MAX_CONCURRENT = 2
# The child's exit status when compiling ran out of its address space.
_EXIT_OUT_OF_MEMORY = 3
_MAX_REPLY_BYTES = 64 * 1024
_MAX_ERROR_CHARS = 4000  # JSON-escaped, well under _MAX_REPLY_BYTES


class ValidationFailed(InvalidProgram):
    """Validation itself could not finish (out of memory, out of time, the child crashed)."""


@dataclass(frozen=True)
class ValidatorLimits:
    max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES  # the child's RLIMIT_AS
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_concurrent: int = DEFAULT_MAX_CONCURRENT


@dataclass(frozen=True)
class Validated:
    kind: ProgramKind
    max_rss_bytes: int  # the validating child's peak resident memory


class UploadValidator:
    """Runs `validate_program` on a file in a child process; `validate` is a coroutine."""

    def __init__(self, limits: ValidatorLimits | None = None) -> None:
        self.limits = limits or ValidatorLimits()
        self._slots = asyncio.Semaphore(self.limits.max_concurrent)

    async def validate(self, path: Path) -> ProgramKind:
        """The program's kind, or InvalidProgram (the reason) / ValidationFailed (which limit)."""
        return (await self.validate_measured(path)).kind

    async def validate_measured(self, path: Path) -> Validated:
        """`validate`, with the child's peak RSS."""
        async with self._slots:
            return await self._run_child(path)

    async def _run_child(self, path: Path) -> Validated:
        limits = self.limits
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-m", __name__, str(path), str(limits.max_memory_bytes),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        try:
            stdout = await asyncio.wait_for(child.stdout.read(_MAX_REPLY_BYTES), limits.timeout_s)
            await asyncio.wait_for(child.wait(), limits.timeout_s)
        except TimeoutError:
            raise ValidationFailed(
                f"validating the program took longer than its limit of {limits.timeout_s:g} s"
            ) from None
        finally:
            if child.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    child.kill()
                await child.wait()
        return _parse_reply(child.returncode, stdout, limits)


def _parse_reply(returncode: int, stdout: bytes, limits: ValidatorLimits) -> Validated:
    if returncode == _EXIT_OUT_OF_MEMORY:
        raise ValidationFailed(
            "validating the program ran out of memory: compiling it needs more than the validator's "
            f"limit of {limits.max_memory_bytes // MiB} MiB"
        )
    try:
        reply = json.loads(stdout)
    except ValueError:
        raise ValidationFailed(
            f"the program validator ended without an answer (status {returncode}); "
            f"its memory limit is {limits.max_memory_bytes // MiB} MiB"
        ) from None
    if "error" in reply:
        raise InvalidProgram(reply["error"])
    return Validated(ProgramKind(reply["kind"]), reply["max_rss_kib"] * 1024)


def _peak_rss_kib() -> int:
    """This process's peak resident memory since its exec: VmHWM. Not `getrusage(RUSAGE_SELF).ru_maxrss`,
    which Linux carries across exec from the parent's memory at fork (a validator forked from a large
    process would report that process's size)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # no procfs: an upper bound


def _child_main(path: str, max_memory_bytes: int) -> int:
    # The limit comes first, before the file is read or compiled.
    resource.setrlimit(resource.RLIMIT_AS, (max_memory_bytes, max_memory_bytes))
    try:
        kind = validate_program(Path(path).read_bytes())
        reply = {"kind": kind.value, "max_rss_kib": _peak_rss_kib()}
    except MemoryError:
        return _EXIT_OUT_OF_MEMORY
    except InvalidProgram as exc:
        reply = {"error": str(exc)[:_MAX_ERROR_CHARS]}
    sys.stdout.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1], int(sys.argv[2])))
