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
