"""Logit bias and top logprobs on every sampler path: synthetic logits, the engine's forward_text (per-op
and static decode step) and continuation (which leaves the device loop for the host loop)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from l4m.executor.commands import Distribution, SampledToken, SamplerKind, SamplerSpec
from l4m.executor.errors import InvalidCommand
from l4m.executor.sampler import apply_samplers
from l4m.wire import rules
from tests.unit.executor.conftest import PageTables, engine_stats
from tests.unit.executor.test_decode_graphs import _continuation_batch, _engine

V = 64


def _logits(seed: int, rows: int = 1) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def _biased(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    out = logits.clone()
    for token, value in bias.items():
        out[:, token] += value
    return out


def _spec(kind: SamplerKind = SamplerKind.GREEDY, bias: dict[int, float] | None = None, **fields) -> SamplerSpec:
    bias = bias or {}
    return SamplerSpec(kind, logit_bias_token_ids=tuple(bias), logit_bias_values=tuple(bias.values()), **fields)


def test_a_bias_moves_the_greedy_argmax_and_its_logprob() -> None:
    logits = _logits(1)
    runner_up = int(logits[0].argsort(descending=True)[1])
    bias = {runner_up: 100.0, int(logits[0].argmax()): -100.0}
    (plain, biased) = apply_samplers(logits.repeat(2, 1), [_spec(), _spec(bias=bias)], None)
    assert plain.token_id == int(logits[0].argmax()) and biased.token_id == runner_up
    want = float(torch.log_softmax(_biased(logits, bias)[0], -1)[runner_up])
    assert math.isclose(biased.logprob, want, abs_tol=1e-5)


def test_a_bias_applies_before_the_mask_and_to_samples_and_distributions() -> None:
    logits = _logits(2)
    target = int(logits[0].argmin())
    bias = {target: 1000.0}
    allowed = np.ones((3, V), dtype=bool)
    allowed[2, target] = False  # the mask still wins over the bias
    specs = [_spec(SamplerKind.SAMPLE, bias, temperature=1.0, seed=3),
             _spec(SamplerKind.DISTRIBUTION, bias, distribution_top_k=2), _spec(bias=bias)]
    sample, dist, masked = apply_samplers(logits.repeat(3, 1), specs, allowed)
    assert isinstance(sample, SampledToken) and sample.token_id == target
    assert isinstance(dist, Distribution) and dist.token_ids[0] == target and dist.probs[0] > 0.999
    assert masked.token_id != target and masked.token_id == int(logits[0].argmax())


def test_penalties_folded_into_the_bias_match_a_hand_computation() -> None:
    """OpenAI's rule: logit -= frequency * count + presence * (count > 0), over the tokens generated."""
    logits = _logits(3)
    generated = [5, 5, 5, 9, 12, 12]
    frequency, presence = 0.7, 1.3
    counts = {t: generated.count(t) for t in set(generated)}
    bias = {t: -(frequency * c + presence) for t, c in counts.items()}
    (got,) = apply_samplers(logits, [_spec(bias=bias, top_logprobs=V)], None)
    by_hand = logits[0].clone()
    by_hand[5] -= 0.7 * 3 + 1.3
    by_hand[9] -= 0.7 * 1 + 1.3
    by_hand[12] -= 0.7 * 2 + 1.3
    want = torch.log_softmax(by_hand, -1)
    assert got.token_id == int(by_hand.argmax())
    np.testing.assert_allclose(np.array(got.top_logprobs), want[list(got.top_token_ids)].numpy(), atol=1e-5)


@pytest.mark.parametrize("kind", [SamplerKind.GREEDY, SamplerKind.SAMPLE])
def test_top_logprobs_are_the_log_softmax_top_k(kind: SamplerKind) -> None:
    logits = _logits(4, 3)
    specs = [_spec(kind, top_logprobs=k, temperature=0.7, seed=1) for k in (1, 5, rules.MAX_TOP_LOGPROBS)]
    results = apply_samplers(logits, specs, None)
    reference = torch.log_softmax(logits, -1)
    for row, (spec, got) in enumerate(zip(specs, results, strict=True)):
        values, ids = reference[row].topk(spec.top_logprobs)
        assert got.top_token_ids == tuple(ids.tolist())
        np.testing.assert_allclose(got.top_logprobs, values.numpy(), atol=1e-5)
        assert math.isclose(got.logprob, float(reference[row, got.token_id]), abs_tol=1e-5)
    (none,) = apply_samplers(logits[:1], [_spec()], None)
    assert none.top_token_ids == () and none.top_logprobs == ()


def test_top_logprobs_respect_the_mask_and_bias() -> None:
    logits = _logits(5)
    allowed = np.zeros((1, V), dtype=bool)
    allowed[0, [3, 7, 11]] = True
    (got,) = apply_samplers(logits, [_spec(bias={7: 50.0}, top_logprobs=5)], allowed)
    assert got.top_token_ids[0] == 7 and set(got.top_token_ids[:3]) == {3, 7, 11}
    assert all(v == -math.inf for v in got.top_logprobs[3:])


def _item(engine, prompt: list[int], spec: SamplerSpec):  # type: ignore[no-untyped-def]
    tables = PageTables(engine)
    return dataclasses.replace(tables.item("a", prompt, outputs=(len(prompt) - 1,)), samplers=(spec,))


def test_the_engine_honours_bias_and_top_logprobs(make_engine, prompts) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    (plain,) = engine.forward_text([_item(engine, prompts[0], _spec(top_logprobs=3))])
    out = plain.outputs[0]
    assert out.top_token_ids[0] == out.token_id and out.top_logprobs[0] == pytest.approx(out.logprob, abs=1e-5)
    engine = make_engine()
    banned = {out.token_id: -100.0}
    (biased,) = engine.forward_text([_item(engine, prompts[0], _spec(bias=banned, top_logprobs=3))])
    assert biased.outputs[0].token_id == out.top_token_ids[1]


@pytest.mark.parametrize(("spec", "reason"), [
    (_spec(bias={10**6: 1.0}), "logit_bias_token_ids holds token id 1000000"),
    (_spec(bias={3: math.nan}), "logit_bias value nan of token 3 is not finite"),
    (_spec(bias={3: math.inf}), "logit_bias value inf of token 3 is not finite"),
    (SamplerSpec(logit_bias_token_ids=(3, 3), logit_bias_values=(1.0, 1.0)), "lists a token id twice"),
    (SamplerSpec(logit_bias_token_ids=(3,), logit_bias_values=()), "they must match"),
    (SamplerSpec(logit_bias_token_ids=tuple(range(rules.MAX_LOGIT_BIAS_ENTRIES + 1)),
                 logit_bias_values=(0.0,) * (rules.MAX_LOGIT_BIAS_ENTRIES + 1)), "more than 65536"),
    (_spec(top_logprobs=21), r"top_logprobs 21 is not in \[0, 20\]"),
    (_spec(SamplerKind.DISTRIBUTION, distribution_top_k=2, top_logprobs=2), "must be 0 for a DISTRIBUTION"),
])
def test_bad_bias_and_top_logprobs_are_refused_naming_the_field(make_engine, prompts, spec, reason) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    with pytest.raises(InvalidCommand, match=reason):
        engine.forward_text([_item(engine, prompts[0], spec)])


def test_biased_greedy_continuation_takes_the_host_loop_and_matches_stepwise(loaded, prompts) -> None:  # type: ignore[no-untyped-def]
    """The device loop is a plain argmax: a bias or top_logprobs takes the host loop (still the static
    step), and every step keeps the bias and returns its alternatives."""
    host = _engine(loaded, static=False)
    probe = host.forward_text(_continuation_batch(host, [prompts[0]], [4], [frozenset()],
                                                  SamplerSpec(SamplerKind.GREEDY)))[0]
    engine = _engine(loaded, static=True)
    banned = {probe.outputs[2].token_id: -100.0}
    spec = _spec(bias=banned, top_logprobs=2)
    (got,) = engine.forward_text(_continuation_batch(engine, [prompts[0]], [4], [frozenset()], spec))
    assert engine_stats(engine)["num_device_continuation_steps"] == 0
    assert len(got.outputs) == 5
    assert all(o.token_id not in banned and len(o.top_token_ids) == 2 for o in got.outputs)
    assert all(o.top_token_ids[0] == o.token_id for o in got.outputs)
    first_banned = [o.token_id for o in probe.outputs].index(probe.outputs[2].token_id)
    assert [o.token_id for o in got.outputs[:first_banned]] == [o.token_id for o in probe.outputs[:first_banned]]

