"""What a cold launch pays for before its first command: the runner (`python -m l4m.controller`)
imports protobuf (the session needs it), but not grpc, numpy, tokenizers, llguidance or OpenTelemetry,
which load when a controller first uses them (a gRPC channel: a session or runtime not on frames, or
`ctx.vars.watch`; a window, the model's tokenizer, a constraint, tracing)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

DEFERRED = ("grpc", "numpy", "tokenizers", "llguidance", "opentelemetry")


def imported_after(statement: str) -> set[str]:
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(m.split('.')[0] for m in sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return set(json.loads(result.stdout.splitlines()[-1]))


@pytest.mark.parametrize("statement", ["import l4m.controller", "from l4m import Context, Greedy, Instance"])
def test_the_runner_and_the_context_defer_the_heavy_imports(statement: str) -> None:
    loaded = imported_after(statement)
    assert "google" in loaded  # the session's protobuf, needed for the first command
    assert not loaded & set(DEFERRED), sorted(loaded & set(DEFERRED))


# What an idle controller (an agent waiting on a tool: `main` awaits `ctx.receive()`) does not hold: a
# context's modules load on its first use, json where a local run prints or stats are parsed, and the
# runner's heap trim calls through `_ctypes`, not `ctypes` (docs/benchmarks.md, "Controller memory").
IDLE_DEFERRED = ("l4m.context", "l4m.generation", "l4m.sampler", "l4m.stop", "l4m.window", "l4m.wire.rules",
                 "json", "ctypes")  # fmt: skip


def modules_after(statement: str) -> set[str]:
    """Every module's full name after `statement` in a fresh interpreter (no json of its own: json is one
    of the names looked for)."""
    code = f"import sys\n{statement}\nprint(' '.join(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return set(result.stdout.splitlines()[-1].split())


def test_an_idle_runner_holds_no_context_modules_json_or_ctypes() -> None:
    loaded = modules_after("import l4m.controller\nassert l4m.controller.release_free_memory()")
    assert {"l4m.instance", "l4m.model", "l4m.runtime", "l4m.session", "_ctypes"} <= loaded
    assert not loaded & set(IDLE_DEFERRED), sorted(loaded & set(IDLE_DEFERRED))


def test_a_contexts_modules_load_on_its_first_use() -> None:
    loaded = modules_after("import l4m.controller\nfrom l4m import Context")
    assert set(IDLE_DEFERRED[:6]) <= loaded, sorted(set(IDLE_DEFERRED[:6]) - loaded)


def test_the_deferred_modules_load_when_used() -> None:
    loaded = imported_after(
        "from l4m.tokenizer import Tokenizer\nfrom l4m.wire import tracecontext\n"
        "tracecontext.context_from_traceparent('')\nimport l4m.wire.brle"
    )
    assert {"numpy", "opentelemetry"} <= loaded
