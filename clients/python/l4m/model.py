"""The model handle: what the scheduler serves, its tokenizer, and the id pools of this instance.

One `Model` per L4M session. It owns the virtual id pools (KV pages, streams), so every Context of
the instance draws from the same pools, and it counts the forward passes and tokens this instance sent
(examples report them to show what prefix caching or speculative decoding saves).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from l4m.errors import L4MError
from l4m.pool import IdPool
from l4m.session import Session
from l4m.tokenizer import Tokenizer
from l4m.v1 import common_pb2, l4m_pb2

if TYPE_CHECKING:
    from l4m.context import Context

MAX_STREAMS = 1 << 16


class TokenizerCache:
    """The tokenizers this process built, by what each was built from (the JSON's digest, the chat template,
    the special tokens and the template's variables): the sessions of one process on one model (a shared
    controller process's instances, a service's requests) fetch and build the tokenizer once, not each
    (SmolLM2's: 1.5 MB, ~80 ms to build). Only a digest this process computed from the JSON it holds is
    remembered; the least recently used of more than `max_entries` is dropped."""

    def __init__(self, max_entries: int = 4) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[object, ...], Tokenizer] = OrderedDict()

    @staticmethod
    def key(info: common_pb2.ModelInfo) -> tuple[object, ...] | None:
        """None where the scheduler named no tokenizer (`tokenizer_sha256` empty)."""
        if not info.tokenizer_sha256:
            return None
        return (info.tokenizer_sha256, info.chat_template, tuple(sorted(info.special_token_ids.items())),
                tuple(sorted(info.chat_template_variables.items())))

    def get(self, info: common_pb2.ModelInfo) -> Tokenizer | None:
        key = self.key(info)
        tokenizer = self._entries.get(key) if key is not None else None
        if tokenizer is not None:
            self._entries.move_to_end(key)
        return tokenizer

    def build(self, info: common_pb2.ModelInfo) -> Tokenizer:
        """A tokenizer from `info` (which holds the JSON), remembered when the JSON is the one `info` names."""
        # Imported here: an idle runner does not load the rules (tests/unit/spawner/test_launch_imports.py).
        from l4m.wire.rules import tokenizer_digest

        tokenizer = Tokenizer(info.tokenizer_json, info.chat_template, info.special_token_ids,
                              info.chat_template_variables)
        key = self.key(info)
        if key is not None and tokenizer_digest(info.tokenizer_json) == info.tokenizer_sha256:
            self._entries[key] = tokenizer
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return tokenizer

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


TOKENIZERS = TokenizerCache()


@dataclass
class ForwardStats:
    """What this instance fed through forward passes (counted on the controller's side): a
    continuation step counts as the pass it is on the executor, though no command carried it."""

    num_forward_passes: int = 0
    num_forward_tokens: int = 0
    num_forward_commands: int = 0  # forward_text commands sent (round trips, for a decode loop)


class Model:
    """The served model, as a controller sees it."""

    def __init__(self, session: Session, info: l4m_pb2.GetInfoResponse, tokenizer: Tokenizer | None = None) -> None:
        """`tokenizer`: one already built for this model (a service opening many sessions on one model
        builds it once); None: built from `info` on first use."""
        self.session = session
        self.info = info.model
        self.kv_page_size = info.kv_page_size
        self.max_kv_pages = info.max_kv_pages_per_instance
        self.name = info.model.name
        # Every model the scheduler serves, the default first (`ctx.load_model` opens a session on another).
        self.served_model_names = tuple(info.model_names)
        self.vocab_size = info.model.vocab_size
        self.max_context_tokens = info.model.max_context_tokens
        self.stop_token_ids = tuple(info.model.stop_token_ids)
        self.max_continuation_steps = info.max_continuation_steps  # 0: the scheduler runs no continuation
        # Per command: outputs x distribution_top_k (or a sample_top_k's k), and tokens fed (0: not told).
        self.max_distribution_entries_per_command = info.max_distribution_entries_per_command
        self.max_tokens_per_command = info.max_tokens_per_command
        # Tokens one forward_text may carry (0: not told): a longer prompt than one batch is fine, the
        # scheduler runs it as chunks of `prefill_chunk_tokens` (chunked prefill), so `Context` never splits.
        self.max_tokens_per_forward_text = info.max_tokens_per_forward_text
        self.prefill_chunk_tokens = info.prefill_chunk_tokens
        self.max_mask_runs_per_command = info.max_mask_runs_per_command
        self.kv_pages = IdPool(info.max_kv_pages_per_instance or 1 << 20)
        self.streams = IdPool(MAX_STREAMS)
        # Pages other holders may read outside this instance's refcounts (exported or imported): read-only.
        self.frozen_kv_pages: set[int] = set()
        self.stats = ForwardStats()
        self._tokenizer: Tokenizer | None = tokenizer
        session.add_sync_listener(self.kv_pages.unquarantine)

    @classmethod
    async def load(cls, session: Session) -> Model:
        """The model a session serves. The tokenizer (the bulk of the answer) is left out when the session
        can fetch it later: a controller that only feeds and reads token ids never transfers it."""
        return cls(session, await session.get_info(omit_tokenizer_json=session.can_get_info_blocking))

    @property
    def tokenizer(self) -> Tokenizer:
        """Built on first use, or taken from the process's `TOKENIZERS` when it built this one before; when
        `load` left the tokenizer out, fetched then (once a process), in one blocking call."""
        if self._tokenizer is None:
            tokenizer = TOKENIZERS.get(self.info)
            if tokenizer is None:
                if not self.info.tokenizer_json:
                    self.info = self.session.get_info_blocking().model
                tokenizer = TOKENIZERS.build(self.info)
            self._tokenizer = tokenizer
        return self._tokenizer

    def new_context(self) -> Context:
        """An empty Context on a stream of its own."""
        from l4m.context import Context

        return Context(self)

    async def import_context(self, name: str) -> Context:
        """A Context that continues from an export (see `Context.export`)."""
        from l4m.context import Context

        return await Context.import_(self, name)

    async def list_exports(self) -> list[l4m_pb2.ExportInfo]:
        response = await self.session.request("list_exports", l4m_pb2.ListExportsCommand())
        return list(response.list_exports.exports)

    async def has_export(self, name: str) -> bool:
        return any(e.name == name for e in await self.list_exports())

    def unexport(self, name: str, missing_ok: bool = False) -> None:
        """Remove the export `name`; a name that finds no export traps the session, unless `missing_ok`
        (an export the scheduler may have evicted under memory pressure)."""
        self.session.send("unexport_kv_pages", l4m_pb2.UnexportKvPagesCommand(name=name, missing_ok=missing_ok))

    async def debug_query(self, query: str) -> str:
        response = await self.session.request("debug_query", l4m_pb2.DebugQueryCommand(query=query))
        return response.debug_query.response

    async def scheduler_stats(self) -> dict:
        """The scheduler's counters (`debug_query("stats")`), parsed from JSON."""
        import json  # on first use: an idle controller need not hold it

        return json.loads(await self.debug_query("stats"))

    def allocate_kv_pages(self, count: int, stream_id: int) -> list[int]:
        """Take `count` page ids and allocate them on the wire."""
        if not self.kv_pages.can_acquire(count, stream_id):
            raise L4MError(
                f"this instance would hold more than {self.kv_pages.capacity} KV pages "
                f"({self.kv_pages.num_in_use} in use, {self.kv_pages.num_quarantined} being deallocated, "
                f"{count} more asked): free contexts you no longer need, "
                "or keep a window (`c.set_window(...)`) so old pages are dropped"
            )
        page_ids = self.kv_pages.acquire(count, stream_id)
        item = common_pb2.AllocateItem(kind=common_pb2.RESOURCE_KIND_KV_PAGE, ids=page_ids)
        self.session.send("allocate", item, stream_id)
        return page_ids

    def release_kv_pages(self, page_ids: list[int], stream_id: int) -> bool:
        """Drop one holder from each page; deallocate the pages nobody in this instance holds any more.
        Returns whether a deallocate was sent (its ids stay quarantined to `stream_id` until it ran)."""
        if not page_ids:
            return False
        freed = self.kv_pages.release(page_ids, quarantine=stream_id)
        if freed:
            self.frozen_kv_pages.difference_update(freed)
            item = common_pb2.DeallocateItem(kind=common_pb2.RESOURCE_KIND_KV_PAGE, ids=freed)
            self.session.send("deallocate", item, stream_id)
        return bool(freed)

    def is_page_shared(self, page_id: int) -> bool:
        return self.kv_pages.refcount(page_id) > 1 or page_id in self.frozen_kv_pages
