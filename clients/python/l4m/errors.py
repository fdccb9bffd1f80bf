"""Errors a controller author sees. Each message says what happened and what to do about it."""

from __future__ import annotations

from l4m.v1 import l4m_pb2

# What to do when the scheduler traps the instance, per trap kind.
_TRAP_ADVICE = {
    l4m_pb2.TRAP_KIND_INVALID_COMMAND: (
        "a command was rejected; if you built it yourself check the ids and lengths it names, "
        "otherwise this is an SDK bug worth reporting with the reason above"
    ),
    l4m_pb2.TRAP_KIND_RESOURCE_EXHAUSTED: (
        "the cluster ran out of KV pages for this instance: free contexts you no longer need "
        "(`await c.free()` or `async with`), generate fewer forks at once, lower max_tokens, "
        "or keep a sliding window (`c.set_window(...)`) so old pages are dropped"
    ),
    l4m_pb2.TRAP_KIND_EVICTED: "an older instance needed the memory; run again when the cluster is less busy",
    l4m_pb2.TRAP_KIND_EXECUTOR_LOST: "the executor holding this instance's pages went away; run again",
    l4m_pb2.TRAP_KIND_DESTROYED: "the spawner ended this instance (terminated, or a limit was hit)",
    l4m_pb2.TRAP_KIND_TOKEN_BUDGET: (
        "the instance fed more tokens than a budget allows (the reason says whose: its own, its parent's "
        "or its user's per-minute quota); raise Limits.max_tokens (`l4m run --token-budget N`), or wait a minute "
        "for a per-minute quota"
    ),
    l4m_pb2.TRAP_KIND_UNSUPPORTED: "the model cannot do this; check `model.info.capabilities` first",
    l4m_pb2.TRAP_KIND_PERMISSION_DENIED: (
        "this instance may not do that: cluster-wide knobs need an admin key, and only the user who "
        "exported something may unexport it"
    ),
}


class L4MError(Exception):
    """Base of every error the SDK raises on purpose."""


class Trapped(L4MError):
    """The scheduler stopped this instance; every pending and later command fails with this error."""

    def __init__(self, kind: int, reason: str, offending_request_id: int = 0) -> None:
        self.kind = kind
        self.kind_name = l4m_pb2.TrapKind.Name(kind) if kind in l4m_pb2.TrapKind.values() else str(kind)
        self.reason = reason
        self.offending_request_id = offending_request_id
        advice = _TRAP_ADVICE.get(kind, "the session is over")
        super().__init__(f"instance trapped ({self.kind_name}): {reason} -- {advice}")


class SessionClosed(L4MError):
    """The L4M stream ended without a trap (scheduler gone, connection lost, or closed by us)."""


class ContextFreed(L4MError):
    """A Context was used after `free()` (or after leaving its `async with` block)."""


class ConstraintError(L4MError):
    """A grammar, regex or JSON schema that llguidance rejected, or a constraint that reached a dead end."""


class ProgramError(L4MError):
    """A controller program that cannot be loaded (missing file, no `async def main(ctx)`)."""


class ChatTemplateError(L4MError):
    """The model's chat template failed: it does not compile, or it refused the conversation (a template's
    `raise_exception`, e.g. roles that do not alternate user/assistant)."""
