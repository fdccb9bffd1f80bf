"""KV pages published by name (export), mapped into other instances (import), withdrawn (unexport).

An export holds one reference on each of its pages, so the pages outlive the exporter's own
deallocation. Unexport drops only that reference: pages an importer still maps stay alive until the
importer lets go. A non-persistent export disappears with its exporter; a persistent one stays until
someone unexports it, its executor goes away, or the scheduler evicts it under memory pressure.

Eviction (docs/operations.md "Under memory pressure"): when an allocation cannot be met from free pages,
persistent exports that their owner did not pin go first, least recently used first (used: exported or
imported; listing is not a use), before any live instance is preempted (contention.py says which;
`Scheduler._evict_exports` does it). An evicted export is gone as if unexported: importers keep their
pages. Pinned exports are never evicted; only a persistent export may be pinned, so a user's pinned pages
are bounded by its quota below.

Accounting: the distinct pages of a user's persistent exports are counted per user (a page exported
under several names counts once), since they outlive every instance of the user; the scheduler caps
them (`--max-export-pages-per-user`).

Per model: an export holds one model's KV, so each model served has its own namespaces; a session
sees, imports and names only its own model's exports.

Visibility: an export belongs to its exporter's user. Names are one namespace per user, plus one of
public exports: a user's own export of a name comes first, then the public one; an admin instance
also reaches any user's. Another user's private export is not found, exactly like a missing one, so
neither an import nor a taken name reveals that it exists.

The export commands (export_kv_pages, unexport_kv_pages, import_kv_pages, list_exports) run here as
scheduler-local commands, at the head of their stream; each returns a `LocalOutcome` for the core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from l4m.scheduler.errors import InvalidCommand, PermissionDenied, ResourceExhausted
from l4m.scheduler.outbound import DONE, LocalOutcome
from l4m.scheduler.translate import translate_ids
from l4m.v1 import l4m_pb2

if TYPE_CHECKING:
    from l4m.scheduler.batcher import Command
    from l4m.scheduler.executors import Executor
    from l4m.scheduler.instances import Instance
    from l4m.scheduler.local import SchedulerView


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
    model: str = ""  # the model whose KV it holds (the exporter session's)
    is_pinned: bool = False  # never evicted under memory pressure (persistent exports only)

    def is_visible_to(self, user: str, is_admin: bool) -> bool:
        return self.is_public or is_admin or self.owner_user == user


class ExportTable:
    """Exports by (model, owner user, name), public ones also by (model, name), for every executor of the
    scheduler."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, str, str], Export] = {}
        self._public: dict[tuple[str, str], Export] = {}
        # user -> (executor index, physical page) -> number of the user's persistent exports naming it
        self._persistent_pages: dict[str, dict[tuple[int, int], int]] = {}
        # (model, owner user, name) -> the use (export, import) that touched it last: least recent is smallest
        self._last_used: dict[tuple[str, str, str], int] = {}
        self._num_uses = 0

    def __len__(self) -> int:
        return len(self._by_key)

    def find(self, name: str, user: str, is_admin: bool = False, model: str = "") -> Export | None:
        """The export `name` of `model` as `user` sees it (see the module docstring), or None."""
        export = self._by_key.get((model, user, name)) or self._public.get((model, name))
        if export is None and is_admin:
            export = next((e for e in self._by_key.values() if e.name == name and e.model == model), None)
        return export

    def can_add(self, name: str, user: str, is_public: bool, model: str = "") -> bool:
        return (model, user, name) not in self._by_key and not (is_public and (model, name) in self._public)

    def add(self, export: Export) -> None:
        if not self.can_add(export.name, export.owner_user, export.is_public, export.model):
            raise ValueError(f"export {export.name!r} exists")
        self._by_key[(export.model, export.owner_user, export.name)] = export
        self.touch(export)
        if export.is_public:
            self._public[(export.model, export.name)] = export
        if export.is_persistent:
            counts = self._persistent_pages.setdefault(export.owner_user, {})
            for page in export.physical_page_ids:
                key = (export.executor_index, page)
                counts[key] = counts.get(key, 0) + 1

    def remove(self, export: Export) -> Export:
        if export.is_public:
            del self._public[(export.model, export.name)]
        key = (export.model, export.owner_user, export.name)
        removed = self._by_key.pop(key)
        del self._last_used[key]
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

    def touch(self, export: Export) -> None:
        """The export was used (exported or imported): the last to be evicted now."""
        self._num_uses += 1
        self._last_used[(export.model, export.owner_user, export.name)] = self._num_uses

    def evictable_on(self, executor_index: int) -> list[Export]:
        """The exports on the executor that memory pressure may evict (persistent, not pinned), least
        recently used first."""
        candidates = [e for e in self._by_key.values()
                      if e.executor_index == executor_index and e.is_persistent and not e.is_pinned]
        return sorted(candidates, key=lambda e: self._last_used[(e.model, e.owner_user, e.name)])

    def num_persistent_pages(self, user: str) -> int:
        """Distinct pages in `user`'s persistent exports."""
        return len(self._persistent_pages.get(user, ()))

    def num_new_persistent_pages(self, user: str, executor_index: int, physical_page_ids: list[int]) -> int:
        """How many of these pages a persistent export by `user` would add to its count."""
        counts = self._persistent_pages.get(user, {})
        return len({p for p in physical_page_ids if (executor_index, p) not in counts})

    def all(self) -> list[Export]:
        return list(self._by_key.values())

    def visible_to(self, user: str, is_admin: bool, model: str = "") -> list[Export]:
        return [e for e in self._by_key.values() if e.model == model and e.is_visible_to(user, is_admin)]

    def owned_by(self, instance_id: str, *, is_persistent: bool) -> list[Export]:
        return [
            e for e in self._by_key.values() if e.owner_instance_id == instance_id and e.is_persistent == is_persistent
        ]

    def on_executor(self, executor_index: int) -> list[Export]:
        return [e for e in self._by_key.values() if e.executor_index == executor_index]


# ---- the export commands ----


def run_export(view: SchedulerView, command: Command, item: l4m_pb2.ExportKvPagesCommand) -> LocalOutcome:
    instance: Instance = command.stream.instance
    if not view.exports.can_add(item.name, instance.user, item.is_public, _model_name(instance)):
        raise InvalidCommand(f"name {item.name!r} is already exported")
    if item.pinned and not item.persistent:
        # A non-persistent export is never evicted (its exporter holds it); pinning it would mean nothing.
        raise InvalidCommand(f"export {item.name!r}: pinned applies to persistent exports only (set persistent)")
    physical = translate_ids(instance.table.kv_pages, item.kv_page_ids, "kv page")
    executor: Executor = instance.executor  # bound: it owns the pages just translated
    if item.persistent:
        _check_export_quota(view, instance.user, executor, physical)
    pool = executor.pools().kv_pages
    pool.retain(physical)
    pool.freeze(physical)
    view.exports.add(Export(item.name, executor.index, tuple(physical), item.persistent, bytes(item.metadata),
                            instance.instance_id, instance.user, item.is_public, _model_name(instance),
                            item.pinned))
    return DONE


def _model_name(instance: Instance) -> str:
    return instance.model.name if instance.model is not None else ""


def _check_export_quota(view: SchedulerView, user: str, executor: Executor, physical: list[int]) -> None:
    """Persistent exports outlive their instances: a user's hold at most `max_export_pages_per_user`
    distinct pages together (default half of the smallest executor), so other users can always get
    pages."""
    limit = view.config.max_export_pages_per_user
    if limit is None:
        limit = min(e.resources.kv_pages.capacity for e in view.executors if e.resources) // 2
    if not limit:
        return
    held = view.exports.num_persistent_pages(user)
    total = held + view.exports.num_new_persistent_pages(user, executor.index, physical)
    if total > limit:
        raise ResourceExhausted(
            f"a persistent export of {len(physical)} kv pages would bring user {user!r}'s persistent exports to "
            f"{total} kv pages, more than its quota of {limit} (--max-export-pages-per-user); unexport some first"
        )


def _find_export(exports: ExportTable, instance: Instance, name: str, missing_ok: bool = False) -> Export | None:
    """The export `name` as the instance sees it; another user's private export is 'no export': None
    with `missing_ok`, else a trap."""
    export = exports.find(name, instance.user, instance.is_admin, _model_name(instance))
    if export is None and not missing_ok:
        raise InvalidCommand(f"no export is named {name!r}")
    return export


def run_unexport(view: SchedulerView, command: Command, item: l4m_pb2.UnexportKvPagesCommand) -> LocalOutcome:
    """Only the export's user or an admin may unexport it. With `missing_ok`, a name that finds nothing
    (an export evicted before) does nothing."""
    instance: Instance = command.stream.instance
    export = _find_export(view.exports, instance, item.name, item.missing_ok)
    if export is None:
        return DONE
    if export.owner_user != instance.user and not instance.is_admin:
        raise PermissionDenied(f"export {export.name!r} belongs to another user; only its user or an admin "
                               f"may unexport it")
    return LocalOutcome(dropped_exports=(view.exports.remove(export),))


def run_import(view: SchedulerView, command: Command, item: l4m_pb2.ImportKvPagesCommand) -> LocalOutcome:
    """Maps the export's pages into the instance (binding it to the export's executor if unbound). With
    `missing_ok`, a name that finds nothing answers `is_missing` instead of trapping (an evicted export)."""
    instance: Instance = command.stream.instance
    export = _find_export(view.exports, instance, item.name, item.missing_ok)
    if export is None:
        return LocalOutcome(reply={"import_kv_pages": l4m_pb2.ImportKvPagesResult(is_missing=True)})
    if len(item.kv_page_ids) != len(export.physical_page_ids):
        raise InvalidCommand(
            f"export {item.name!r} has {len(export.physical_page_ids)} pages; kv_page_ids lists {len(item.kv_page_ids)}"
        )
    table = instance.table.kv_pages
    for virtual_id in item.kv_page_ids:
        if virtual_id in table:
            raise InvalidCommand(f"kv page id {virtual_id} is already allocated by this instance")
    limits = instance.model.limits if instance.model is not None else None
    limit = limits.max_kv_pages_per_instance if limits is not None else 0
    if len(table) + len(item.kv_page_ids) > limit:
        raise ResourceExhausted(f"importing {item.name!r} would hold more than the {limit} kv pages one instance may hold")
    executor = view.executors[export.executor_index]
    if instance.executor is None:
        instance.executor = executor
        executor.instances.add(instance)
    elif instance.executor is not executor:
        raise InvalidCommand(
            f"export {item.name!r} lives on executor {executor.index}; this instance is bound to executor "
            f"{instance.executor.index}"
        )
    executor.pools().kv_pages.retain(export.physical_page_ids)
    view.exports.touch(export)
    table.update(zip(item.kv_page_ids, export.physical_page_ids, strict=True))
    result = l4m_pb2.ImportKvPagesResult(num_kv_pages=len(export.physical_page_ids), metadata=export.metadata)
    return LocalOutcome(reply={"import_kv_pages": result})


def run_list_exports(view: SchedulerView, command: Command, item: l4m_pb2.ListExportsCommand) -> LocalOutcome:
    instance: Instance = command.stream.instance
    infos = [
        l4m_pb2.ExportInfo(name=e.name, num_kv_pages=len(e.physical_page_ids), persistent=e.is_persistent,
                           metadata_bytes=len(e.metadata), is_public=e.is_public, pinned=e.is_pinned)
        for e in view.exports.visible_to(instance.user, instance.is_admin, _model_name(instance))
    ]
    return LocalOutcome(reply={"list_exports": l4m_pb2.ListExportsResult(exports=infos)})
