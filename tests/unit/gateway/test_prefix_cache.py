"""Automatic prefix caching: the cache's keys, lookups, pins and LRU alone, then through the gateway's
routes over `FakeBackend` (`l4m.fake`'s model, pages of 4 slots; no socket): a repeated prompt prefix is
imported instead of fed, the answer is the uncached one, usage counts the cached tokens, eviction
unexports, and a user never reuses another user's prompt."""

from __future__ import annotations

import json
from pathlib import Path

import httpx2
import openai
import pytest

from l4m.common.users import Authenticator
from l4m.fake import FakeL4M
from l4m.gateway.backend import FakeBackend
from l4m.gateway.config import GatewayConfig
from l4m.gateway.prefix_cache import EXPORT_PREFIX, PrefixCache, page_keys
from l4m.gateway.server import create_app
from l4m.keys import KeyStore
from l4m.model import Model
from l4m.v1 import l4m_pb2

MODEL = "fake-tiny"
PAGE = 4
SYSTEM = "You answer questions about the sea, briefly and with care. " * 3


# ---- the cache alone -----------------------------------------------------------------------------


def test_page_keys_chain_full_pages_and_are_salted_by_model_and_user() -> None:
    tokens = list(range(10))
    keys = page_keys("m", "alice", tokens, PAGE)
    assert len(keys) == 2  # two full pages; the last two tokens are no page yet
    assert page_keys("m", "alice", tokens[:8] + [99, 98, 97], PAGE) == keys  # same prefix, same keys
    assert page_keys("m", "alice", [0, 1, 2, 3, 9, 9, 9, 9], PAGE)[0] == keys[0]
    assert page_keys("m", "alice", [0, 1, 2, 3, 9, 9, 9, 9], PAGE)[1] != keys[1]
    assert page_keys("m", "bob", tokens, PAGE)[0] != keys[0]
    assert page_keys("other", "alice", tokens, PAGE)[0] != keys[0]
    assert page_keys("m", "alice", [4, 5, 6, 7, 0, 1, 2, 3], PAGE)[1] != keys[0]  # a page's key names its prefix


class Unexports(list):
    async def __call__(self, model: str, name: str) -> None:
        self.append(name)


async def test_lookup_finds_the_longest_prefix_and_leaves_the_last_token_to_feed() -> None:
    cache = PrefixCache(100, Unexports())
    keys = page_keys("m", "u", list(range(12)), PAGE)
    assert cache.lookup(keys, 12, PAGE) is None
    entry = cache.publish("m", "u", keys, 0)
    assert entry is not None and entry.name.startswith(EXPORT_PREFIX) and cache.num_pages == 3
    match = cache.lookup(keys, 12, PAGE)  # the same 12 tokens: 2 pages, so the 12th is fed
    assert match is not None and (match.entry, match.num_pages) == (entry, 2)
    cache.release(match)
    longer = page_keys("m", "u", list(range(12)) + [50, 51, 52, 53, 54], PAGE)
    match = cache.lookup(longer, 17, PAGE)
    assert match is not None and match.num_pages == 3
    cache.release(match)
    other = page_keys("m", "u", [0, 1, 2, 3, 40, 41, 42, 43, 44], PAGE)
    match = cache.lookup(other, 9, PAGE)
    assert match is not None and match.num_pages == 1
    cache.release(match)
    assert cache.publish("m", "u", keys[:2], 2) is None  # adds no page
    assert cache.publish("m", "u", keys, 1) is None  # every key is held already
    assert (cache.hits, cache.misses) == (3, 1)


async def test_eviction_is_lru_spares_pinned_entries_and_leaves_the_index_first() -> None:
    unexports = Unexports()
    cache = PrefixCache(4, unexports)
    a = cache.publish("m", "u", page_keys("m", "u", list(range(8)), PAGE), 0)
    b = cache.publish("m", "u", page_keys("m", "u", list(range(100, 108)), PAGE), 0)
    assert a and b and cache.num_pages == 4 and await cache.evict() == []
    pinned = cache.lookup(page_keys("m", "u", list(range(9)), PAGE), 9, PAGE)  # a: used last, and pinned
    assert pinned is not None and pinned.entry is a
    c = cache.publish("m", "u", page_keys("m", "u", list(range(200, 208)), PAGE), 0)
    assert c is not None and cache.num_pages == 6
    assert await cache.evict() == [b.name] and unexports == [b.name]
    cache.release(pinned)
    d = cache.publish("m", "u", page_keys("m", "u", list(range(300, 304)), PAGE), 0)
    assert d is not None
    assert await cache.evict() == [a.name]  # now unpinned and least recently used
    assert cache.lookup(page_keys("m", "u", list(range(9)), PAGE), 9, PAGE) is None
    assert cache.stats()["evictions"] == 2 and cache.num_pages == 3


async def test_a_failed_unexport_is_logged_and_the_next_victims_still_go(caplog: pytest.LogCaptureFixture) -> None:
    unexports = Unexports()

    async def unexport(model: str, name: str) -> None:
        if not unexports:
            unexports.append(name)
            raise RuntimeError("the maintenance session is gone")
        await unexports(model, name)

    cache = PrefixCache(1, unexport)
    a = cache.publish("m", "u", page_keys("m", "u", list(range(4)), PAGE), 0)
    b = cache.publish("m", "u", page_keys("m", "u", list(range(100, 104)), PAGE), 0)
    c = cache.publish("m", "u", page_keys("m", "u", list(range(200, 204)), PAGE), 0)
    assert a and b and c
    with caplog.at_level("WARNING", logger="l4m.gateway"):
        assert await cache.evict() == [a.name, b.name]
    assert unexports == [a.name, b.name] and cache.num_pages == 1
    assert f"could not unexport {a.name} of m: the maintenance session is gone" in caplog.text


async def test_an_entry_built_on_another_shares_its_pages_and_outlives_it() -> None:
    cache = PrefixCache(100, Unexports())
    system = list(range(8))
    base = cache.publish("m", "u", page_keys("m", "u", system + [1], PAGE), 0)
    longer_keys = page_keys("m", "u", system + list(range(60, 68)), PAGE)
    longer = cache.publish("m", "u", longer_keys, 2)
    assert base and longer and cache.num_pages == 4  # the shared two pages count once
    match = cache.lookup(longer_keys[:2], 9, PAGE)
    assert match is not None and match.entry is longer and match.num_pages == 2  # the most recent holder
    cache.release(match)
    cache.forget(match)  # its export went away: the older entry still holds the two pages
    match = cache.lookup(longer_keys, 17, PAGE)
    assert match is not None and match.entry is base and match.num_pages == 2
    assert cache.num_pages == 2


# ---- through the gateway -------------------------------------------------------------------------


class Gateway:
    def __init__(self, tmp_path: Path, prefix_cache_pages: int) -> None:
        keys = KeyStore.load(tmp_path / "keys.json")
        self.alice, self.bob = keys.add("alice"), keys.add("bob")
        keys.save()
        self.fake = FakeL4M()
        self.backend = FakeBackend(self.fake, prefix_cache_pages=prefix_cache_pages)
        self.app = create_app(GatewayConfig(prefix_cache_pages=prefix_cache_pages), self.backend,
                              Authenticator(tmp_path / "keys.json"))
        self.http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=self.app), base_url="http://gateway")

    def client(self, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(api_key=key, base_url="http://gateway/v1", http_client=self.http, max_retries=0)

    async def chat(self, question: str, key: str | None = None, stream: bool = False, n: int = 1):  # type: ignore[no-untyped-def]
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        client = self.client(key or self.alice)
        if not stream:
            return await client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8,
                                                        n=n)
        chunks = await client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8,
                                                      stream=True, stream_options={"include_usage": True})
        text, usage = "", None
        async for chunk in chunks:
            text += "".join(c.delta.content or "" for c in chunk.choices)
            usage = chunk.usage or usage
        return text, usage

    def exports(self) -> list[str]:
        return sorted(self.fake.exports)

    def assert_freed(self) -> None:
        """Nothing held but the cached prefixes' pages."""
        assert self.backend.num_open == 0
        exported = {p for e in self.fake.exports.values() for p in e.physical_ids}
        assert self.fake.num_pages_in_use == len(exported)


@pytest.fixture
def cached(tmp_path: Path) -> Gateway:
    return Gateway(tmp_path, prefix_cache_pages=128)


async def test_a_repeated_prefix_is_imported_and_answers_as_uncached(cached: Gateway, tmp_path: Path) -> None:
    uncached = Gateway(tmp_path / "off", prefix_cache_pages=0)
    first = await cached.chat("What is a tide?")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert len(cached.exports()) == 1 and cached.exports()[0].startswith(EXPORT_PREFIX)
    second = await cached.chat("Why is the sea salty?")
    cached_tokens = second.usage.prompt_tokens_details.cached_tokens
    assert cached_tokens > 0 and cached_tokens % PAGE == 0
    assert cached_tokens < second.usage.prompt_tokens
    reference = await uncached.chat("Why is the sea salty?")
    assert second.choices[0].message.content == reference.choices[0].message.content
    assert reference.usage.prompt_tokens_details.cached_tokens == 0 and uncached.exports() == []
    text, usage = await cached.chat("Why is the sea salty?", stream=True)  # the whole prompt is cached now
    assert text == reference.choices[0].message.content
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // PAGE * PAGE
    three = await cached.chat("Why is the sea salty?", n=3)
    assert [c.message.content for c in three.choices] == [reference.choices[0].message.content] * 3
    assert three.usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens_details.cached_tokens
    assert cached.backend.prefix_cache.stats()["hits"] == 3
    cached.assert_freed()


async def test_users_never_share_cached_prefixes(cached: Gateway) -> None:
    await cached.chat("What is a tide?")
    bobs = await cached.chat("What is a tide?", key=cached.bob)
    assert bobs.usage.prompt_tokens_details.cached_tokens == 0
    alices = await cached.chat("What is a tide?")
    assert alices.usage.prompt_tokens_details.cached_tokens > 0
    assert len(cached.exports()) == 2  # one per user
    cached.assert_freed()


async def test_eviction_unexports_the_least_recently_used_prefix(tmp_path: Path) -> None:
    small = Gateway(tmp_path / "small", prefix_cache_pages=1)
    await small.chat("What is a tide?")
    assert small.exports() == []  # a prompt larger than the whole cache is not kept
    gateway = Gateway(tmp_path, prefix_cache_pages=60)  # one prompt's 55 pages fit, two do not
    await gateway.chat("What is a tide?")
    first = gateway.exports()
    assert len(first) == 1
    await gateway.chat("Completely different: name a colour.", key=gateway.bob)
    assert len(gateway.exports()) == 1 and gateway.exports() != first
    assert gateway.backend.prefix_cache.stats()["evictions"] >= 1
    gateway.assert_freed()


async def test_a_failed_eviction_leaves_the_answer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gateway = Gateway(tmp_path, prefix_cache_pages=60)  # one prompt's 55 pages fit, two do not

    async def refuse(model: str, name: str) -> None:
        raise RuntimeError("no unexport today")

    monkeypatch.setattr(gateway.backend.prefix_cache, "unexport", refuse)
    await gateway.chat("What is a tide?")
    answer = await gateway.chat("Completely different: name a colour.", key=gateway.bob)
    assert answer.choices[0].message.content and gateway.backend.prefix_cache.stats()["evictions"] == 1
    assert len(gateway.exports()) == 2  # the evicted prefix's export outlives the cache's knowledge of it


async def test_a_prefix_unexported_behind_the_caches_back_is_fed_again(cached: Gateway) -> None:
    await cached.chat("What is a tide?")
    reference = await cached.chat("Why is the sea salty?")
    for name in cached.exports():  # as an admin or the user's own program could
        await cached.backend._unexport(MODEL, name)
    again = await cached.chat("Why is the sea salty?")
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].message.content == reference.choices[0].message.content
    assert len(cached.exports()) == 1  # published anew
    cached.assert_freed()


async def test_a_prefix_evicted_between_the_list_and_the_import_is_fed_again(
        cached: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler may evict the export under memory pressure after `Context.import_` listed it: the
    import (missing_ok) finds nothing, the session goes on and the whole prompt is fed."""
    await cached.chat("What is a tide?")
    reference = await cached.chat("Why is the sea salty?")
    listed = Model.list_exports

    async def list_then_evict(model: Model) -> list[l4m_pb2.ExportInfo]:
        exports = await listed(model)
        for name in cached.exports():
            await cached.backend._unexport(MODEL, name)
        return exports

    monkeypatch.setattr(Model, "list_exports", list_then_evict)
    again = await cached.chat("Why is the sea salty?")
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].message.content == reference.choices[0].message.content
    assert len(cached.exports()) == 1  # published anew
    cached.assert_freed()


async def test_the_caches_own_eviction_of_a_prefix_the_scheduler_evicted_is_quiet(tmp_path: Path) -> None:
    gateway = Gateway(tmp_path, prefix_cache_pages=60)  # one prompt's 55 pages fit, two do not
    await gateway.chat("What is a tide?")
    (evicted,) = gateway.exports()
    await gateway.backend._unexport(MODEL, evicted)  # as the scheduler's eviction: the cache does not know
    answer = await gateway.chat("Completely different: name a colour.", key=gateway.bob)
    assert answer.choices[0].message.content  # its publish evicted the stale entry without failing
    assert len(gateway.exports()) == 1 and gateway.exports() != [evicted]
    assert gateway.backend.prefix_cache.stats()["evictions"] == 1 and len(gateway.backend.prefix_cache) == 1
    gateway.assert_freed()


async def test_usage_reports_cached_tokens_on_completions_too(cached: Gateway) -> None:
    prompt = SYSTEM + " Q: what is a wave?"
    client = cached.client(cached.alice)
    first = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    second = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details is None or first.usage.prompt_tokens_details.cached_tokens == 0
    raw = json.loads((await cached.http.post(
        "/v1/completions", content=json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}),
        headers={"authorization": f"Bearer {cached.alice}", "content-type": "application/json"})).text)
    assert raw["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert second.choices[0].text == first.choices[0].text
    cached.assert_freed()


def test_the_flag_sets_the_cap_and_refuses_a_negative_one(capsys: pytest.CaptureFixture[str]) -> None:
    from l4m.gateway.__main__ import parse_config

    assert parse_config(["--insecure-local"]).prefix_cache_pages == 512
    assert parse_config(["--insecure-local", "--prefix-cache-pages", "0"]).prefix_cache_pages == 0
    with pytest.raises(SystemExit):
        parse_config(["--insecure-local", "--prefix-cache-pages", "-1"])
    assert "--prefix-cache-pages must be 0 (off) or more" in capsys.readouterr().err
