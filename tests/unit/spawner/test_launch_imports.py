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


def test_the_deferred_modules_load_when_used() -> None:
    loaded = imported_after(
        "from l4m.tokenizer import Tokenizer\nfrom l4m.wire import tracecontext\n"
        "tracecontext.context_from_traceparent('')\nimport l4m.wire.brle"
    )
    assert {"numpy", "opentelemetry"} <= loaded
