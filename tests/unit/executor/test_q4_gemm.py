"""`torch.ops.l4m_cpu.linear` at every row-tile edge: M across the dot-product tiles (<= 15 rows but 8)
and the 8-row panels (8, >= 16: 2 x 6 and 1 x 12 tiles), weight row counts that leave NR and chunk tails,
K past one K block, on 1 and 2 threads, against a dense float64 product of the same blocks."""

from __future__ import annotations

import pytest
import torch

from l4m.executor.quant import kernels_available
from tests.unit.executor.conftest import cpu_only

pytestmark = [
    cpu_only,
    pytest.mark.skipif(not kernels_available(), reason="needs an AVX2 CPU and a C++ compiler"),
]

ROWS = [1, 7, 8, 9, 15, 16, 17, 24, 63, 64, 65]


def random_blocks(kind: str, n: int, k: int, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    d = torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001
    if kind == "q4_1":
        qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        return qs, d, torch.randn(n, k // 32, generator=gen) * 0.05
    return torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen), d, None


def dense(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    scale = d.double().repeat_interleave(32, dim=1)
    if m is None:
        return qs.double() * scale
    nibbles = qs.view(qs.shape[0], -1, 16)
    values = torch.cat((nibbles & 15, nibbles >> 4), dim=-1).reshape(qs.shape[0], -1).double()
    return scale * values + m.double().repeat_interleave(32, dim=1)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("n, k", [(37, 96), (24, 160), (61, 1184)])  # NR / chunk tails; K over 2 blocks
def test_every_row_count_matches_the_dense_product(kind, n, k, threads) -> None:
    w = random_blocks(kind, n, k, seed=n + k)
    want_w = dense(*w)
    for m in ROWS:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        got = torch.ops.l4m_cpu.linear(x, *w)
        want = x.double() @ want_w.T
        assert got.shape == (m, n)
        err = (got.double() - want).abs().max().item()
        assert err <= 1e-5 * want.abs().max().item(), f"M = {m}: max error {err:.3g}"


@pytest.mark.parametrize("m", [8, 16, 17, 64])
def test_a_non_finite_row_spoils_only_its_own_outputs(m, threads) -> None:
    """Panels hold 8 rows of x in one register: a NaN / inf row must not reach its neighbours' lanes."""
    w = random_blocks("q4_1", 29, 96, seed=m)
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(0))
    x[m // 2, 5] = float("nan")
    x[m - 1, 0] = float("inf")
    got = torch.ops.l4m_cpu.linear(x, *w)
    bad = {m // 2, m - 1}
    assert got[m // 2].isnan().all()
    assert not got[m - 1].isfinite().any()
    clean = [i for i in range(m) if i not in bad]
    want = x[clean].double() @ dense(*w).T
    assert got[clean].isfinite().all()
    assert (got[clean].double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_no_rows_gives_an_empty_product() -> None:
    w = random_blocks("q4_1", 24, 64, seed=0)
    assert torch.ops.l4m_cpu.linear(torch.empty(0, 64), *w).shape == (0, 24)
