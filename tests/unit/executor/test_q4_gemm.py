"""`torch.ops.l4m_cpu.linear` at every row-tile edge: M across the dot-product tiles (<= 15 rows but 8)
and the 8-row panels (8, >= 16: 2 x 6 and 1 x 12 tiles), weight row counts that leave NR and chunk tails,
K past one K block and odd block counts (the AMX path's block pairs), on 1 and 2 threads, under each
instruction set this CPU runs (AVX2; AVX-512: float32 few-row tiles up to 8 rows, 4 a pass, 16-row panels
from 16; AMX: 16 x 16 tiles from 9 rows, padded), against a dense float64 product of the same blocks."""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest
import torch

from l4m.executor import cpu_kernels
from l4m.executor.quant import kernels_available
from tests.unit.executor.conftest import cpu_only

pytestmark = [
    cpu_only,
    pytest.mark.skipif(not kernels_available(), reason="needs an AVX2 CPU and a C++ compiler"),
]

ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 24, 63, 64, 65]


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next((line for line in f if line.startswith("flags")), "").split())


def missing_avx512_bf16_flags() -> list[str]:
    """The /proc/cpuinfo flags the avx512_bf16 path needs that this CPU lacks."""
    return [f for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16") if f not in cpu_flags()]


def has_avx512_bf16() -> bool:
    return not missing_avx512_bf16_flags()


def missing_avx512_flags() -> list[str]:
    """The /proc/cpuinfo flags the avx512 path needs that this CPU lacks."""
    return [f for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq") if f not in cpu_flags()]


def has_avx512() -> bool:
    return not missing_avx512_flags()


needs_avx512 = pytest.mark.skipif(
    not has_avx512(), reason=f"this CPU lacks {', '.join(missing_avx512_flags())} (hardware)"
)


needs_bf16 = pytest.mark.skipif(
    not has_avx512_bf16(), reason=f"this CPU lacks {', '.join(missing_avx512_bf16_flags())} (hardware)"
)


def missing_amx_flags() -> list[str]:
    return missing_avx512_bf16_flags() + [f for f in ("amx_tile", "amx_bf16") if f not in cpu_flags()]


def has_amx() -> bool:
    return not missing_amx_flags()


needs_amx = pytest.mark.skipif(not has_amx(), reason=f"this CPU lacks {', '.join(missing_amx_flags())} (hardware)")


@pytest.fixture(params=[
    "avx2", pytest.param("avx512", marks=needs_avx512), pytest.param("avx512_bf16", marks=needs_bf16),
    pytest.param("amx", marks=needs_amx),
])
def isa(request):
    before = torch.ops.l4m_cpu.isa()
    assert torch.ops.l4m_cpu.set_isa(request.param) == request.param
    yield request.param
    torch.ops.l4m_cpu.set_isa(before)


def random_blocks(kind: str, n: int, k: int, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001).half()  # scales are float16, as in a GGUF
    if kind == "q4_1":
        qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        return qs, d, (torch.randn(n, k // 32, generator=gen) * 0.05).half()
    return torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen), d, None


def dense(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    scale = d.double().repeat_interleave(32, dim=1)
    if m is None:
        return qs.double() * scale
    nibbles = qs.view(qs.shape[0], -1, 16)
    values = torch.cat((nibbles & 15, nibbles >> 4), dim=-1).reshape(qs.shape[0], -1).double()
    return scale * values + m.double().repeat_interleave(32, dim=1)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("n, k", [(37, 96), (24, 160), (61, 1184)])  # NR / chunk tails; K over 2 blocks
def test_every_row_count_matches_the_dense_product(kind, n, k, threads, isa) -> None:
    w = random_blocks(kind, n, k, seed=n + k)
    want_w = dense(*w)
    for m in ROWS:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        got = torch.ops.l4m_cpu.linear(x, *w)
        want = x.double() @ want_w.T
        assert got.shape == (m, n)
        err = (got.double() - want).abs().max().item()
        assert err <= 1e-5 * want.abs().max().item(), f"M = {m}: max error {err:.3g}"


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("m", [2, 3, 4, 8, 16, 17, 64])
def test_a_non_finite_row_spoils_only_its_own_outputs(kind, m, threads, isa) -> None:
    """Panels hold 8 rows of x in one register: a NaN / inf row must not reach its neighbours' lanes."""
    w = random_blocks(kind, 29, 96, seed=m)
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


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_a_prefill_of_more_rows_than_one_pass_matches_the_dense_product(kind, isa) -> None:
    """Past 512 rows the AVX-512 panels take x in blocks of 512 (each a pass over the weights): 1,100 rows
    are two blocks and a tail of 76 (4 panels and 12 rows on the dot-product tiles)."""
    w = random_blocks(kind, 50, 96, seed=11)
    x = torch.randn(1100, 96, generator=torch.Generator().manual_seed(1))
    want = x.double() @ dense(*w).T
    got = torch.ops.l4m_cpu.linear(x, *w)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


def before_a_guard_page(t: torch.Tensor, keep: list) -> torch.Tensor:
    """A copy of `t` whose last byte is the last readable one: the page after it may not be touched."""
    page = mmap.PAGESIZE
    size = t.numel() * t.element_size()
    body = -(-size // page) * page
    area = mmap.mmap(-1, body + page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    keep.append(area)
    base = torch.frombuffer(area, dtype=torch.uint8)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    assert libc.mprotect(base.data_ptr() + body, page, 0) == 0, os.strerror(ctypes.get_errno())  # PROT_NONE
    return base[body - size : body].view(t.dtype).view(t.shape).copy_(t)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_reading_ahead_stops_at_the_weights_end(kind, threads, isa) -> None:
    """The 1-2-row tiles ask for weight rows ahead of use (blocks and scales): past the last row those
    must stay prefetches, which never fault, not loads; each array here ends where an unreadable page
    starts."""
    keep: list = []
    w = tuple(None if t is None else before_a_guard_page(t, keep) for t in random_blocks(kind, 40, 576, seed=3))
    for m in (1, 2, 3):
        x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m))
        want = x.double() @ dense(*w).T
        assert (torch.ops.l4m_cpu.linear(x, *w).double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_no_rows_gives_an_empty_product() -> None:
    w = random_blocks("q4_1", 24, 64, seed=0)
    assert torch.ops.l4m_cpu.linear(torch.empty(0, 64), *w).shape == (0, 24)


@needs_bf16
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_the_isa_switch_changes_the_path(kind) -> None:
    """Both paths agree with the dense product, in different summation orders: bitwise different outputs
    show that `set_isa` really took the other path."""
    w = random_blocks(kind, 48, 576, seed=1)
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(1))
    before = torch.ops.l4m_cpu.isa()
    try:
        got = {}
        for isa in ("avx2", "avx512_bf16"):
            torch.ops.l4m_cpu.set_isa(isa)
            assert torch.ops.l4m_cpu.isa() == isa
            got[isa] = torch.ops.l4m_cpu.linear(x, *w)
    finally:
        torch.ops.l4m_cpu.set_isa(before)
    assert not torch.equal(got["avx2"], got["avx512_bf16"])
    torch.testing.assert_close(got["avx2"], got["avx512_bf16"], rtol=1e-5, atol=1e-5)


@needs_amx
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("bf16_x", [False, True])
def test_amx_takes_9_rows_and_more(kind, bf16_x) -> None:
    """From 9 rows `amx` multiplies on tiles (padded to 16 rows), in another summation order than the
    AVX-512 code (so bitwise different outputs show that it took its own path), as close to the dense
    product (of bf16(x) with `bf16_x`); up to 8 rows it runs the avx512_bf16 code, bit for bit. (With
    `bf16_x`, 9 rows on the AVX-512 panels of pairs, also padded to 16 rows, may give the tiles' bits:
    there the tiles' 9 rows are checked against their own 16-row call instead.)"""
    w = random_blocks(kind, 48, 576, seed=2)
    xs = [torch.randn(m, 576, generator=torch.Generator().manual_seed(m)) for m in (8, 9, 16, 40)]
    before = torch.ops.l4m_cpu.isa()
    try:
        got = {}
        for isa in ("avx512_bf16", "amx"):
            torch.ops.l4m_cpu.set_isa(isa)
            got[isa] = [torch.ops.l4m_cpu.linear(x, *w, bf16_x) for x in xs]
    finally:
        torch.ops.l4m_cpu.set_isa(before)
    assert torch.equal(got["avx512_bf16"][0], got["amx"][0])
    for x, panels, tiles in zip(xs[1:], got["avx512_bf16"][1:], got["amx"][1:], strict=True):
        if bf16_x and x.shape[0] == 9:
            padded = torch.cat((x, torch.randn(7, 576, generator=torch.Generator().manual_seed(7))))
            torch.ops.l4m_cpu.set_isa("amx")
            try:
                assert torch.equal(tiles, torch.ops.l4m_cpu.linear(padded, *w, bf16_x)[:9])
            finally:
                torch.ops.l4m_cpu.set_isa(before)
        else:
            assert not torch.equal(panels, tiles)
        want = (x.bfloat16() if bf16_x else x).double() @ dense(*w).T
        for out in (panels, tiles):
            assert (out.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_auto_picks_the_best_isa_of_this_cpu() -> None:
    before = torch.ops.l4m_cpu.isa()
    try:
        best = "amx" if has_amx() else "avx512_bf16" if has_avx512_bf16() else "avx512" if has_avx512() else "avx2"
        assert torch.ops.l4m_cpu.set_isa("auto") == best
    finally:
        torch.ops.l4m_cpu.set_isa(before)


def test_an_unknown_isa_is_refused_by_name(monkeypatch) -> None:
    with pytest.raises(RuntimeError, match="unknown CPU kernel ISA 'sse2'"):
        torch.ops.l4m_cpu.set_isa("sse2")
    monkeypatch.setenv("L4M_CPU_ISA", "sse2")
    with pytest.raises(ValueError, match="L4M_CPU_ISA must be one of auto, avx2, avx512, avx512_bf16, amx, got 'sse2'"):
        cpu_kernels.requested_isa()


def test_avx512_bf16_forced_on_a_cpu_without_it_is_an_error_naming_the_variable(monkeypatch) -> None:
    """Not a silent fall back to AVX2 (or to the torch path): the op's refusal (a fake here, so that this
    runs on every CPU) becomes a ValueError naming L4M_CPU_ISA, which kernels_available passes on."""

    def refuse(isa: str) -> str:
        raise RuntimeError("CPU kernel ISA avx512_bf16: this CPU (or its OS) lacks one of avx512f, ...")

    monkeypatch.setattr(torch.ops.l4m_cpu, "set_isa", refuse)
    expected = r"^L4M_CPU_ISA=avx512_bf16: CPU kernel ISA avx512_bf16: this CPU"
    with pytest.raises(ValueError, match=expected):
        cpu_kernels.select_isa("avx512_bf16")
    monkeypatch.setattr(cpu_kernels, "load_kernels", lambda: cpu_kernels.select_isa("avx512_bf16"))
    with pytest.raises(ValueError, match=expected):
        cpu_kernels.kernels_available()


@pytest.mark.skipif(has_avx512_bf16(), reason="this CPU has AVX-512 BF16")
def test_the_real_op_refuses_avx512_bf16_on_a_cpu_without_it() -> None:
    before = torch.ops.l4m_cpu.isa()
    with pytest.raises(RuntimeError, match="this CPU \\(or its OS\\) lacks one of avx512f"):
        torch.ops.l4m_cpu.set_isa("avx512_bf16")
    assert torch.ops.l4m_cpu.isa() == before


@pytest.mark.skipif(has_avx512(), reason="this CPU has AVX-512")
def test_the_real_op_refuses_avx512_on_a_cpu_without_it() -> None:
    with pytest.raises(RuntimeError, match="CPU kernel ISA avx512: this CPU \\(or its OS\\) lacks one of avx512f"):
        torch.ops.l4m_cpu.set_isa("avx512")
    assert torch.ops.l4m_cpu.isa() == "avx2"


@needs_bf16
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_avx512_runs_the_float32_paths_of_avx512_bf16_bit_for_bit_and_refuses_bf16_x(kind) -> None:
    """`avx512` (AVX-512 without BF16, say Skylake-X or Ice Lake servers) runs the same float32 code as
    `avx512_bf16` at every row count, so the outputs are the same bits; x rounded to bf16 needs BF16 and is
    refused by name."""
    w = random_blocks(kind, 61, 1184, seed=3)
    xs = [torch.randn(m, 1184, generator=torch.Generator().manual_seed(m)) for m in ROWS]
    before = torch.ops.l4m_cpu.isa()
    try:
        got = {}
        for isa in ("avx512", "avx512_bf16"):
            assert torch.ops.l4m_cpu.set_isa(isa) == isa
            got[isa] = [torch.ops.l4m_cpu.linear(x, *w) for x in xs]
        torch.ops.l4m_cpu.set_isa("avx512")
        with pytest.raises(RuntimeError, match="needs the CPU kernels' avx512_bf16 instruction set; they run avx512"):
            torch.ops.l4m_cpu.linear(xs[0], *w, True)
    finally:
        torch.ops.l4m_cpu.set_isa(before)
    for m, a, b in zip(ROWS, got["avx512"], got["avx512_bf16"], strict=True):
        assert torch.equal(a, b), f"M = {m}"


def test_the_environment_selects_the_isa(monkeypatch) -> None:
    before = torch.ops.l4m_cpu.isa()
    monkeypatch.setenv("L4M_CPU_ISA", "avx2")
    try:
        cpu_kernels.select_isa(cpu_kernels.requested_isa())
        assert torch.ops.l4m_cpu.isa() == "avx2"
    finally:
        torch.ops.l4m_cpu.set_isa(before)
