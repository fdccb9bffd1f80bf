"""Automatic prefix caching: a prompt that starts as an earlier one did reuses its KV pages.

Keys. A prompt's full pages are keyed by a hash chain, as vLLM does: page i's key hashes page i-1's key
and page i's tokens, the chain starting from the model's and the user's names. A key therefore names the
whole prefix up to the end of its page.

Entries. After a built-in handler has answered, it publishes the full pages of its prompt as one
persistent export (`l4m-prefix-<key>-<random>`) of the caller's user; the cache remembers which keys the
export holds. Exports belong to their user in the scheduler, and the chain is salted with the user: a
prompt is only ever reused by its own user, so no tenant reads (or times) another's. A later request
of the same user and model looks up the longest run of its page keys that an entry holds, imports that
export keeping only the matching pages, and feeds the rest of its prompt; at least its last token is
always fed, for the logits of the first completion token.

Eviction. The cache holds at most `max_pages` pages: distinct keys over every entry (an export built
on an imported prefix shares those pages, which count once). Past that, the least recently used
entries that no request is importing right now are unexported, whichever user they belong to, through
`unexport(model, name)` (the backend's admin maintenance session). The entry leaves the index first,
so no request picks it while its unexport is on the way.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from l4m.context import Context

log = logging.getLogger("l4m.gateway")

EXPORT_PREFIX = "l4m-prefix-"

Unexport = Callable[[str, str], Awaitable[None]]  # (model, export name)


def page_keys(model: str, user: str, token_ids: Sequence[int], page_size: int) -> list[bytes]:
    """The hash chain of the prompt's full pages: key i names tokens [0, (i + 1) * page_size)."""
    key = hashlib.sha256(f"l4m-prefix\0{model}\0{user}".encode()).digest()
    keys = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        page = b"".join(int(t).to_bytes(4, "little") for t in token_ids[start:start + page_size])
        key = hashlib.sha256(key + page).digest()
        keys.append(key)
    return keys


@dataclass(eq=False)
class Entry:
    name: str  # the export's
    model: str
    user: str
    keys: tuple[bytes, ...]  # of its pages, in order
    pins: int = 0  # requests importing it now


@dataclass(frozen=True)
class Match:
    entry: Entry
    num_pages: int  # of the entry's pages the prompt shares

    @property
    def name(self) -> str:
        return self.entry.name


@dataclass
class PrefixCache:
    max_pages: int
    unexport: Unexport
    _entries: OrderedDict[str, Entry] = field(default_factory=OrderedDict)  # by name, least recently used first
    _holders: dict[bytes, list[Entry]] = field(default_factory=dict)  # key -> the entries holding its page
    hits: int = 0
    misses: int = 0
    evictions: int = 0

    @property
    def enabled(self) -> bool:
        return self.max_pages > 0

    @property
    def num_pages(self) -> int:
        return len(self._holders)

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, keys: Sequence[bytes], num_prompt_tokens: int, page_size: int) -> Match | None:
        """The longest cached prefix of the prompt whose keys these are (leaving at least its last token to
        feed), pinned until `release`; None on a miss."""
        usable = min(len(keys), (num_prompt_tokens - 1) // page_size)
        best: Entry | None = None
        num_pages = 0
        for key in keys[:usable]:
            holders = self._holders.get(key)
            if not holders:
                break
            best, num_pages = holders[-1], num_pages + 1  # an entry holding key i holds keys 0..i too
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        best.pins += 1
        self._entries.move_to_end(best.name)
        return Match(best, num_pages)

    def release(self, match: Match | None) -> None:
        if match is not None:
            match.entry.pins -= 1

    def forget(self, match: Match) -> None:
        """The entry's export is gone (an import found no such export): out of the index at once."""
        self._drop(match.entry)

    def publish(self, model: str, user: str, keys: Sequence[bytes], shared_pages: int) -> Entry | None:
        """A new entry for a prompt's full pages (the first `shared_pages` of which came from the cache),
        indexed at once; None where it would add no page, or more than `max_pages`. The caller exports its pages under
        `entry.name`, then calls `evict`; if the export fails it calls `discard(entry)`."""
        if not self.enabled or len(keys) <= shared_pages:
            return None
        new_pages = sum(key not in self._holders for key in keys)
        if not new_pages or new_pages > self.max_pages:  # nothing to add, or more than the whole cache
            return None
        name = f"{EXPORT_PREFIX}{keys[-1].hex()[:24]}-{secrets.token_hex(4)}"
        entry = Entry(name, model, user, tuple(keys))
        self._entries[name] = entry
        for key in entry.keys:
            self._holders.setdefault(key, []).append(entry)
        return entry

    def discard(self, entry: Entry) -> None:
        """An entry whose export was never made."""
        self._drop(entry)

    async def evict(self) -> list[str]:
        """Unexport least recently used, unpinned entries while more than `max_pages` pages are cached;
        returns their names. An unexport that fails is logged and not retried (its export may outlive the
        cache's knowledge of it until the executor restarts; the scheduler's per-user quota still bounds
        it): the request that published has its answer already, and the next victims still go."""
        evicted = []
        while self.num_pages > self.max_pages:
            victim = next((e for e in self._entries.values() if e.pins == 0), None)
            if victim is None:
                break
            self._drop(victim)
            self.evictions += 1
            evicted.append(victim.name)
            try:
                await self.unexport(victim.model, victim.name)
            except Exception as error:
                log.warning("prefix cache: could not unexport %s of %s: %s", victim.name, victim.model, error)
        return evicted

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._entries), "pages": self.num_pages, "max_pages": self.max_pages,
                "hits": self.hits, "misses": self.misses, "evictions": self.evictions}

    def _drop(self, entry: Entry) -> None:
        if self._entries.pop(entry.name, None) is None:
            return
        for key in entry.keys:
            holders = self._holders[key]
            holders.remove(entry)
            if not holders:
                del self._holders[key]


@dataclass(frozen=True)
class PrefixScope:
    """One request's part in the cache: its model and its user (whose exports it may import and make)."""

    cache: PrefixCache
    model: str
    user: str

    def keys(self, token_ids: Sequence[int], page_size: int) -> list[bytes]:
        return page_keys(self.model, self.user, token_ids, page_size)

    async def publish(self, context: Context, keys: Sequence[bytes], num_cached_pages: int) -> None:
        """Export the prompt's full pages (`context` holds them first) as a new entry, then evict past the
        cap. A failed export (the user's quota of persistent export pages, --max-export-pages-per-user, is
        full) loses only the entry, and a failed eviction is logged (`evict`): the request has its answer
        already."""
        entry = self.cache.publish(self.model, self.user, keys, num_cached_pages)
        if entry is None:
            return
        try:
            await context.export(entry.name, persistent=True, num_pages=len(keys))
            await context.model.session.synchronize(context.stream_id)
        except Exception as error:
            self.cache.discard(entry)
            log.warning("prefix cache: the prompt's pages were not published: %s", error)
            return
        await self.cache.evict()
