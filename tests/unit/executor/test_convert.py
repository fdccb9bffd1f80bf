"""The executor's protobuf conversion on a decode loop's path: samplers converted once per distinct bytes, and
replies filled in place (issue #19: the executor's host work per batch)."""

from __future__ import annotations

import pytest

from l4m.executor import commands as c
from l4m.executor import convert
from l4m.executor.errors import InvalidCommand
from l4m.v1 import common_pb2, executor_pb2

GREEDY = common_pb2.SamplerSpec(kind=common_pb2.SAMPLER_KIND_GREEDY)


def forward_text_request(*samplers: common_pb2.SamplerSpec) -> executor_pb2.ExecuteRequest:
    items = [common_pb2.ForwardTextItem(kv_page_ids=[n], kv_last_page_length=1, token_ids=[5], position_ids=[0],
                                        output_indices=[0], samplers=[sampler]) for n, sampler in enumerate(samplers)]
    return executor_pb2.ExecuteRequest(correlation_id=1, forward_text=executor_pb2.BatchForwardText(items=items))


@pytest.fixture(autouse=True)
def empty_sampler_cache() -> None:
    convert._SAMPLERS.clear()


def test_a_sampler_sent_again_is_the_object_converted_the_first_time() -> None:
    sample = common_pb2.SamplerSpec(kind=common_pb2.SAMPLER_KIND_SAMPLE, temperature=0.7, top_k=40, seed=3)
    first = convert.batch_from_pb(forward_text_request(GREEDY, sample))
    again = convert.batch_from_pb(forward_text_request(sample, GREEDY, GREEDY))
    assert again[0].samplers[0] is first[1].samplers[0]
    assert again[1].samplers[0] is again[2].samplers[0] is first[0].samplers[0]
    assert first[1].samplers[0] == c.SamplerSpec(c.SamplerKind.SAMPLE, temperature=pytest.approx(0.7), top_k=40, seed=3)
    other_seed = common_pb2.SamplerSpec(kind=common_pb2.SAMPLER_KIND_SAMPLE, temperature=0.7, top_k=40, seed=4)
    assert convert.batch_from_pb(forward_text_request(other_seed))[0].samplers[0].seed == 4


def test_samplers_with_per_token_data_are_converted_every_time_and_never_kept() -> None:
    masked = common_pb2.SamplerSpec(kind=common_pb2.SAMPLER_KIND_GREEDY,
                                    vocabulary_mask=common_pb2.Brle(run_lengths=[3, 2]))
    biased = common_pb2.SamplerSpec(kind=common_pb2.SAMPLER_KIND_GREEDY, logit_bias_token_ids=[7],
                                    logit_bias_values=[-1.5])
    first = convert.batch_from_pb(forward_text_request(masked, biased))
    again = convert.batch_from_pb(forward_text_request(masked, biased))
    assert first[0].samplers[0] == again[0].samplers[0] and first[0].samplers[0] is not again[0].samplers[0]
    assert again[0].samplers[0].vocab_mask == (3, 2)
    assert again[1].samplers[0].logit_bias_token_ids == (7,) and again[1].samplers[0].logit_bias_values == (-1.5,)
    assert convert._SAMPLERS == {}


def test_an_unknown_sampler_kind_is_refused_every_time() -> None:
    unknown = common_pb2.SamplerSpec(kind=0)
    for _ in range(2):
        with pytest.raises(InvalidCommand, match="sampler kind 0 is unspecified or unknown") as caught:
            convert.batch_from_pb(forward_text_request(GREEDY, unknown))
        assert caught.value.item_index == 1
    assert len(convert._SAMPLERS) == 1  # the greedy one


def test_a_client_sending_a_new_sampler_every_time_costs_a_bounded_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(convert, "_MAX_SAMPLERS", 4)
    for seed in range(10):
        spec = common_pb2.SamplerSpec(kind=common_pb2.SAMPLER_KIND_SAMPLE, seed=seed)
        assert convert.batch_from_pb(forward_text_request(spec))[0].samplers[0].seed == seed
        assert len(convert._SAMPLERS) <= 4


def test_a_reply_holds_every_output_as_built_message_by_message() -> None:
    batch = convert.batch_from_pb(forward_text_request(GREEDY, GREEDY, GREEDY))
    results = [
        c.ForwardTextResult((c.SampledToken(11, -0.25),)),
        c.ForwardTextResult((c.SampledToken(12, -1.0, (12, 40), (-1.0, -2.5)), c.SampledToken(13, -0.5))),
        c.ForwardTextResult((c.Distribution((4, 9, 1), (0.5, 0.25, 0.125)),)),
    ]
    expected = executor_pb2.ExecuteResponse(correlation_id=9, forward_text=executor_pb2.BatchForwardTextResult(items=[
        common_pb2.ForwardTextResult(outputs=[common_pb2.OutputResult(token=common_pb2.SampledToken(
            token_id=11, logprob=-0.25))]),
        common_pb2.ForwardTextResult(outputs=[
            common_pb2.OutputResult(token=common_pb2.SampledToken(token_id=12, logprob=-1.0, top_token_ids=[12, 40],
                                                                  top_logprobs=[-1.0, -2.5])),
            common_pb2.OutputResult(token=common_pb2.SampledToken(token_id=13, logprob=-0.5))]),
        common_pb2.ForwardTextResult(outputs=[common_pb2.OutputResult(distribution=common_pb2.Distribution(
            token_ids=[4, 9, 1], probabilities=[0.5, 0.25, 0.125]))]),
    ]))
    assert convert.reply_to_pb(9, batch, results) == expected
    empty = convert.reply_to_pb(9, batch, [c.ForwardTextResult(())] * 3)  # answered, with no outputs
    assert [len(item.outputs) for item in empty.forward_text.items] == [0, 0, 0]
