"""Imports flow one way: each service imports the generated stubs (`l4m.v1`), the wire layer it shares
with the SDK (`l4m.wire`), the tracing set-up, `l4m.common` and its own package, never another service or
the rest of the SDK; `l4m.common` imports no service; the SDK imports neither; the wire layer imports only
the stubs and itself. Read from the source (ast), nothing imported."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SERVICES = ("executor", "scheduler", "spawner", "gateway")
# Packages a service may import anything from: the stubs, the wire layer (what both ends of a connection
# agree on) and the services' common front door.
SHARED_PACKAGES = ("l4m.v1", "l4m.wire", "l4m.common")
# The SDK's modules besides the wire layer that every process shares; a service may import these and no
# other part of the SDK. A new one belongs here only if clients need it too (else: l4m.common).
WIRE_MODULES = frozenset({"l4m.telemetry", "l4m.eventloop", "l4m.memory"})
EXTRA_MODULES = {
    # `l4m` itself for its location (the SDK mounted into sandboxes); the key store `l4m keys` writes.
    "spawner": frozenset({"l4m", "l4m.keys"}),
    # The gateway's handlers are controllers: they use the SDK's model, sessions, samplers and stops.
    "gateway": frozenset({"l4m.model", "l4m.session", "l4m.sampler", "l4m.stop", "l4m.tokenizer", "l4m.errors",
                          "l4m.constraint", "l4m.context"}),
}
# The key store `l4m keys` writes, which `l4m.common.users` reads for the spawner and the gateway.
COMMON_EXTRA_MODULES = frozenset({"l4m.keys"})
FIRST_PARTY_ELSEWHERE = ("tests", "bench", "examples")


def imports_of(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) of every import in `path`, nested ones included; `from l4m import x` is `l4m.x`
    and a relative import keeps its dots."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                yield node.lineno, "." * node.level + (node.module or "")
            elif node.module == "l4m":
                for alias in node.names:
                    yield node.lineno, f"l4m.{alias.name}"
            else:
                yield node.lineno, node.module or ""


def is_within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def is_first_party(module: str) -> bool:
    return is_within(module, "l4m") or module.split(".")[0] in FIRST_PARTY_ELSEWHERE


def violations(folder: Path, is_allowed: Callable[[str], bool]) -> list[str]:
    found = []
    for path in sorted(folder.rglob("*.py")):
        for line, module in imports_of(path):
            if is_first_party(module) and not is_allowed(module):
                found.append(f"{path.relative_to(ROOT)}:{line}: {module}")
    return found


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_imports_the_stubs_the_wire_modules_common_and_itself(service: str) -> None:
    own = f"l4m.{service}"
    modules = WIRE_MODULES | EXTRA_MODULES.get(service, frozenset())

    def is_allowed(module: str) -> bool:
        return (module.startswith(".") or module in modules
                or any(is_within(module, package) for package in (own, *SHARED_PACKAGES)))

    assert violations(ROOT / "services" / service, is_allowed) == []


def test_common_imports_no_service_and_only_the_wire_modules() -> None:
    def is_allowed(module: str) -> bool:
        return module.startswith(".") or module in WIRE_MODULES | COMMON_EXTRA_MODULES \
            or any(is_within(module, package) for package in SHARED_PACKAGES)

    assert violations(ROOT / "services" / "common", is_allowed) == []


def test_the_wire_layer_imports_only_the_stubs_and_itself() -> None:
    """Both ends of every connection import `l4m.wire`: it may not pull in the SDK or a service."""
    def is_allowed(module: str) -> bool:
        return module.startswith(".") or is_within(module, "l4m.v1") or is_within(module, "l4m.wire")

    assert violations(ROOT / "clients" / "python" / "l4m" / "wire", is_allowed) == []


def test_the_sdk_imports_no_service_and_not_common() -> None:
    """Controllers run the SDK in sandboxes where the services are not installed."""
    def is_allowed(module: str) -> bool:
        return not any(is_within(module, f"l4m.{name}") for name in (*SERVICES, "common")) \
            and module.split(".")[0] not in FIRST_PARTY_ELSEWHERE

    assert violations(ROOT / "clients" / "python" / "l4m", is_allowed) == []


def test_the_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    """The walk finds nested and `from l4m import` forms, so the tests above cannot pass vacuously."""
    source = tmp_path / "module.py"
    source.write_text("def f():\n    from l4m import context\n    import l4m.scheduler.core\n")
    assert list(imports_of(source)) == [(2, "l4m.context"), (3, "l4m.scheduler.core")]
