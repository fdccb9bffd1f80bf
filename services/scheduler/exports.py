"""KV pages published by name (export), mapped into other instances (import), withdrawn (unexport).

An export holds one reference on each of its pages, so the pages outlive the exporter's own
deallocation. Unexport drops only that reference: pages an importer still maps stay alive until the
importer lets go. A non-persistent export disappears with its exporter; a persistent one stays until
someone unexports it (or its executor goes away).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Export:
    name: str
    executor_index: int
    physical_page_ids: tuple[int, ...]
    is_persistent: bool
    metadata: bytes
    owner_instance_id: str


class ExportTable:
    """Exports by name, for every executor of the scheduler (names are one global namespace)."""

    def __init__(self) -> None:
        self._by_name: dict[str, Export] = {}

    def __len__(self) -> int:
        return len(self._by_name)

    def get(self, name: str) -> Export | None:
        return self._by_name.get(name)

    def can_add(self, name: str) -> bool:
        return name not in self._by_name

    def add(self, export: Export) -> None:
        if export.name in self._by_name:
            raise ValueError(f"export {export.name!r} exists")
        self._by_name[export.name] = export

    def remove(self, name: str) -> Export:
        return self._by_name.pop(name)

    def all(self) -> list[Export]:
        return list(self._by_name.values())

    def owned_by(self, instance_id: str, *, is_persistent: bool) -> list[Export]:
        return [
            e for e in self._by_name.values() if e.owner_instance_id == instance_id and e.is_persistent == is_persistent
        ]

    def on_executor(self, executor_index: int) -> list[Export]:
        return [e for e in self._by_name.values() if e.executor_index == executor_index]
