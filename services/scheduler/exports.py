"""KV pages published by name (export), mapped into other instances (import), withdrawn (unexport).

An export holds one reference on each of its pages, so the pages outlive the exporter's own
deallocation. Unexport drops only that reference: pages an importer still maps stay alive until the
importer lets go. A non-persistent export disappears with its exporter; a persistent one stays until
someone unexports it (or its executor goes away).

Accounting: the distinct pages of a user's persistent exports are counted per user (a page exported
under several names counts once), since they outlive every instance of the user; the scheduler caps
them (`--max-export-pages-per-user`).

Visibility: an export belongs to its exporter's user. Names are one namespace per user, plus one of
public exports: a user's own export of a name comes first, then the public one; an admin instance
also reaches any user's. Another user's private export is not found, exactly like a missing one, so
neither an import nor a taken name reveals that it exists.
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
    owner_user: str
    is_public: bool = False

    def is_visible_to(self, user: str, is_admin: bool) -> bool:
        return self.is_public or is_admin or self.owner_user == user


class ExportTable:
    """Exports by (owner user, name), public ones also by name, for every executor of the scheduler."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, str], Export] = {}
        self._public: dict[str, Export] = {}
        # user -> (executor index, physical page) -> number of the user's persistent exports naming it
        self._persistent_pages: dict[str, dict[tuple[int, int], int]] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def find(self, name: str, user: str, is_admin: bool = False) -> Export | None:
        """The export `name` as `user` sees it (see the module docstring), or None."""
        export = self._by_key.get((user, name)) or self._public.get(name)
        if export is None and is_admin:
            export = next((e for e in self._by_key.values() if e.name == name), None)
        return export

    def can_add(self, name: str, user: str, is_public: bool) -> bool:
        return (user, name) not in self._by_key and not (is_public and name in self._public)

    def add(self, export: Export) -> None:
        if not self.can_add(export.name, export.owner_user, export.is_public):
            raise ValueError(f"export {export.name!r} exists")
        self._by_key[(export.owner_user, export.name)] = export
        if export.is_public:
            self._public[export.name] = export
        if export.is_persistent:
            counts = self._persistent_pages.setdefault(export.owner_user, {})
            for page in export.physical_page_ids:
                key = (export.executor_index, page)
                counts[key] = counts.get(key, 0) + 1

    def remove(self, export: Export) -> Export:
        if export.is_public:
            del self._public[export.name]
        removed = self._by_key.pop((export.owner_user, export.name))
        if removed.is_persistent:
            counts = self._persistent_pages[removed.owner_user]
            for page in removed.physical_page_ids:
                key = (removed.executor_index, page)
                counts[key] -= 1
                if counts[key] == 0:
                    del counts[key]
            if not counts:
                del self._persistent_pages[removed.owner_user]
        return removed

    def num_persistent_pages(self, user: str) -> int:
        """Distinct pages in `user`'s persistent exports."""
        return len(self._persistent_pages.get(user, ()))

    def num_new_persistent_pages(self, user: str, executor_index: int, physical_page_ids: list[int]) -> int:
        """How many of these pages a persistent export by `user` would add to its count."""
        counts = self._persistent_pages.get(user, {})
        return len({p for p in physical_page_ids if (executor_index, p) not in counts})

    def all(self) -> list[Export]:
        return list(self._by_key.values())

    def visible_to(self, user: str, is_admin: bool) -> list[Export]:
        return [e for e in self._by_key.values() if e.is_visible_to(user, is_admin)]

    def owned_by(self, instance_id: str, *, is_persistent: bool) -> list[Export]:
        return [
            e for e in self._by_key.values() if e.owner_instance_id == instance_id and e.is_persistent == is_persistent
        ]

    def on_executor(self, executor_index: int) -> list[Export]:
        return [e for e in self._by_key.values() if e.executor_index == executor_index]
