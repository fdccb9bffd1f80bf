"""The engines the benchmarks compare, one batched greedy run each over the same token-exact prompts,
and the statistics every engine is reported with.

    .venv/bin/python bench/peers.py --engine hf-fp32 --streams 4 --new-tokens 16     # one run; JSON out

Engines (each decodes `--new-tokens` tokens for every prompt, ignoring end-of-sequence tokens):
  l4m-executor          l4m's executor `Engine` in this process, configured as `l4m up` configures it on a
                        CPU (float32 compute, weights auto = the GGUF's 4-bit blocks, its OpenMP threads'
                        wait: l4m/executor/openmp.py): one forward over all prompts, then one batched decode
                        step per token. No scheduler, no controllers.
  hf-fp32, hf-bf16      HF transformers: one batched `generate` on the same GGUF file.
  llama-cpp-f32, -f16   llama-cpp-python's low-level API: every sequence in ONE `llama_batch` per step, on
                        an F32 / F16 GGUF export of the same weights (dequantized from the Q4_1 file by
                        `export_gguf`, cached under bench/results/models/).
  llama-cpp-q4_1        the same, on the model's own Q4_1 file (what a llama.cpp user runs: 4-bit weights,
                        activations quantized to 8 bits for its integer dot products).

Timing: every stream's request is at t = 0 (just before the engine's first call, the model loaded and
warmed up); a token's time is when the engine hands it back. Peak RSS is sampled every 50 ms during the
run (model loading excluded), the same way bench/e2e.py samples the l4m cluster's processes.
llama-cpp-python is optional (`scripts/bench-setup.sh` builds it): without it, its engines raise
`PeerUnavailable` and the benchmarks print a note and go on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from l4m.executor.openmp import default_wait, describe_wait

REPO = Path(__file__).resolve().parents[1]
EXPORT_DIR = REPO / "bench" / "results" / "models"
LLAMA_CPP_PRECISIONS = ("f32", "f16", "q4_1")
ENGINES = ("l4m-executor", "hf-fp32", "hf-bf16", *(f"llama-cpp-{p}" for p in LLAMA_CPP_PRECISIONS))
RSS_SAMPLE_PERIOD_S = 0.05
EXIT_UNAVAILABLE = 3  # the exit status of `peers.py --engine X` when X's package is missing


class PeerUnavailable(RuntimeError):
    """An engine whose package is not installed here; the benchmarks skip it with this message."""


@dataclass
class Timeline:
    """What one run produced: per stream, its generated token ids and when each appeared (seconds after
    the request). `notes` carries engine-specific facts (thread count, weights, the GGUF used)."""

    engine: str
    token_ids: list[list[int]]
    token_times_s: list[list[float]]
    peak_rss_bytes: int = 0
    notes: dict[str, object] = field(default_factory=dict)


def make_prompts(num_streams: int, num_tokens: int, seed: int = 0) -> list[list[int]]:
    """Token-exact prompts: random ids from the ordinary part of the vocabulary (no special tokens).
    Stream i gets the same prompt whatever `num_streams` is."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(num_tokens)] for _ in range(num_streams)]


def cpu_model() -> str:
    """The CPU's model name (for the reports: numbers mean little without it)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def percentile(values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile (p99 of fewer than 100 values is the largest one)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def summarize(timeline: Timeline) -> dict[str, float]:
    """Generated tok/s over the whole run (request to last token); TTFT, TPOT and ITL percentiles.

    TTFT: request to a stream's first generated token. TPOT (time per output token, as vLLM's and TGI's
    benchmarks define it): a stream's (last token - first token) / (tokens - 1), percentiles over the
    streams. ITL (inter-token latency): the gap between two consecutive tokens of one stream, pooled
    over all streams; its p99 shows stalls, and tokens that arrive in bursts (several per round trip)."""
    times = [t for t in timeline.token_times_s if t]
    num_tokens = sum(len(t) for t in timeline.token_ids)
    wall_s = max(t[-1] for t in times)
    ttft_s = [t[0] for t in times]
    tpot_s = [(t[-1] - t[0]) / (len(t) - 1) for t in times if len(t) > 1] or [0.0]
    gaps_s = [b - a for t in times for a, b in zip(t, t[1:], strict=False)] or [0.0]
    return {
        "num_streams": len(timeline.token_ids),
        "generated_tokens": num_tokens,
        "wall_s": wall_s,
        "tok_s": num_tokens / wall_s,
        "ttft_p50_ms": 1000 * percentile(ttft_s, 0.5),
        "ttft_p99_ms": 1000 * percentile(ttft_s, 0.99),
        "tpot_p50_ms": 1000 * percentile(tpot_s, 0.5),
        "tpot_p99_ms": 1000 * percentile(tpot_s, 0.99),
        "itl_p50_ms": 1000 * percentile(gaps_s, 0.5),
        "itl_p99_ms": 1000 * percentile(gaps_s, 0.99),
        "peak_rss_mib": timeline.peak_rss_bytes / 2**20,
    }


def prefill_decode_rates(timeline: Timeline, prompt_tokens: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of a batched run, as bench/executor.py reports them: all prompts over
    the time to the first token, and the batch over the median decode step."""
    steps = timeline.token_times_s[0]
    batch = len(timeline.token_ids)
    gaps = [b - a for a, b in zip(steps, steps[1:], strict=False)]
    return batch * prompt_tokens / steps[0], batch / statistics.median(gaps) if gaps else float("nan")


def matching_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two greedy continuations share."""
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))


class RssSampler:
    """Peak of the summed RSS of `pids()` (called at each sample), sampled in a thread until `stop`."""

    def __init__(self, pids: callable, period_s: float = RSS_SAMPLE_PERIOD_S) -> None:  # type: ignore[valid-type]
        self._pids = pids
        self._period_s = period_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def sample(self) -> None:
        import psutil

        total = 0
        for pid in self._pids():
            with contextlib.suppress(psutil.Error):
                total += psutil.Process(pid).memory_info().rss
        self.peak_bytes = max(self.peak_bytes, total)

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            self.sample()


def own_rss() -> RssSampler:
    return RssSampler(lambda: [os.getpid()])


# ---- l4m executor alone ------------------------------------------------------------------------


def run_l4m_executor(prompts: list[list[int]], new_tokens: int, weights: str = "auto", device: str = "cpu",
                     quantized_activations: str = "float32", kv_cache_dtype: str = "auto") -> Timeline:
    """Greedy decode, one forward_text per token; on a GPU in bfloat16 (the executor service's default
    there) with its decode graphs captured first, else in float32 (with `quantized_activations` and
    `kv_cache_dtype` as the executor's flags of those names)."""
    from l4m.executor.commands import Allocate, ForwardText, ResourceKind, SamplerKind, SamplerSpec
    from l4m.executor.engine import Engine, EngineConfig
    from l4m.executor.weights import default_model_path, load_model

    greedy = (SamplerSpec(SamplerKind.GREEDY),)
    page_size, num_streams = 16, len(prompts)
    pages_per_stream = -(-(len(prompts[0]) + new_tokens) // page_size)
    dtype = "float32" if device == "cpu" else "bfloat16"
    # On a GPU the decode graphs are captured before the clock starts, as the executor service does.
    config = EngineConfig(device=device, dtype=dtype, page_size=page_size,
                          num_pages=num_streams * pages_per_stream, num_embed_slots=0, weights=weights,
                          capture_graphs_at_start=device != "cpu", quantized_activations=quantized_activations,
                          kv_cache_dtype=kv_cache_dtype)
    engine = Engine(load_model(default_model_path()), config)
    engine.allocate([Allocate(ResourceKind.KV_PAGE, tuple(range(num_streams * pages_per_stream)))])

    def item(stream: int, tokens: list[int], start: int) -> ForwardText:
        end = start + len(tokens)
        first_page = stream * pages_per_stream
        pages = tuple(range(first_page, first_page + -(-end // page_size)))
        last_length = end - page_size * (len(pages) - 1)
        return ForwardText(pages, last_length, tuple(tokens), tuple(range(start, end)), (), (len(tokens) - 1,),
                           greedy)

    engine.forward_text([item(0, prompts[0][:8], 0)])  # warm-up; the prefill below rewrites these slots
    token_ids: list[list[int]] = [[] for _ in prompts]
    times: list[list[float]] = [[] for _ in prompts]
    with own_rss() as rss:
        start = time.perf_counter()
        pending = [item(s, prompt, 0) for s, prompt in enumerate(prompts)]
        for _ in range(new_tokens):
            results = []
            for chunk in _chunks_within(pending, config.max_batch_tokens):
                results += engine.forward_text(chunk)
            now = time.perf_counter() - start
            for stream, result in enumerate(results):
                token_ids[stream].append(result.outputs[0].token_id)
                times[stream].append(now)
            position = len(prompts[0]) + len(token_ids[0]) - 1
            pending = [item(s, [ids[-1]], position) for s, ids in enumerate(token_ids)]
    return Timeline("l4m-executor", token_ids, times, rss.peak_bytes,
                    {"weights": engine.weights, "device": device, "dtype": dtype, "openmp_wait": describe_wait(),
                     "quantized_activations": quantized_activations, "kv_cache_dtype": kv_cache_dtype})


def _chunks_within(items: list, max_tokens: int) -> Iterator[list]:  # type: ignore[type-arg]
    """Consecutive groups of forward items of at most `max_tokens` new tokens each."""
    chunk: list = []  # type: ignore[type-arg]
    num_tokens = 0
    for it in items:
        if chunk and num_tokens + len(it.token_ids) > max_tokens:
            yield chunk
            chunk, num_tokens = [], 0
        chunk.append(it)
        num_tokens += len(it.token_ids)
    if chunk:
        yield chunk


# ---- HF transformers ---------------------------------------------------------------------------


def run_hf(prompts: list[list[int]], new_tokens: int, dtype: str) -> Timeline:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer
    from transformers.utils import logging as hf_logging

    from l4m.executor.weights import default_model_path

    class StepClock(BaseStreamer):
        """`generate` calls put() with the prompt, then once per step with the new token of every row."""

        def __init__(self, start: float) -> None:
            self.start = start
            self.times: list[float] = []
            self.is_prompt_seen = False

        def put(self, value: torch.Tensor) -> None:
            if self.is_prompt_seen:
                self.times.append(time.perf_counter() - self.start)
            self.is_prompt_seen = True

        def end(self) -> None:
            pass

    hf_logging.disable_progress_bar()
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype)
    ).eval()
    ids = torch.tensor(prompts)  # [N, prompt] (equal lengths: no padding)
    mask = torch.ones_like(ids)
    settings = {"do_sample": False, "pad_token_id": 2}
    with torch.inference_mode():
        model.generate(ids[:1, :8], attention_mask=mask[:1, :8], max_new_tokens=2, **settings)  # warm-up
        with own_rss() as rss:
            clock = StepClock(time.perf_counter())
            output = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                    streamer=clock, **settings)
    token_ids = output[:, ids.shape[1]:].tolist()
    return Timeline(f"hf-{'fp32' if dtype == 'float32' else 'bf16'}", token_ids, [list(clock.times)] * len(prompts),
                    rss.peak_bytes, {"threads": torch.get_num_threads()})


# ---- llama.cpp (llama-cpp-python) ---------------------------------------------------------------


def export_gguf(precision: str) -> Path:
    """An F32 or F16 GGUF of the default model's weights, dequantized from its Q4_1/Q8_0 blocks (norms stay
    F32, as llama.cpp's converter keeps them), metadata and tokenizer copied. Written once, then cached.
    "q4_1" is the default model's own file."""
    import gguf

    from l4m.executor.weights import default_model_path

    if precision not in LLAMA_CPP_PRECISIONS:
        raise ValueError(f"precision must be one of {LLAMA_CPP_PRECISIONS}, got {precision!r}")
    source = default_model_path()
    if precision == "q4_1":
        return source
    target = EXPORT_DIR / f"{source.stem}.{precision.upper()}.gguf"
    if target.exists():
        return target
    reader = gguf.GGUFReader(source)
    file_type = gguf.LlamaFileType.ALL_F32 if precision == "f32" else gguf.LlamaFileType.MOSTLY_F16
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    writer = gguf.GGUFWriter(partial, reader.get_field("general.architecture").contents())
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.alignment"):
            continue
        value = int(file_type) if name == "general.file_type" else f.contents()
        is_array = f.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(name, value, f.types[0], sub_type=f.types[-1] if is_array else None)
    for tensor in reader.tensors:
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # float32, [rows, cols]
        writer.add_tensor(tensor.name, weights.astype(np.float16) if precision == "f16" and weights.ndim > 1
                          else weights.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(target)
    return target


def _import_llama_cpp():  # type: ignore[no-untyped-def]
    try:
        import llama_cpp
    except ImportError as error:
        raise PeerUnavailable(
            "llama-cpp-python is not installed (scripts/bench-setup.sh builds it, several minutes)"
        ) from error
    return llama_cpp


def run_llama_cpp(prompts: list[list[int]], new_tokens: int, precision: str, threads: int = 0) -> Timeline:
    """Batched greedy decode with llama.cpp's C API: all prompts in one `llama_decode`, then one
    `llama_batch` per step holding every sequence's last token; argmax of each row's logits."""
    ll = _import_llama_cpp()
    path = export_gguf(precision)
    threads = threads or os.cpu_count() or 1
    num_streams, prompt_len = len(prompts), len(prompts[0])
    ll.llama_backend_init()
    silence = ll.llama_log_callback(lambda level, text, user_data: None)
    ll.llama_log_set(silence, None)
    model = ll.llama_model_load_from_file(str(path).encode(), ll.llama_model_default_params())
    params = ll.llama_context_default_params()
    params.n_ctx = num_streams * (prompt_len + new_tokens + 16)  # split evenly: each sequence's own KV
    params.n_batch = max(num_streams * prompt_len, 512)
    params.n_ubatch = 512
    params.n_seq_max = num_streams
    # One KV stream per sequence, as llama-server's parallel slots: with one unified buffer every token
    # attends over all sequences' cells (masked), which made batch 64 ~3x slower (164 vs 55 tok/s).
    params.kv_unified = False
    params.n_threads = params.n_threads_batch = threads
    context = ll.llama_init_from_model(model, params)
    if not model or not context:
        raise RuntimeError(f"llama.cpp could not load {path}")
    num_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    batch = ll.llama_batch_init(params.n_batch, 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """Feed (token, position, sequence, wants_output) entries; the argmax token of each output."""
        batch.n_tokens = len(entries)
        for i, (token, position, sequence, wants_output) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position, 1
            batch.seq_id[i][0], batch.logits[i] = sequence, wants_output
        if ll.llama_decode(context, batch) != 0:
            raise RuntimeError("llama_decode failed (KV cache full?)")
        outputs = [i for i, entry in enumerate(entries) if entry[3]]
        return [int(np.ctypeslib.as_array(ll.llama_get_logits_ith(context, i), shape=(num_vocab,)).argmax())
                for i in outputs]

    try:
        # Warm-up with a whole prompt: llama.cpp sizes its compute buffers on the first batch of a shape.
        decode([(t, p, 0, p == prompt_len - 1) for p, t in enumerate(prompts[0])])
        ll.llama_memory_clear(ll.llama_get_memory(context), True)
        token_ids: list[list[int]] = [[] for _ in prompts]
        times: list[list[float]] = [[] for _ in prompts]
        with own_rss() as rss:
            start = time.perf_counter()
            entries = [(t, p, s, p == prompt_len - 1) for s, prompt in enumerate(prompts) for p, t in enumerate(prompt)]
            for step in range(new_tokens):
                sampled = decode(entries)
                now = time.perf_counter() - start
                for stream, token in enumerate(sampled):
                    token_ids[stream].append(token)
                    times[stream].append(now)
                entries = [(ids[-1], prompt_len + step, s, True) for s, ids in enumerate(token_ids)]
    finally:
        ll.llama_batch_free(batch)
        ll.llama_free(context)
        ll.llama_model_free(model)
    return Timeline(f"llama-cpp-{precision}", token_ids, times, rss.peak_bytes,
                    {"threads": threads, "gguf": path.name, "llama_cpp_python": ll.__version__})


def run_engine(engine: str, prompts: list[list[int]], new_tokens: int, threads: int = 0,
               device: str = "cpu", quantized_activations: str = "float32", kv_cache_dtype: str = "auto") -> Timeline:
    """One run of `engine` (a name from ENGINES); raises PeerUnavailable when its package is missing.
    `device`, `quantized_activations` and `kv_cache_dtype` are the l4m executor's alone (the other peers run on
    the CPU)."""
    if engine == "l4m-executor":
        return run_l4m_executor(prompts, new_tokens, device=device, quantized_activations=quantized_activations,
                                kv_cache_dtype=kv_cache_dtype)
    if engine in ("hf-fp32", "hf-bf16"):
        try:
            import transformers  # noqa: F401
        except ImportError as error:
            raise PeerUnavailable("transformers is not installed (pip install -e '.[bench]')") from error
        return run_hf(prompts, new_tokens, "float32" if engine == "hf-fp32" else "bfloat16")
    if engine.startswith("llama-cpp-") and engine in ENGINES:
        return run_llama_cpp(prompts, new_tokens, engine.rsplit("-", 1)[1], threads)
    raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", required=True, choices=ENGINES)
    parser.add_argument("--streams", type=int, default=1, help="concurrent sequences (one batch)")
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0, help="of the random prompts")
    parser.add_argument("--threads", type=int, default=0, help="torch / llama.cpp threads; 0 = all cores")
    parser.add_argument("--device", default="cpu", help="l4m-executor's device (cuda:0: bfloat16)")
    parser.add_argument("--quantized-activations", default="float32", choices=["float32", "bfloat16"],
                        help="l4m-executor's precision of x in the 4-bit products (the executor's flag)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float16"],
                        help="l4m-executor's KV cache element type (the executor's flag)")
    parser.add_argument("--out", default="", help="write the timeline here as JSON (default: stdout)")
    args = parser.parse_args()
    if args.device != "cpu" and args.engine != "l4m-executor":
        parser.error(f"--device {args.device}: only l4m-executor runs off the CPU here (bench/executor.py has HF on a GPU)")
    if min(args.streams, args.prompt_tokens, args.new_tokens) < 1:
        parser.error("--streams, --prompt-tokens and --new-tokens must be at least 1")
    if args.engine == "l4m-executor":
        os.environ.update(default_wait(os.environ))  # the executor service's OpenMP wait, before torch loads
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    prompts = make_prompts(args.streams, args.prompt_tokens, args.seed)
    try:
        timeline = run_engine(args.engine, prompts, args.new_tokens, args.threads, args.device,
                              args.quantized_activations, args.kv_cache_dtype)
    except PeerUnavailable as error:
        print(f"peers.py: {args.engine} unavailable: {error}", file=sys.stderr)
        sys.exit(EXIT_UNAVAILABLE)
    text = json.dumps(asdict(timeline))
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
