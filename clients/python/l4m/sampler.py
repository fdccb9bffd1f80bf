"""Samplers: how a next-token distribution becomes a token (or a top-k list), as `SamplerSpec`s.

Sampling happens on the executor; a sampler here is only a description. `to_pb(mask)` adds an
optional vocabulary mask (BRLE, first run allowed) produced by a constraint. A sampler's parameters obey
the protocol's rules (`l4m.wire.rules`) when it is made: a bad one raises `ValueError` (a
`RuleViolation`) naming the parameter, before anything is sent.

`Greedy` and `Sample` also shape the distribution, as OpenAI's options do:
- `logit_bias` {token id: bias}, added to those logits before anything else (the executor does it);
- `presence_penalty` / `frequency_penalty`, against the tokens generated so far in the generation:
  logit -= frequency_penalty * count + presence_penalty * (count > 0). The penalties change every step,
  so `Context.generate` folds them into the step's logit bias (`penalized`) and steps one token per
  forward pass while they are set (no continuation); a controller stepping by hand calls
  `sampler.penalized(its_generated_ids)` itself;
- `top_logprobs` k in [0, 20]: each sampled token comes with the k most probable tokens of its step
  and their logprobs (`SampledToken.top_logprobs`, `Token.top_logprobs`).
Every returned probability and logprob is of the biased (and penalized) distribution at temperature 1.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from l4m.v1 import common_pb2
from l4m.wire import rules


class Sampler:
    """Base of the sampler descriptions."""

    def to_pb(self, vocabulary_mask: Sequence[int] | None = None, step: int = 0) -> common_pb2.SamplerSpec:
        raise NotImplementedError

    @property
    def has_penalties(self) -> bool:
        """Whether each step's bias depends on the tokens generated before it."""
        return False

    def penalized(self, generated_token_ids: Iterable[int]) -> Sampler:
        """This sampler for the next step of a generation that generated `generated_token_ids`."""
        return self


@dataclass(frozen=True, kw_only=True)  # keyword-only: after a subclass's own (positional) fields
class _Shaping(Sampler):
    """The distribution-shaping options `Greedy` and `Sample` share (see the module docstring).

    `logit_bias` may be given as a mapping; it is kept as ((token id, bias), ...) sorted by id, so the
    sampler stays hashable."""

    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: int = 0

    def _check_shaping(self) -> None:
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        bias = tuple(sorted((int(t), float(v)) for t, v in pairs))
        object.__setattr__(self, "logit_bias", bias)
        rules.check_logit_bias([t for t, _ in bias], [v for _, v in bias])
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise rules.RuleViolation(f"{name} {getattr(self, name)} is not finite")
        rules.check_top_logprobs(self.top_logprobs)

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)

    def penalized(self, generated_token_ids: Iterable[int]) -> Sampler:
        """The penalties folded into the logit bias for the next step (OpenAI's and vLLM's rule):
        bias[t] -= frequency_penalty * count(t) + presence_penalty, for every t generated so far."""
        if not self.has_penalties:
            return self
        bias = dict(self.logit_bias)  # type: ignore[arg-type]
        for token_id, count in Counter(generated_token_ids).items():
            bias[token_id] = bias.get(token_id, 0.0) - self.frequency_penalty * count - self.presence_penalty
        return dataclasses.replace(self, logit_bias=bias, presence_penalty=0.0, frequency_penalty=0.0)

    def _shaped(self, spec: common_pb2.SamplerSpec) -> common_pb2.SamplerSpec:
        if self.has_penalties:
            raise rules.RuleViolation("a sampler with penalties needs the tokens generated so far: send "
                                      "sampler.penalized(generated_token_ids) (Context.generate does)")
        if self.logit_bias:
            spec.logit_bias_token_ids.extend(t for t, _ in self.logit_bias)  # type: ignore[union-attr]
            spec.logit_bias_values.extend(v for _, v in self.logit_bias)  # type: ignore[union-attr]
        spec.top_logprobs = self.top_logprobs
        return spec


def _with_mask(spec: common_pb2.SamplerSpec, vocabulary_mask: Sequence[int] | None) -> common_pb2.SamplerSpec:
    if vocabulary_mask is not None:
        spec.vocabulary_mask.run_lengths.extend(vocabulary_mask)
    return spec


@dataclass(frozen=True)
class Greedy(_Shaping):
    """The most probable token (ties: the lowest id), after the logit bias and penalties."""

    def __post_init__(self) -> None:
        try:
            self._check_shaping()
        except rules.RuleViolation as violation:
            raise rules.RuleViolation(f"Greedy: {violation}") from None

    def to_pb(self, vocabulary_mask: Sequence[int] | None = None, step: int = 0) -> common_pb2.SamplerSpec:
        spec = self._shaped(common_pb2.SamplerSpec(kind=common_pb2.SAMPLER_KIND_GREEDY))
        return _with_mask(spec, vocabulary_mask)


@dataclass(frozen=True)
class Sample(_Shaping):
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
            self._check_shaping()
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
        return _with_mask(self._shaped(spec), vocabulary_mask)


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
