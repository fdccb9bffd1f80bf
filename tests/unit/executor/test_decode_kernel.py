"""The C++ decode stack (`torch.ops.l4m_cpu.decode_layers`): batches of single-token items against
the dense fp32 reference and against the torch path, and the fallback when the kernels cannot build."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from l4m.executor import cpu_kernels
from l4m.executor.commands import Allocate, EmbedText, Forward, MaskKvPage, ResourceKind, SampleTopK
from l4m.executor.quant import kernels_available
from tests.unit.executor.conftest import LogitsRecorder, PageTables, cpu_only, engine_stats
from tests.unit.executor.reference import reference_logits
from tests.unit.executor.test_forward import TOL_FP32, causal, rows_of

pytestmark = cpu_only  # the C++ decode step is a CPU path

REPO_ROOT = Path(__file__).resolve().parents[3]
needs_kernels = pytest.mark.skipif(not kernels_available(), reason="needs an AVX2 CPU and a C++ compiler")
# Sequence lengths with page_size 4: the new token lands on a fresh page (5, 9, 13), mid-page, on the
# last slot of a page (4, 8, 16), or is the sequence's only token (1).
LENGTHS = [5, 9, 13, 4, 8, 16, 1, 2, 3, 6, 7, 10, 11, 12, 14, 15]


def _sequences(prompts: list[list[int]], count: int) -> list[list[int]]:
    """`count` token sequences of the LENGTHS, cut from the prompts at varying offsets."""
    return [(prompts[i % len(prompts)] * 4)[i // 6 : i // 6 + n] for i, n in enumerate(LENGTHS[:count])]


def _prefill(engine, tables: PageTables, seqs: list[list[int]]) -> None:
    items = [tables.item(f"s{i}", s[:-1], outputs=()) for i, s in enumerate(seqs) if len(s) > 1]
    engine.forward_text(items)


@needs_kernels
@pytest.mark.parametrize("batch", [1, 16])
def test_decode_batch_matches_reference_per_item(make_engine, loaded, prompts, batch) -> None:
    engine = make_engine(page_size=4, weights="quantized")
    tables = PageTables(engine)
    seqs = _sequences(prompts, batch)
    _prefill(engine, tables, seqs)
    masks = [causal(len(s)) for s in seqs]
    custom = {}
    if batch > 1:
        masks[1][-1, 2:6] = False  # a BRLE row hiding a run that straddles a page boundary
        masks[5][-1, 0] = False
        custom = {1: rows_of(masks[1], len(seqs[1]) - 1, len(seqs[1])), 5: rows_of(masks[5], 15, 16)}
        engine.mask_kv_page([MaskKvPage(tables.pages["s2"][1], (1, 1, 2))])  # page visibility: slot 5 hidden
        masks[2][-1, 5] = False
    before = engine_stats(engine)["num_decode_kernel_batches"]
    recorder = LogitsRecorder(engine)
    engine.forward_text([tables.item(f"s{i}", s[-1:], mask=custom.get(i, ())) for i, s in enumerate(seqs)])
    assert engine_stats(engine)["num_decode_kernel_batches"] == before + 1
    diffs = [
        float((recorder.calls[0][i] - reference_logits(loaded, s, mask=masks[i])[-1]).abs().max())
        for i, s in enumerate(seqs)
    ]
    print("max |Δlogit| per item:", diffs)
    assert max(diffs) <= TOL_FP32
    if batch > 1:
        unmasked = reference_logits(loaded, seqs[1])[-1]
        assert float((unmasked - recorder.calls[0][1]).abs().max()) > 0.1, "the hidden run must matter"


@needs_kernels
def test_kernel_and_torch_paths_agree_step_by_step(make_engine, prompts) -> None:
    """Same weights, same commands: logits and written K/V agree, including a fully hidden row."""
    fast, slow = make_engine(page_size=4), make_engine(page_size=4, decode_kernel=False)
    assert fast.weights == slow.weights == "quantized"
    seqs = _sequences(prompts, 6)
    logits = []
    for engine in (fast, slow):
        tables = PageTables(engine)
        _prefill(engine, tables, seqs)
        recorder = LogitsRecorder(engine)
        last = [s[-1] for s in seqs]
        for step in range(6):
            hidden = {3: ((0, tables.length["s3"] + 1),)} if step == 2 else {}  # sees nothing at all
            items = [tables.item(f"s{i}", [t], mask=hidden.get(i, ())) for i, t in enumerate(last)]
            last = [r.outputs[0].token_id for r in engine.forward_text(items)]
        logits.append(torch.stack(recorder.calls))
    assert engine_stats(fast)["num_decode_kernel_batches"] == 6
    assert engine_stats(slow)["num_decode_kernel_batches"] == 0
    diffs = (logits[0] - logits[1]).abs().amax(-1)  # [step, item]
    print("max |Δlogit| per step and item:", diffs)
    # The fully hidden row's logits are far larger (no attention at all): its rounding scales with them.
    assert float(diffs[2, 3]) <= TOL_FP32
    diffs[2, 3] = 0
    assert float(diffs.max()) <= 1e-4
    for a, b in zip(fast.cache.layers, slow.cache.layers, strict=True):  # the K/V each path wrote
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())


@needs_kernels
def test_forward_from_embed_slots_takes_the_kernel(make_engine, prompts) -> None:
    """`forward` with one input slot per item is a decode step too."""
    results = []
    for decode_kernel in (True, False):
        engine = make_engine(page_size=4, decode_kernel=decode_kernel)
        tables = PageTables(engine)
        tokens = prompts[0][:6]
        engine.allocate([Allocate(ResourceKind.EMBED_SLOT, tuple(range(8)))])
        engine.embed_text([EmbedText(tuple(range(6)), tuple(tokens), tuple(range(6)))])
        pages, last = tables.grow("s", 5)
        engine.forward([Forward(pages, last, (0, 1, 2, 3, 4), (), ())])
        pages, last = tables.grow("s", 1)
        engine.forward([Forward(pages, last, (5,), (0,), (7,))])
        dist = engine.sample_top_k([SampleTopK(7, 5)])[0]
        results.append((dist, engine_stats(engine)["num_decode_kernel_batches"]))
    (fast, fast_count), (slow, slow_count) = results
    assert (fast_count, slow_count) == (1, 0)
    assert fast.token_ids == slow.token_ids
    assert max(abs(a - b) for a, b in zip(fast.probs, slow.probs, strict=True)) <= 1e-5


@needs_kernels
def test_the_decode_step_applies_the_final_norm_when_given_it() -> None:
    """`final_norm` makes `decode_layers` return the model's last norm of its rows (what `forward_decode`
    hands the head) instead of the residual; one of another size is refused."""
    hidden = torch.randn(2, 64, generator=torch.Generator().manual_seed(0)) * 3
    weight = torch.rand(64, generator=torch.Generator().manual_seed(1)) + 0.5
    args = (torch.zeros(2, 64), torch.zeros(2, 64), [], [], torch.zeros(2, 1, dtype=torch.long),
            torch.ones(2, dtype=torch.long), torch.ones(2, 1, dtype=torch.uint8), 1, 1e-5)  # no layers
    assert torch.equal(torch.ops.l4m_cpu.decode_layers(hidden, *args), hidden)
    normed = torch.ops.l4m_cpu.decode_layers(hidden, *args, weight)
    torch.testing.assert_close(normed, torch.nn.functional.rms_norm(hidden, (64,), weight, 1e-5))
    with pytest.raises(RuntimeError, match=r"final_norm: contiguous float32 \[E\]"):
        torch.ops.l4m_cpu.decode_layers(hidden, *args, weight[:32])


def test_falls_back_to_the_torch_path_without_a_compiler(tmp_path, loaded, prompts) -> None:
    """A fresh extension cache and no C++ compiler: the engine serves with dense weights, correctly. The fresh
    process gets the loaded model pickled on its stdin (parsing the GGUF again would take most of its time);
    which weights the engine serves is decided at its construction, where the kernels fail to load."""
    prompt = prompts[4]
    script = f"""
import json, pickle, sys
from l4m.executor.engine import Engine, EngineConfig
from tests.unit.executor.conftest import PageTables, engine_stats

engine = Engine(pickle.load(sys.stdin.buffer), EngineConfig(page_size=4, num_pages=16, num_embed_slots=0))
tables = PageTables(engine)
prompt = {prompt!r}
tokens = [engine.forward_text([tables.item("s", prompt, outputs=(len(prompt) - 1,))])[0].outputs[0].token_id]
for _ in range(3):
    tokens.append(engine.forward_text([tables.item("s", tokens[-1:])])[0].outputs[0].token_id)
print(json.dumps({{"weights": engine.weights, "tokens": tokens, "stats": engine_stats(engine)}}))
"""
    env = dict(os.environ, CXX=str(tmp_path / "no-such-g++"), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    done = subprocess.run([sys.executable, "-c", script], env=env, input=pickle.dumps(loaded, protocol=5),
                          capture_output=True, timeout=300, cwd=REPO_ROOT)
    proc = subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(), done.stderr.decode())
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "CPU kernels unavailable" in proc.stderr
    assert out["weights"] == "dequantized"
    assert out["stats"]["num_decode_kernel_batches"] == 0
    seq = prompt + out["tokens"]
    want = reference_logits(loaded, seq[:-1]).argmax(-1)[len(prompt) - 1 :].tolist()
    assert out["tokens"] == want


def test_load_kernels_compiles_the_cpp_files_current_text(tmp_path, monkeypatch) -> None:
    """`load_kernels` hands torch the text of `cpu_kernels.cpp` as it is at load time, with the same flags:
    torch rewrites the build's main.cpp (and ninja rebuilds) exactly when that text changed."""
    calls = []
    monkeypatch.setattr(cpp_extension, "load_inline", lambda name, **kwargs: calls.append((name, kwargs)))
    monkeypatch.setattr(cpu_kernels, "cpu_supports_kernels", lambda: True)
    monkeypatch.setattr(cpu_kernels, "select_isa", lambda isa: None)  # no library loaded to select in
    monkeypatch.setenv("PATH", os.environ.get("PATH", ""))
    shipped = Path(cpu_kernels.__file__).with_name("cpu_kernels.cpp").read_text()
    cpu_kernels.load_kernels.__wrapped__()  # past the per-process cache
    edited = tmp_path / "cpu_kernels.cpp"
    edited.write_text(shipped + "// edited\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE_PATH", edited)
    cpu_kernels.load_kernels.__wrapped__()
    (name, first), (_, second) = calls
    assert name == "l4m_cpu"
    assert "TORCH_LIBRARY(l4m_cpu, lib)" in shipped
    assert first["cpp_sources"] == [shipped]
    assert second["cpp_sources"] == [shipped + "// edited\n"]
    assert first["no_implicit_headers"] and shipped.startswith("#include <torch/extension.h>\n")
    assert first["extra_cflags"] == second["extra_cflags"] == ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
