"""`Model.load` leaves the tokenizer (the bulk of GetInfo) out when the session can fetch it later: a
controller that only feeds and reads token ids never transfers it; one that tokenizes fetches it once, and
the other sessions of its process on the same tokenizer take the one it built (`l4m.model.TOKENIZERS`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from l4m import Greedy, stop
from l4m.fake import FakeL4M
from l4m.model import TOKENIZERS, Model, TokenizerCache
from l4m.session import Session
from l4m.wire.rules import tokenizer_digest


@pytest.fixture(autouse=True)
def _no_tokenizers_built_yet() -> Iterator[None]:
    """Each test starts as a new process would: no tokenizer built (other tests of this process built some)."""
    TOKENIZERS.clear()
    yield
    TOKENIZERS.clear()


def _lazy_session(fake: FakeL4M) -> Session:
    return Session(fake.stub(), blocking_get_info=fake.get_info_blocking)


def test_token_only_controller_never_fetches_the_tokenizer(run, fake: FakeL4M) -> None:
    async def body() -> list[int]:
        session = _lazy_session(fake)
        try:
            model = await Model.load(session)
            assert model.info.tokenizer_json == "" and model.vocab_size == fake.vocab_size
            c = model.new_context()
            c.fill([5, 6, 7])
            completion = await c.generate(Greedy(), stop=stop.max_tokens(4))
            return completion.token_ids
        finally:
            await session.close()

    assert len(run(body())) == 4
    assert fake.stats.num_get_info == 1  # load only


async def _fill_and_generate(session: Session, expect_tokenizer_loaded: bool = False
                             ) -> tuple[list[int], list[int], str]:
    """Two text fills and three greedy tokens; the context's ids, the generated ids and their text."""
    try:
        model = await Model.load(session)
        if expect_tokenizer_loaded:
            assert model.info.tokenizer_json
        c = model.new_context()
        c.fill("hello there")
        c.fill(" again")
        completion = await c.generate(Greedy(), stop=stop.max_tokens(3))
        return c.token_ids, completion.token_ids, completion.text
    finally:
        await session.close()


def test_the_first_tokenization_fetches_the_tokenizer_once(run, fake: FakeL4M) -> None:
    lazy = run(_fill_and_generate(_lazy_session(fake)))
    assert fake.stats.num_get_info == 2  # load, then one fetch at the first fill(text)

    eager = FakeL4M(kv_page_size=4)
    # Session(stub) cannot fetch later: load asks for everything.
    assert run(_fill_and_generate(Session(eager.stub()), expect_tokenizer_loaded=True)) == lazy
    assert eager.stats.num_get_info == 1


def test_sessions_of_one_process_fetch_and_build_the_tokenizer_once(run, fake: FakeL4M) -> None:
    async def two_models() -> tuple[Model, Model]:
        a, b = _lazy_session(fake), _lazy_session(fake)
        try:
            first, second = await Model.load(a), await Model.load(b)
            first.new_context().fill("hello there")
            second.new_context().fill("hello there")
            return first, second
        finally:
            await a.close()
            await b.close()

    first, second = run(two_models())
    assert first.tokenizer is second.tokenizer
    assert fake.stats.num_get_info == 3  # two loads, one fetch
    assert not second.info.tokenizer_json  # the second never held the JSON
    assert first.info.tokenizer_sha256 == tokenizer_digest(fake.tokenizer_json) != ""


def test_another_chat_template_is_another_tokenizer(run) -> None:
    plain, other = FakeL4M(kv_page_size=4), FakeL4M(kv_page_size=4, chat_template="{{ messages }}")
    models = [run(Model.load(Session(f.stub()))) for f in (plain, other)]
    assert models[0].info.tokenizer_sha256 == models[1].info.tokenizer_sha256
    assert models[0].tokenizer is not models[1].tokenizer
    assert models[1].tokenizer.chat_template == "{{ messages }}"
    assert len(TOKENIZERS) == 2


def test_only_a_digest_of_the_json_at_hand_is_remembered(fake: FakeL4M) -> None:
    info = fake.info().model
    cache = TokenizerCache()
    wrong = type(info)()
    wrong.CopyFrom(info)
    wrong.tokenizer_sha256 = "0" * 64
    unnamed = type(info)()
    unnamed.CopyFrom(info)
    unnamed.ClearField("tokenizer_sha256")
    assert cache.build(wrong).encode("hello") == cache.build(unnamed).encode("hello")
    assert len(cache) == 0 and cache.get(wrong) is None and cache.get(unnamed) is None
    built = cache.build(info)
    assert cache.get(info) is built and len(cache) == 1


def test_the_least_recently_used_tokenizer_is_dropped_past_the_bound(fake: FakeL4M) -> None:
    cache = TokenizerCache(max_entries=2)
    infos = []
    for template in ("a", "b", "c"):
        info = fake.info().model
        info.chat_template = template
        infos.append(info)
    first = cache.build(infos[0])
    cache.build(infos[1])
    assert cache.get(infos[0]) is first  # now the most recently used
    cache.build(infos[2])
    assert len(cache) == 2
    assert cache.get(infos[0]) is first and cache.get(infos[1]) is None and cache.get(infos[2]) is not None
