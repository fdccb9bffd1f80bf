"""l4m: programs (controllers) drive an LLM through the L4M protocol.

The controller SDK is imported lazily (`from l4m import Context, Greedy, Constraint`), so services that
only need `l4m.v1` or `l4m.wire.brle` do not pay for it.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Session": "l4m.session",
    "Model": "l4m.model",
    "Tokenizer": "l4m.tokenizer",
    "Context": "l4m.context",
    "StepResult": "l4m.context",
    "SampledToken": "l4m.context",
    "Distribution": "l4m.context",
    "Generation": "l4m.generation",
    "Completion": "l4m.generation",
    "Token": "l4m.generation",
    "Window": "l4m.window",
    "Constraint": "l4m.constraint",
    "Instance": "l4m.instance",
    "Sampler": "l4m.sampler",
    "Greedy": "l4m.sampler",
    "Sample": "l4m.sampler",
    "TopDistribution": "l4m.sampler",
    "greedy": "l4m.sampler",
    "temperature": "l4m.sampler",
    "top_k": "l4m.sampler",
    "top_p": "l4m.sampler",
    "min_p": "l4m.sampler",
    "L4MError": "l4m.errors",
    "Trapped": "l4m.errors",
    "SessionClosed": "l4m.errors",
    "ContextFreed": "l4m.errors",
    "ConstraintError": "l4m.errors",
    "ChatTemplateError": "l4m.errors",
    "beam_search": "l4m.search",
    "NgramDrafter": "l4m.drafter",
    "generate_speculative": "l4m.drafter",
    "Client": "l4m.client",
}
_MODULES = {"stop", "sampler", "fake"}

__all__ = sorted(_EXPORTS) + sorted(_MODULES)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _MODULES:
        return importlib.import_module(f"l4m.{name}")
    raise AttributeError(f"module 'l4m' has no attribute {name!r}")
