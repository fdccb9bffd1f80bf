"""Samplers: how a next-token distribution becomes a token (or a top-k list), as `SamplerSpec`s.

Sampling happens on the executor; a sampler here is only a description. `to_pb(mask)` adds an
optional vocabulary mask (BRLE, first run allowed) produced by a constraint. A sampler's parameters obey
the protocol's rules (`l4m.wire.rules`) when it is made: a bad one raises `ValueError` (a
`RuleViolation`) naming the parameter, before anything is sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from l4m.v1 import common_pb2
from l4m.wire import rules


class Sampler:
    """Base of the sampler descriptions."""

    def to_pb(self, vocabulary_mask: Sequence[int] | None = None, step: int = 0) -> common_pb2.SamplerSpec:
        raise NotImplementedError


def _with_mask(spec: common_pb2.SamplerSpec, vocabulary_mask: Sequence[int] | None) -> common_pb2.SamplerSpec:
    if vocabulary_mask is not None:
        spec.vocabulary_mask.run_lengths.extend(vocabulary_mask)
    return spec


@dataclass(frozen=True)
class Greedy(Sampler):
    """The most probable token (ties: the lowest id)."""

    def to_pb(self, vocabulary_mask: Sequence[int] | None = None, step: int = 0) -> common_pb2.SamplerSpec:
        return _with_mask(common_pb2.SamplerSpec(kind=common_pb2.SAMPLER_KIND_GREEDY), vocabulary_mask)


@dataclass(frozen=True)
class Sample(Sampler):
    """A random draw at `temperature` after top-k, then top-p, then min-p truncation.

    With a `seed`, step `i` of a generation uses seed `seed + i`: the whole generation is reproducible
    and consecutive steps still differ.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        try:
            rules.check_sample(self.temperature, self.top_k, self.top_p, self.min_p)
            rules.check_seed(self.seed)
        except rules.RuleViolation as violation:
            hint = "; use Greedy() for argmax" if self.temperature == 0 else ""
            raise rules.RuleViolation(f"Sample: {violation}{hint}") from None

    def to_pb(self, vocabulary_mask: Sequence[int] | None = None, step: int = 0) -> common_pb2.SamplerSpec:
        spec = common_pb2.SamplerSpec(
            kind=common_pb2.SAMPLER_KIND_SAMPLE,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
        )
        if self.seed is not None:
            spec.seed = rules.step_seed(self.seed, step)
        return _with_mask(spec, vocabulary_mask)


@dataclass(frozen=True)
class TopDistribution(Sampler):
    """Not a draw: the `k` most probable tokens with their probabilities (temperature 1)."""

    k: int

    def __post_init__(self) -> None:
        try:
            rules.check_distribution_top_k(self.k)
        except rules.RuleViolation as violation:
            raise rules.RuleViolation(f"TopDistribution: {violation}") from None

    def to_pb(self, vocabulary_mask: Sequence[int] | None = None, step: int = 0) -> common_pb2.SamplerSpec:
        spec = common_pb2.SamplerSpec(kind=common_pb2.SAMPLER_KIND_DISTRIBUTION, distribution_top_k=self.k)
        return _with_mask(spec, vocabulary_mask)


def greedy() -> Greedy:
    return Greedy()


def temperature(value: float, seed: int | None = None) -> Sample:
    return Sample(temperature=value, seed=seed)


def top_k(k: int, temperature: float = 1.0, seed: int | None = None) -> Sample:
    return Sample(temperature=temperature, top_k=k, seed=seed)


def top_p(p: float, temperature: float = 1.0, seed: int | None = None) -> Sample:
    return Sample(temperature=temperature, top_p=p, seed=seed)


def min_p(p: float, temperature: float = 1.0, seed: int | None = None) -> Sample:
    return Sample(temperature=temperature, min_p=p, seed=seed)
