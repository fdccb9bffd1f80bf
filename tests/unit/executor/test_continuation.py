"""Continuation on the executor: a forward_text item that decodes on by itself gives exactly what one
forward_text per token gives (tokens and logprobs), batched with other items; bad continuation items
are refused before anything changes."""

from __future__ import annotations

import dataclasses

import pytest

from l4m.executor.commands import Allocate, ForwardText, ResourceKind, SamplerKind, SamplerSpec
from l4m.executor.errors import InvalidCommand
from l4m.wire.rules import MAX_CONTINUATION_STEPS

PAGE_SIZE = 4
GREEDY = SamplerSpec(SamplerKind.GREEDY)
SEEDED = SamplerSpec(SamplerKind.SAMPLE, temperature=1.2, top_k=40, seed=77)


def _item(pages: range, tokens: list[int], start: int, sampler: SamplerSpec = GREEDY, num_steps: int = 0,
          stop_token_ids: frozenset[int] = frozenset()) -> ForwardText:
    """`tokens` at positions start.., in pages that also hold room for `num_steps` continuation tokens."""
    total = start + len(tokens) + num_steps
    num_pages = -(-total // PAGE_SIZE)
    return ForwardText(tuple(pages[:num_pages]), total - PAGE_SIZE * (num_pages - 1), tuple(tokens),
                       tuple(range(start, start + len(tokens))), (), (len(tokens) - 1,), (sampler,), num_steps,
                       stop_token_ids)


def _stepwise(engine, pages: range, prompt: list[int], num_tokens: int, sampler: SamplerSpec) -> list[tuple[int, float]]:  # type: ignore[no-untyped-def]
    """One forward_text per token, the SDK's way: step i of a seeded sampler draws with seed + i."""
    out = []
    tokens, start = prompt, 0
    for step in range(num_tokens):
        spec = dataclasses.replace(sampler, seed=sampler.seed + step) if sampler.seed is not None else sampler
        (result,) = engine.forward_text([_item(pages, tokens, start, spec)])
        token = result.outputs[0]
        out.append((token.token_id, token.logprob))
        start += len(tokens)
        tokens = [token.token_id]
    return out


def _engine(make_engine):  # type: ignore[no-untyped-def]
    engine = make_engine(page_size=PAGE_SIZE, num_pages=64)
    engine.allocate([Allocate(ResourceKind.KV_PAGE, tuple(range(48)))])
    return engine


def _close(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> None:
    assert [t for t, _ in a] == [t for t, _ in b]
    assert max(abs(x - y) for (_, x), (_, y) in zip(a, b, strict=True)) < 1e-4


def test_a_batch_with_and_without_continuation_equals_each_item_step_by_step(make_engine, prompts) -> None:  # type: ignore[no-untyped-def]
    pages_a, pages_b, pages_c = range(0, 16), range(16, 32), range(32, 48)
    a, b, c = prompts[0][:9], prompts[1][:6], prompts[2][:3]  # a straddles pages; c decodes 11 steps
    expected_a = _stepwise(_engine(make_engine), pages_a, a, 8, GREEDY)
    expected_b = _stepwise(_engine(make_engine), pages_b, b, 1, GREEDY)
    expected_c = _stepwise(_engine(make_engine), pages_c, c, 12, SEEDED)
    engine = _engine(make_engine)
    results = engine.forward_text([
        _item(pages_a, a, 0, GREEDY, num_steps=7),
        _item(pages_b, b, 0, GREEDY),  # no continuation: answered with the batch
        _item(pages_c, c, 0, SEEDED, num_steps=11),
    ])
    outputs = [[(o.token_id, o.logprob) for o in r.outputs] for r in results]
    _close(outputs[0], expected_a)
    _close(outputs[1], expected_b)
    _close(outputs[2], expected_c)
    # The KV the continuation wrote is the KV a step-by-step run writes: going on from it agrees too.
    (more,) = engine.forward_text([_item(pages_a, [outputs[0][-1][0]], 9 + 7)])
    reference = _engine(make_engine)
    expected_more = _stepwise(reference, pages_a, a, 9, GREEDY)
    assert more.outputs[0].token_id == expected_more[-1][0]


def test_a_stop_token_ends_the_loop_and_is_the_last_output(make_engine, prompts) -> None:  # type: ignore[no-untyped-def]
    pages = range(0, 16)
    expected = _stepwise(_engine(make_engine), pages, prompts[3][:7], 10, GREEDY)
    stop_at = next(i for i, (t, _) in enumerate(expected) if i >= 2 and t not in [u for u, _ in expected[:i]])
    engine = _engine(make_engine)
    (result,) = engine.forward_text([_item(pages, prompts[3][:7], 0, GREEDY, num_steps=9,
                                           stop_token_ids=frozenset({expected[stop_at][0]}))])
    _close([(o.token_id, o.logprob) for o in result.outputs], expected[: stop_at + 1])


def _refused(engine, item: ForwardText, reason: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidCommand, match=reason):
        engine.forward_text([item])


def test_bad_continuation_items_are_refused_before_anything_changes(make_engine, prompts) -> None:  # type: ignore[no-untyped-def]
    engine = _engine(make_engine)
    pages = range(0, 16)
    good = _item(pages, prompts[0][:5], 0, GREEDY, num_steps=3)
    cases = [
        (dataclasses.replace(good, num_continuation_steps=MAX_CONTINUATION_STEPS + 1),
         f"not in \\[0, max_continuation_steps={MAX_CONTINUATION_STEPS}\\]"),
        (dataclasses.replace(good, attention_mask=((1,), (2,), (3,), (4,), (5,))), "attention_masks must be empty"),
        (dataclasses.replace(good, output_indices=(2,)), "the last token's"),
        (dataclasses.replace(good, samplers=(SamplerSpec(SamplerKind.DISTRIBUTION, distribution_top_k=3),)),
         "GREEDY or SAMPLE"),
        (dataclasses.replace(good, samplers=(dataclasses.replace(GREEDY, vocab_mask=(10, 49142)),)),
         "without a vocabulary mask"),
        (dataclasses.replace(good, continuation_stop_token_ids=frozenset({10**6})), "continuation_stop_token_ids holds token id 1000000"),
        # Pages with room for the 5 tokens but not the 3 continuation tokens (the length rule counts them).
        (dataclasses.replace(good, kv_page_ids=(0, 1), kv_last_page_length=1), "do not fit"),
        (dataclasses.replace(good, position_ids=(8187, 8188, 8189, 8190, 8191)), "pass max_context_tokens 8192"),
    ]
    for item, reason in cases:
        _refused(engine, item, reason)
    # Nothing was written: the good item now gives what a fresh engine gives.
    (result,) = engine.forward_text([good])
    (fresh,) = _engine(make_engine).forward_text([good])
    assert [o.token_id for o in result.outputs] == [o.token_id for o in fresh.outputs]
    assert len(result.outputs) == 4


def test_two_items_whose_continuations_would_write_the_same_slot_are_refused(make_engine, prompts) -> None:  # type: ignore[no-untyped-def]
    engine = _engine(make_engine)
    first = _item(range(0, 16), prompts[0][:3], 0, GREEDY, num_steps=6)  # writes slots 0..8: pages 0-2
    second = _item(range(2, 18), prompts[1][:2], 0, GREEDY)  # writes page 2's first slots
    with pytest.raises(InvalidCommand, match="same kv page slot"):
        engine.forward_text([first, second])
