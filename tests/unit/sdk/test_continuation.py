"""Continuation (`Context.step_many`, used by `generate` when only token ids decide the next step): the
same tokens, logprobs, text and context state as one round trip per token, with far fewer commands."""

from __future__ import annotations

from typing import Any

import pytest

from l4m import Greedy, Sample, stop
from l4m.errors import L4MError
from l4m.fake import FakeL4M
from l4m.stop import Stop, StopCondition

PROMPT = list(range(10, 30))


def _forward_texts(fake: FakeL4M) -> list[Any]:
    return [c.forward_text for c in fake.commands if c.WhichOneof("command") == "forward_text"]


def _run_generation(run, open_model, fake: FakeL4M, **generate: Any) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    then_more = generate.pop("then_more", False)

    async def body() -> dict[str, Any]:
        model = await open_model(fake)
        c = model.new_context()
        c.fill(PROMPT)
        tokens = [t async for t in c.generate(**generate)]
        # Going on step by step afterwards reads the KV the continuation wrote.
        completion = await c.generate(Greedy(), stop=stop.max_tokens(3), max_continuation_steps=0) if then_more else None
        state = {"token_ids": c.token_ids, "num_kv_slots": c.num_kv_slots, "pages": len(c.kv_page_ids),
                 "pending": c.num_pending_tokens, "next_position": c.next_position}
        await c.free()
        return {"tokens": [(t.token_id, round(t.logprob, 6), t.text) for t in tokens], "state": state,
                "more": completion.token_ids if completion else None}

    return run(body())


@pytest.mark.parametrize("sampler", [Greedy(), Sample(temperature=1.3, seed=11), Sample(top_k=5, seed=3)])
def test_continuation_gives_what_one_step_at_a_time_gives(run, open_model, sampler) -> None:  # type: ignore[no-untyped-def]
    stepwise_fake, continued_fake = FakeL4M(kv_page_size=4), FakeL4M(kv_page_size=4)
    stepwise = _run_generation(run, open_model, stepwise_fake, sampler=sampler, stop=stop.max_tokens(30),
                               max_continuation_steps=0)
    continued = _run_generation(run, open_model, continued_fake, sampler=sampler, stop=stop.max_tokens(30))
    assert continued == stepwise and len(continued["tokens"]) == 30
    assert len(_forward_texts(stepwise_fake)) == 30
    # The prompt pass alone (the first token is not held back), then 9 tokens per command three times (28),
    # then the last 2 in one command.
    assert [f.num_continuation_steps for f in _forward_texts(continued_fake)] == [0, 8, 8, 8, 1]


def test_a_stop_token_ends_continuation_early_and_frees_the_pages_it_did_not_use(run, open_model) -> None:  # type: ignore[no-untyped-def]
    # The token the stepwise run samples 4th stops both runs there, in the middle of a continuation.
    probe = _run_generation(run, open_model, FakeL4M(kv_page_size=4), stop=stop.max_tokens(12),
                            max_continuation_steps=0)
    stop_token = probe["tokens"][3][0]
    assert stop_token not in [t[0] for t in probe["tokens"][:3]]
    stepwise = _run_generation(run, open_model, FakeL4M(kv_page_size=4), stop=stop.on_tokens([stop_token]),
                               max_tokens=12, max_continuation_steps=0, then_more=True)
    fake = FakeL4M(kv_page_size=4)
    continued = _run_generation(run, open_model, fake, stop=stop.on_tokens([stop_token]), max_tokens=12,
                                then_more=True)
    assert continued == stepwise
    assert [t[0] for t in continued["tokens"]][-1] == stop_token and len(continued["tokens"]) == 4
    (_, second, *_) = _forward_texts(fake)
    assert list(second.continuation_stop_token_ids) == [stop_token] and second.num_continuation_steps == 8


class _ReadsTokens(StopCondition):
    """A condition of a type the SDK does not know: every step must come back to it."""

    def check(self, token_ids, text):  # type: ignore[no-untyped-def]
        return Stop("custom") if len(token_ids) >= 5 else None


@pytest.mark.parametrize("generate", [
    {"stop": stop.on_strings("zz") | stop.max_tokens(6)},  # reads the text
    {"stop": _ReadsTokens()},  # unknown to the SDK
    {"stop": stop.max_tokens(6), "max_continuation_steps": 0},
])
def test_what_must_see_every_token_gets_every_token(run, open_model, generate) -> None:  # type: ignore[no-untyped-def]
    fake = FakeL4M(kv_page_size=4)
    result = _run_generation(run, open_model, fake, **generate)
    assert all(f.num_continuation_steps == 0 for f in _forward_texts(fake))
    assert len(_forward_texts(fake)) == len(result["tokens"])


def test_a_scheduler_without_continuation_gets_one_step_at_a_time(run, open_model) -> None:  # type: ignore[no-untyped-def]
    fake = FakeL4M(kv_page_size=4, max_continuation_steps=0)
    result = _run_generation(run, open_model, fake, stop=stop.max_tokens(7))
    assert len(result["tokens"]) == 7 and len(_forward_texts(fake)) == 7

    async def too_many() -> None:
        model = await open_model(fake)
        c = model.new_context()
        c.fill(PROMPT)
        await c.step_many(Greedy(), 4)

    with pytest.raises(L4MError, match="num_continuation_steps must be in 0..0"):
        run(too_many())


def test_a_window_decodes_step_by_step(run, open_model) -> None:  # type: ignore[no-untyped-def]
    fake = FakeL4M(kv_page_size=4)

    async def body() -> int:
        model = await open_model(fake)
        c = model.new_context()
        c.set_window(8)
        c.fill(PROMPT)
        completion = await c.generate(stop=stop.max_tokens(6))
        return len(completion.token_ids)

    assert run(body()) == 6
    assert all(f.num_continuation_steps == 0 for f in _forward_texts(fake))


def test_a_fork_after_continuation_sees_the_tokens_the_executor_fed(run, open_model) -> None:  # type: ignore[no-untyped-def]
    async def body(max_continuation_steps: int) -> tuple[list[int], list[int]]:
        model = await open_model(FakeL4M(kv_page_size=4))
        c = model.new_context()
        c.fill(PROMPT)
        await c.generate(stop=stop.max_tokens(10), max_continuation_steps=max_continuation_steps)
        child = c.fork()
        tail = await child.generate(stop=stop.max_tokens(5), max_continuation_steps=max_continuation_steps)
        return child.token_ids, tail.token_ids

    assert run(body(8)) == run(body(0))
