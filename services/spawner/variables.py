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
from dataclasses import dataclass

MAX_VARIABLE_NAME_BYTES = 256
MAX_VARIABLE_BYTES = 1 << 20
DEFAULT_MAX_TOTAL_BYTES = 64 << 20
# What one stored variable costs beyond its name and value, against the tree's total: about what its
# dict entry, objects and headers take (measured ~200 bytes, see the unit test), so that empty values
# under long names cannot fill the spawner's memory for free.
VARIABLE_OVERHEAD_BYTES = 256


class VariableError(ValueError):
    """A variable request that cannot be honoured (bad name, value too large)."""


class VariableQuotaExceeded(VariableError):
    """A write would take the launch tree's variables past their total."""


@dataclass(frozen=True, slots=True)
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


@dataclass(slots=True)
class _Variable:
    snapshot: Snapshot = _MISSING
    # Created by the first watcher only: an unwatched variable carries no Condition (~1 KiB).
    changed: asyncio.Condition | None = None
    num_watchers: int = 0


def variable_cost(name: str, value: bytes) -> int:
    """What a stored variable counts against its tree's total."""
    return len(name.encode()) + len(value) + VARIABLE_OVERHEAD_BYTES


class VariableStore:
    """The variables of one launch tree. All methods run on the spawner's event loop.

    Invariant: `total_bytes` is the sum of `variable_cost` over the variables that exist, and never
    exceeds `max_total_bytes`; a name held only by watchers costs nothing and is dropped with its last
    watcher."""

    def __init__(self, max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES) -> None:
        self._vars: dict[str, _Variable] = {}
        self._max_total_bytes = max_total_bytes
        self.total_bytes = 0
        self.num_variables = 0  # that exist (not names held only by watchers)

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
        _check_name(name)
        var = self._vars.setdefault(name, _Variable())
        if var.changed is None:
            var.changed = asyncio.Condition()
        var.num_watchers += 1
        changed, seen = var.changed, -1
        try:
            while True:
                async with changed:
                    await changed.wait_for(lambda seen=seen: var.snapshot.version != seen)
                    snap = var.snapshot
                seen = snap.version
                yield snap
        finally:
            var.num_watchers -= 1
            if not var.num_watchers and not var.snapshot.exists and self._vars.get(name) is var:
                del self._vars[name]

    def clear(self) -> None:
        """Drops every variable (the tree has ended: nobody can read them any more)."""
        self._vars.clear()
        self.total_bytes = self.num_variables = 0

    async def _write(self, name: str, value: bytes) -> Snapshot:
        _check_name(name)
        if len(value) > MAX_VARIABLE_BYTES:
            raise VariableError(
                f"variable {name!r}: value of {len(value)} bytes exceeds {MAX_VARIABLE_BYTES}"
            )
        old = self._vars.get(name)
        old_cost = variable_cost(name, old.snapshot.value) if old is not None and old.snapshot.exists else 0
        growth = variable_cost(name, value) - old_cost
        if self.total_bytes + growth > self._max_total_bytes:
            raise VariableQuotaExceeded(
                f"variable {name!r}: the launch tree's variables would exceed {self._max_total_bytes} bytes "
                f"(each costs its name, its value and {VARIABLE_OVERHEAD_BYTES} bytes; "
                f"{self.num_variables} variables hold {self.total_bytes} now)"
            )
        var = old if old is not None else self._vars.setdefault(name, _Variable())
        if not var.snapshot.exists:
            self.num_variables += 1
        # No await between the read of the version and the write: the event loop makes this atomic.
        var.snapshot = Snapshot(exists=True, value=value, version=var.snapshot.version + 1)
        self.total_bytes += growth
        if var.changed is not None:
            async with var.changed:
                var.changed.notify_all()
        return var.snapshot


def _check_name(name: str) -> None:
    if not name or len(name.encode()) > MAX_VARIABLE_NAME_BYTES:
        raise VariableError(f"variable names are 1..{MAX_VARIABLE_NAME_BYTES} bytes of UTF-8, got {name!r}")
