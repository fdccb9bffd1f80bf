"""What a scheduler-local command asks of the core once it ran: the rooms decide, the core acts.

Local handlers (`local.py`, `exports.py`) change only the tables they own (exports, pools' reference
counts, an instance's virtual ids); everything that reaches the outside (a reply to the controller, a
deallocate to an executor) or changes the batcher is described here, and `Scheduler._run_local` does it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from google.protobuf.message import Message

if TYPE_CHECKING:
    from l4m.scheduler.batcher import Strategy
    from l4m.scheduler.exports import Export


@dataclass(frozen=True)
class LocalOutcome:
    """The effects of one local command, each optional."""

    # The reply event: one `SessionResponse` field (e.g. "info", "debug_query") and its message. None: the
    # command is done without a reply of its own.
    reply: Mapping[str, Message] | None = None
    # Exports removed from the table: the core drops their page references and tells their executor to
    # deallocate the pages nobody holds any more.
    dropped_exports: tuple[Export, ...] = field(default_factory=tuple)
    # synchronize: reply once every earlier command of the stream that has a reply was answered.
    waits_for_replies: bool = False
    # set_stream_priority: the stream's new priority (a StreamPriority value).
    priority: int | None = None
    # debug_query "batching:<strategy>": the forward strategy every queue uses from now on.
    forward_strategy: Strategy | None = None


DONE = LocalOutcome()  # done, nothing to send
