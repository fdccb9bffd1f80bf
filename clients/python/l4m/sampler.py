"""Samplers: how a next-token distribution becomes a token (or a top-k list), as `SamplerSpec`s.

Sampling happens on the executor; a sampler here is only a description. `to_pb(mask)` adds an
optional vocabulary mask (BRLE, first run allowed) produced by a constraint.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from l4m.v1 import common_pb2


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
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (got {self.temperature}); use Greedy() for argmax")
        if not 0 <= self.top_p <= 1:
            raise ValueError(f"top_p must be in [0, 1] (got {self.top_p})")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1) (got {self.min_p})")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (got {self.top_k})")

    def to_pb(self, vocabulary_mask: Sequence[int] | None = None, step: int = 0) -> common_pb2.SamplerSpec:
        spec = common_pb2.SamplerSpec(
            kind=common_pb2.SAMPLER_KIND_SAMPLE,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
        )
        if self.seed is not None:
            spec.seed = (self.seed + step) % (1 << 64)
        return _with_mask(spec, vocabulary_mask)


@dataclass(frozen=True)
class TopDistribution(Sampler):
    """Not a draw: the `k` most probable tokens with their probabilities (temperature 1)."""

    k: int

    def __post_init__(self) -> None:
        if self.k <= 0:
            raise ValueError(f"a distribution needs k > 0 (got {self.k})")

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
