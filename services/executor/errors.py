"""Typed failures of the executor core; the gRPC server maps each class to one status code.

Every error is raised while a batch is validated, before any state of that batch changes, so the
engine keeps serving after it (`CapabilityError` too: nothing is touched).
"""

from __future__ import annotations


class ExecutorError(Exception):
    """Base class: a command the executor refuses, with a human reason."""

    def __init__(self, reason: str, item_index: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        # The first offending item of the batch; None when the batch as a whole is refused.
        self.item_index = item_index


class InvalidCommand(ExecutorError):
    """A malformed command: wrong lengths, out-of-range values, bad sampler parameters."""


class UnknownResource(InvalidCommand):
    """A KV page or embedding slot id that is out of range or not allocated."""


class CapabilityError(ExecutorError):
    """The loaded model cannot do this (e.g. embed_image on a text-only model)."""
