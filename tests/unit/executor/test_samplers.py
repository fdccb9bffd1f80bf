"""Samplers on synthetic logits (fast, property-based) and through the engine."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from l4m.executor.commands import Distribution, SampledToken, SamplerKind, SamplerSpec
from l4m.executor.quant import kernels_available
from l4m.executor.sampler import MIN_SAMPLE_TEMPERATURE, apply_samplers, decode_vocab_masks
from l4m.wire import brle

V = 64


def logits_of(seed: int, rows: int = 1) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_greedy_is_argmax_and_logprob_is_log_softmax(seed: int) -> None:
    logits = logits_of(seed, 3)
    results = apply_samplers(logits, [SamplerSpec(SamplerKind.GREEDY)] * 3, None)
    for row, r in enumerate(results):
        assert isinstance(r, SampledToken) and r.token_id == int(logits[row].argmax())
        assert math.isclose(r.logprob, float(torch.log_softmax(logits[row], -1).max()), abs_tol=1e-5)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), sample_seed=st.integers(0, 2**63 - 1))
def test_seeded_sample_is_reproducible_whatever_else_is_in_the_batch(seed: int, sample_seed: int) -> None:
    logits = logits_of(seed, 2)
    spec = SamplerSpec(SamplerKind.SAMPLE, temperature=1.5, seed=sample_seed)
    alone = apply_samplers(logits[:1], [spec], None)[0]
    together = apply_samplers(logits, [spec, SamplerSpec(SamplerKind.SAMPLE)], None)[0]
    assert alone == together


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    top_k=st.integers(1, 8),
    top_p=st.floats(0.05, 0.95),
    min_p=st.floats(0.01, 0.9),
)
def test_truncations_restrict_support(seed: int, top_k: int, top_p: float, min_p: float) -> None:
    logits = logits_of(seed)[0]
    probs = torch.softmax(logits, -1)
    order = probs.argsort(descending=True).tolist()
    nucleus_size = int((probs[order].cumsum(0) - probs[order] < top_p).sum())
    for spec, allowed in (
        (SamplerSpec(SamplerKind.SAMPLE, top_k=top_k), set(order[:top_k])),
        (SamplerSpec(SamplerKind.SAMPLE, top_p=top_p), set(order[:nucleus_size])),
        (
            SamplerSpec(SamplerKind.SAMPLE, min_p=min_p),
            {t for t in range(V) if probs[t] >= min_p * probs.max()},
        ),
    ):
        drawn = {r.token_id for r in apply_samplers(logits.repeat(16, 1), [spec] * 16, None)}
        assert drawn <= allowed


def test_unrestricted_sampling_covers_more_than_top1() -> None:
    logits = torch.zeros(200, V)  # uniform: 200 draws must not all agree
    drawn = {r.token_id for r in apply_samplers(logits, [SamplerSpec(SamplerKind.SAMPLE)] * 200, None)}
    assert len(drawn) > 20


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), allowed=st.lists(st.booleans(), min_size=V, max_size=V).filter(any))
def test_vocab_mask_is_respected_by_every_sampler(seed: int, allowed: list[bool]) -> None:
    runs = tuple(brle.encode(allowed))
    specs = [
        SamplerSpec(SamplerKind.GREEDY, vocab_mask=runs),
        SamplerSpec(SamplerKind.SAMPLE, temperature=2.0, vocab_mask=runs),
        SamplerSpec(SamplerKind.DISTRIBUTION, distribution_top_k=V, vocab_mask=runs),
    ]
    results = apply_samplers(logits_of(seed, 3), specs, decode_vocab_masks(specs, V, ["a", "b", "c"]))
    ok = set(np.flatnonzero(allowed).tolist())
    assert results[0].token_id in ok and results[1].token_id in ok
    nonzero = {t for t, p in zip(results[2].token_ids, results[2].probs, strict=True) if p > 0}
    assert nonzero <= ok and math.isclose(sum(results[2].probs), 1.0, rel_tol=1e-4)
    expected = max(torch.log_softmax(logits_of(seed, 3)[0][sorted(ok)], -1).tolist())
    assert math.isclose(results[0].logprob, expected, abs_tol=1e-5)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, V))
def test_distribution_is_sorted_and_sums_to_at_most_one(seed: int, k: int) -> None:
    d = apply_samplers(logits_of(seed), [SamplerSpec(SamplerKind.DISTRIBUTION, distribution_top_k=k)], None)[
        0
    ]
    assert isinstance(d, Distribution) and len(d.token_ids) == k == len(set(d.token_ids))
    assert list(d.probs) == sorted(d.probs, reverse=True) and sum(d.probs) <= 1 + 1e-5


def test_engine_samplers_end_to_end(make_engine, prompts) -> None:
    from tests.unit.executor.conftest import PageTables

    engine = make_engine()
    tables = PageTables(engine)
    allowed = np.zeros(49152, dtype=bool)
    allowed[[100, 200, 300]] = True
    specs = (
        SamplerSpec(SamplerKind.DISTRIBUTION, distribution_top_k=5),
        SamplerSpec(SamplerKind.GREEDY),
        SamplerSpec(SamplerKind.SAMPLE, temperature=0.7, top_k=5, top_p=0.9, seed=7),
        SamplerSpec(SamplerKind.SAMPLE, temperature=1.0, vocab_mask=tuple(brle.encode(allowed))),
    )
    # One sequence per sampler, the same prompt in each: an item answers each of its tokens once.
    last = (len(prompts[0]) - 1,)
    items = [dataclass_replace(tables.item(name, prompts[0], outputs=last), samplers=(spec,))
             for name, spec in zip("abcd", specs, strict=True)]
    outs = [result.outputs[0] for result in engine.forward_text(items)]
    assert outs[1].token_id == outs[0].token_ids[0]
    assert outs[2].token_id in outs[0].token_ids
    assert outs[3].token_id in (100, 200, 300)


def dataclass_replace(item, **changes):
    import dataclasses

    return dataclasses.replace(item, **changes)


SMALLEST_FLOAT32_SUBNORMAL = float(np.nextafter(np.float32(0), np.float32(1)))  # ~1.4e-45


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    temperature=st.sampled_from([1e-38, 1e-45, SMALLEST_FLOAT32_SUBNORMAL, 1.2e-38, 1e-30, 1e-6]),
    top_k=st.sampled_from([0, 5]),
)
def test_tiny_temperature_samples_greedily(seed: int, temperature: float, top_k: int) -> None:
    """Below MIN_SAMPLE_TEMPERATURE it is greedy by rule; above it the shift to max 0 keeps the
    scaled logits finite, so a near-zero temperature draws the argmax (never token 0 from NaNs)."""
    logits = logits_of(seed, 2) * 30  # large logits: logits / 1e-38 would overflow float32
    spec = SamplerSpec(SamplerKind.SAMPLE, temperature=temperature, top_k=top_k, seed=seed)
    results = apply_samplers(logits, [spec, spec], None)
    assert [r.token_id for r in results] == logits.argmax(dim=-1).tolist()


def test_tiny_temperature_respects_the_vocab_mask() -> None:
    logits = logits_of(3) * 30
    best = int(logits[0].argmax())
    mask = [best, 1, V - best - 1]  # every token but the argmax allowed
    allowed = decode_vocab_masks([SamplerSpec(SamplerKind.SAMPLE, vocab_mask=tuple(mask))], V, ["x"])
    spec = SamplerSpec(SamplerKind.SAMPLE, temperature=1e-45, vocab_mask=tuple(mask))
    (result,) = apply_samplers(logits, [spec], allowed)
    expected = int(logits[0].masked_fill(~torch.from_numpy(allowed[0]), -math.inf).argmax())
    assert result.token_id == expected != best


def test_every_positive_temperature_samples() -> None:
    assert 1e-45 < MIN_SAMPLE_TEMPERATURE < 1e-37  # so 1e-38 and every subnormal sample greedily


def test_a_seed_is_any_uint64() -> None:
    spec = SamplerSpec(SamplerKind.SAMPLE, temperature=1.0, seed=2**64 - 1)
    (first,) = apply_samplers(logits_of(5), [spec], None)
    (again,) = apply_samplers(logits_of(5), [spec], None)
    assert first.token_id == again.token_id


# ---- the CPU kernels' greedy call (`l4m_cpu.greedy`), which serves plain greedy batches -----------------


def _kernel_greedy():  # type: ignore[no-untyped-def]
    if not kernels_available():
        pytest.skip("needs an AVX2 CPU and a C++ compiler")
    return torch.ops.l4m_cpu.greedy


@pytest.mark.parametrize("vocab", [1, 13, 64, 49152])
def test_the_kernel_greedy_is_argmax_and_log_softmax(vocab: int) -> None:
    greedy = _kernel_greedy()
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(vocab)) * 5
    if vocab > 8:
        logits[1, vocab - 2] = logits[1, 3] = logits[1].max() + 1  # a tie: the first index wins, as argmax
    ids, logprobs = greedy(logits)
    assert torch.equal(ids, logits.argmax(-1))
    want = torch.log_softmax(logits.double(), -1).gather(-1, ids[:, None])[:, 0]
    assert float((logprobs.double() - want).abs().max()) <= 1e-6


def test_the_kernel_greedy_handles_nan_and_infinite_rows_as_torch() -> None:
    greedy = _kernel_greedy()
    logits = torch.randn(3, 40)
    logits[0, 17] = logits[0, 30] = math.nan
    logits[1] = -math.inf
    logits[2, 5] = math.inf
    ids, logprobs = greedy(logits)
    assert ids.tolist() == logits.argmax(-1).tolist() == [17, 0, 5]
    assert all(math.isnan(p) for p in logprobs.tolist())
    assert all(math.isnan(p) for p in torch.log_softmax(logits, -1).gather(-1, ids[:, None]).flatten().tolist())


def test_the_kernel_greedy_refuses_what_it_cannot_read() -> None:
    greedy = _kernel_greedy()
    for bad in (torch.randn(2, 8).double(), torch.randn(8, 2).t(), torch.randn(8), torch.empty(2, 0)):
        with pytest.raises(RuntimeError, match="logits must be contiguous float32"):
            greedy(bad)


def test_plain_greedy_batches_take_the_kernel_and_others_the_torch_path() -> None:
    greedy = _kernel_greedy()
    calls: list[int] = []

    def spy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(logits.shape[0])
        return greedy(logits)

    logits = torch.randn(3, 4000, generator=torch.Generator().manual_seed(1)) * 4
    plain = [SamplerSpec(SamplerKind.GREEDY)] * 3
    fast, slow = apply_samplers(logits, plain, None, spy), apply_samplers(logits, plain, None)
    assert calls == [3]
    assert [r.token_id for r in fast] == [r.token_id for r in slow]  # type: ignore[union-attr]
    assert max(abs(f.logprob - s.logprob) for f, s in zip(fast, slow, strict=True)) <= 1e-5  # type: ignore[union-attr]
    others = [
        SamplerSpec(SamplerKind.GREEDY, top_logprobs=2),
        SamplerSpec(SamplerKind.GREEDY, logit_bias_token_ids=(5,), logit_bias_values=(3.0,)),
        SamplerSpec(SamplerKind.SAMPLE, seed=1),
        SamplerSpec(SamplerKind.DISTRIBUTION, distribution_top_k=3),
    ]
    for other in others:
        assert apply_samplers(logits, [plain[0], other, plain[0]], None, spy) == apply_samplers(
            logits, [plain[0], other, plain[0]], None
        )
    allowed = np.ones((3, 4000), dtype=bool)
    allowed[:, 0] = False
    assert apply_samplers(logits, plain, allowed, spy) == apply_samplers(logits, plain, allowed)
    assert calls == [3]  # none of these took the kernel
