import re

import pytest

from l4m import stop
from l4m.sampler import Greedy, Sample, TopDistribution, min_p, temperature, top_k, top_p
from l4m.v1 import common_pb2


def test_samplers_become_specs() -> None:
    assert Greedy().to_pb().kind == common_pb2.SAMPLER_KIND_GREEDY
    spec = top_k(40, temperature=0.7).to_pb()
    assert (spec.kind, spec.top_k, round(spec.temperature, 3)) == (common_pb2.SAMPLER_KIND_SAMPLE, 40, 0.7)
    assert round(top_p(0.9).to_pb().top_p, 3) == 0.9
    assert round(min_p(0.05).to_pb().min_p, 3) == 0.05
    assert not temperature(1.0).to_pb().HasField("seed")
    distribution = TopDistribution(5).to_pb()
    assert (distribution.kind, distribution.distribution_top_k) == (common_pb2.SAMPLER_KIND_DISTRIBUTION, 5)


def test_seeded_sampler_varies_per_step_and_carries_the_mask() -> None:
    sampler = Sample(temperature=0.8, seed=7)
    assert [sampler.to_pb(step=i).seed for i in range(3)] == [7, 8, 9]
    assert list(Greedy().to_pb([0, 3, 2]).vocabulary_mask.run_lengths) == [0, 3, 2]


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"temperature": 0}, "temperature 0 is not a finite number > 0; use Greedy() for argmax"),
    ({"temperature": float("nan")}, "temperature nan"),
    ({"top_p": 1.5}, "top_p 1.5 is not in [0, 1]"),
    ({"min_p": 1.0}, "min_p 1.0 is not in [0, 1)"),
    ({"top_k": -1}, "top_k -1 is not in [0, vocab_size]"),
    ({"seed": -1}, "seed -1 is not in [0, 2^64 - 1]"),
])
def test_bad_sampler_settings_say_what_is_wrong(kwargs: dict, reason: str) -> None:
    """The SDK checks with the protocol's rulebook, so the message is the one the scheduler would trap with."""
    with pytest.raises(ValueError, match=re.escape(f"Sample: {reason}")):
        Sample(**kwargs)
    with pytest.raises(ValueError, match=re.escape("TopDistribution: distribution_top_k 0 is not in [1, vocab_size]")):
        TopDistribution(0)


def test_stop_conditions() -> None:
    assert stop.on_tokens([2]).check([5, 2], "") == stop.Stop("token")
    assert stop.on_tokens([2]).check([5], "") is None
    assert stop.max_tokens(2).check([1, 2], "ab") == stop.Stop("length")
    strings = stop.on_strings("\n\n", "END")
    assert strings.check([1], "hello END more") == stop.Stop("string", 6)
    assert strings.holdback("hello EN") == 2
    assert strings.holdback("hello\n") == 1
    assert strings.holdback("hello") == 0
    either = stop.on_tokens([2]) | stop.max_tokens(3)
    assert either.check([1, 1, 1], "") == stop.Stop("length")
    assert stop.any_of(stop.on_strings("x")).holdback("") == 0
    with pytest.raises(ValueError):
        stop.on_strings("")
