"""`Model.load` leaves the tokenizer (the bulk of GetInfo) out when the session can fetch it later: a
controller that only feeds and reads token ids never transfers it; one that tokenizes fetches it once."""

from __future__ import annotations

from l4m import Greedy, stop
from l4m.fake import FakeL4M
from l4m.model import Model
from l4m.session import Session


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


def test_the_first_tokenization_fetches_the_tokenizer_once(run, fake: FakeL4M) -> None:
    async def body() -> tuple[list[int], list[int], str]:
        session = _lazy_session(fake)
        try:
            model = await Model.load(session)
            c = model.new_context()
            c.fill("hello there")
            c.fill(" again")
            completion = await c.generate(Greedy(), stop=stop.max_tokens(3))
            return c.token_ids, completion.token_ids, completion.text
        finally:
            await session.close()

    lazy_ids, lazy_tokens, lazy_text = run(body())
    assert fake.stats.num_get_info == 2  # load, then one fetch at the first fill(text)

    eager = FakeL4M(kv_page_size=4)

    async def eager_body() -> tuple[list[int], list[int], str]:
        session = Session(eager.stub())  # cannot fetch later: load asks for everything
        try:
            model = await Model.load(session)
            assert model.info.tokenizer_json
            c = model.new_context()
            c.fill("hello there")
            c.fill(" again")
            completion = await c.generate(Greedy(), stop=stop.max_tokens(3))
            return c.token_ids, completion.token_ids, completion.text
        finally:
            await session.close()

    assert run(eager_body()) == (lazy_ids, lazy_tokens, lazy_text)
    assert eager.stats.num_get_info == 1
