"""The gateway's model cache: GetInfo refreshed after INFO_TTL_S, the tokenizer kept while the scheduler names
the same one (`ModelInfo.tokenizer_sha256`) and taken anew when the model is served with another."""

from __future__ import annotations

from l4m.fake import FakeL4M
from l4m.gateway import backend
from l4m.model import TOKENIZERS
from l4m.session import Session


async def test_the_tokenizer_follows_the_name_the_scheduler_gives_it(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    TOKENIZERS.clear()
    fake = FakeL4M(kv_page_size=4)
    cache = backend._ModelCache(Session(fake.stub()))
    info, tokenizer = await cache.info("fake-tiny")
    assert not info.model.tokenizer_json  # the cache holds the lean answer; the tokenizer holds the JSON
    assert fake.stats.num_get_info == 2  # lean, then the tokenizer once

    monkeypatch.setattr(backend, "INFO_TTL_S", -1.0)  # every call refreshes
    TOKENIZERS.clear()  # past the process cache's bound: the gateway still keeps its own
    assert (await cache.info("fake-tiny"))[1] is tokenizer
    assert fake.stats.num_get_info == 3  # the refresh, lean

    fake.chat_template = "{{ messages }}"  # the model is served anew with another template
    _, renewed = await cache.info("fake-tiny")
    assert renewed is not tokenizer and renewed.chat_template == "{{ messages }}"
    assert fake.stats.num_get_info == 5
    TOKENIZERS.clear()
