"""Shared variables of one launch tree (AICI's "common state").

Every instance of a launch tree (the launched instance and all the children it spawns, transitively)
sees the same variables. Each variable has a value and a version that every write increments, so a
controller can compare-and-set without losing concurrent updates. Watchers get the current value and
then every later change, in order.

Invariant: `version` of a stored variable is > 0 and increases by exactly 1 per write; a missing variable
has version 0, which is what `compare_and_set(expected_version=0)` uses to mean "must not exist yet".
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

MAX_VARIABLE_NAME_BYTES = 256
MAX_VARIABLE_BYTES = 1 << 20


class VariableError(ValueError):
    """A variable request that cannot be honoured (bad name, value too large)."""


@dataclass(frozen=True)
class Snapshot:
    """A variable as it is at one version."""

    exists: bool
    value: bytes
    version: int


@dataclass(frozen=True)
class CasResult:
    swapped: bool
    snapshot: Snapshot


_MISSING = Snapshot(exists=False, value=b"", version=0)


@dataclass
class _Variable:
    snapshot: Snapshot = _MISSING
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)


class VariableStore:
    """The variables of one launch tree. All methods run on the spawner's event loop."""

    def __init__(self, max_total_bytes: int = 64 << 20) -> None:
        self._vars: dict[str, _Variable] = {}
        self._max_total_bytes = max_total_bytes
        self._total_bytes = 0

    def get(self, name: str) -> Snapshot:
        _check_name(name)
        var = self._vars.get(name)
        return var.snapshot if var else _MISSING

    async def set(self, name: str, value: bytes) -> Snapshot:
        return await self._write(name, value)

    async def compare_and_set(self, name: str, expected_version: int, value: bytes) -> CasResult:
        current = self.get(name)
        if current.version != expected_version:
            return CasResult(swapped=False, snapshot=current)
        return CasResult(swapped=True, snapshot=await self._write(name, value))

    async def append(self, name: str, value: bytes) -> Snapshot:
        return await self._write(name, self.get(name).value + value)

    async def watch(self, name: str) -> AsyncIterator[Snapshot]:
        """The current snapshot, then one per write, forever (the caller cancels)."""
        var = self._variable(name)
        seen = -1
        while True:
            async with var.changed:
                await var.changed.wait_for(lambda seen=seen: var.snapshot.version != seen)
                snap = var.snapshot
            seen = snap.version
            yield snap

    def _variable(self, name: str) -> _Variable:
        _check_name(name)
        return self._vars.setdefault(name, _Variable())

    async def _write(self, name: str, value: bytes) -> Snapshot:
        if len(value) > MAX_VARIABLE_BYTES:
            raise VariableError(
                f"variable {name!r}: value of {len(value)} bytes exceeds {MAX_VARIABLE_BYTES}"
            )
        var = self._variable(name)
        growth = len(value) - len(var.snapshot.value)
        if self._total_bytes + growth > self._max_total_bytes:
            raise VariableError(
                f"variable {name!r}: the launch tree's variables would exceed {self._max_total_bytes} bytes"
            )
        # No await between the read of the version and the write: the event loop makes this atomic.
        var.snapshot = Snapshot(exists=True, value=value, version=var.snapshot.version + 1)
        self._total_bytes += growth
        async with var.changed:
            var.changed.notify_all()
        return var.snapshot


def _check_name(name: str) -> None:
    if not name or len(name.encode()) > MAX_VARIABLE_NAME_BYTES:
        raise VariableError(f"variable names are 1..{MAX_VARIABLE_NAME_BYTES} bytes of UTF-8, got {name!r}")
