"""End-to-end throughput and latency: N concurrent text-completion controllers through the whole l4m stack
(user client -> spawner -> sandboxed controller -> scheduler -> executor), against the executor alone and
against peers on the same model and the same token-exact prompts, all in one run.

    .venv/bin/python bench/e2e.py                                   # N = 1,16,64; prompt 100; 128 new
    .venv/bin/python bench/e2e.py --n 1,4 --new-tokens 16 --engines l4m,l4m-executor,llama-cpp-f32

Engines: `l4m` (the full stack, started here like `l4m up` with its own state directory and ports; each
stream is one launch of bench/controllers/completion.py through `l4m.client`), `l4m-stepwise` (the same,
one executor round trip per token: no continuation), `l4m-one` and `l4m-stepwise-one` (the same N streams
from one launch of bench/controllers/completions.py: one controller process drives them all; not in the
default set), `l4m-shared` and `l4m-stepwise-shared` (N launches as `l4m`, each with `share_process`: up
to the spawner's --max-instances-per-process run in one controller process; not in the default set), `l4m-gateway` (the same workload as streamed OpenAI
`/v1/completions` requests through the stack's gateway, the official `openai` package as the client, with
the `ignore_eos` and `return_token_ids` extensions; the ratio to `l4m` is reported) and the engines of
bench/peers.py (`l4m-executor`, `hf-fp32`, `hf-bf16`, `llama-cpp-f32`, `llama-cpp-f16`), each run in a
fresh process. An engine whose package is missing is skipped with a printed note.

Definitions (every stream's request at t = 0):
  tok/s   all generated tokens / time from the request to the last token (prefill and, for l4m, the
          sandbox launches included).
  TTFT    request -> first generated token. For l4m the request is the user's Launch call and the token
          is the one the user receives on the attach stream; `ttft_controller_*` in the JSON is the same
          first token measured from the controller's `main` start (sandbox start-up excluded).
  TPOT    a stream's (last token - first token) / (tokens - 1), percentiles over the streams.
  ITL     the gap between two consecutive tokens of one stream, pooled over all streams (l4m's SDK gets
          up to 9 tokens per round trip from the executor's continuation: they arrive in bursts).
  RSS     peak resident memory sampled during the run (model loading excluded); for l4m the sum over
          every process of the stack (executor, scheduler, spawner, sandboxes and controllers).
For l4m the JSON also holds the scheduler's forward_text batch sizes, the executor's and scheduler's
mean times per batch, and the CPU seconds each part of the stack used during the run ("bench": this
process, i.e. the user client, log pumps and sampler). --repeats R runs every (N, engine) R times,
interleaved, and reports the run of median tok/s (every run's tok/s in the JSON); a stack engine's ratio to
the executor alone is also given repeat by repeat (`pair_ratios`: each run against the executor alone's run
of the same repeat, so that a slow minute of the host hits both sides). Writes JSON (--out) and, with --plot, a PNG.

--long-prompt TOKENS (issue #21, chunked prefill): the l4m stack only. N streams decode stepwise (one
round trip, so one batch, per token: every gap between two tokens is a decode step); once every stream
has `LONG_PROMPT_AFTER_TOKENS` tokens, one more launch of the same controller sends a TOKENS-token prompt
and asks for 2 tokens. Reported for the N streams: their median step (the gaps outside the window) and
their ITL p50 / p99 inside the window (the gaps that overlap it), the window being the long launch to
its first token (the long prompt's TTFT), and p99 / median step. Run chunked (`--prefill-chunk-tokens`,
default the scheduler's) and unchunked (a chunk as large as the executor's batch: one pass), each run on
a cluster of its own (the chunk is a scheduler flag), interleaved over --repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import peers
from peers import Timeline, make_prompts, matching_prefix, percentile, summarize

from l4m.client import Client
from l4m.cluster import Cluster, ClusterConfig
from l4m.spawner.cpu_priority import descendants
from l4m.v1 import spawner_pb2

BENCH_DIR = Path(__file__).resolve().parent
COMPLETION_CONTROLLER = BENCH_DIR / "controllers" / "completion.py"
COMPLETIONS_CONTROLLER = BENCH_DIR / "controllers" / "completions.py"  # the N streams in one controller
# The full stack: controllers with the SDK's default (continuation: up to 9 tokens per round trip from the
# executor), and with one round trip per token (max_continuation_steps=0, the controller's third argument).
# `-one`: the same N streams driven by one controller (one launch, one process), not by N. `-shared`: N
# launches with `share_process` (up to the spawner's --max-instances-per-process in one controller process).
STACK_ENGINES = {"l4m": None, "l4m-stepwise": 0, "l4m-one": None, "l4m-stepwise-one": 0, "l4m-shared": None,
                 "l4m-stepwise-shared": 0}
ONE_CONTROLLER_ENGINES = ("l4m-one", "l4m-stepwise-one")
SHARED_PROCESS_ENGINES = ("l4m-shared", "l4m-stepwise-shared")
# The same workload as OpenAI API requests through the stack's gateway (no sandbox: its built-in handler).
GATEWAY_ENGINE = "l4m-gateway"
ALL_ENGINES = (*STACK_ENGINES, GATEWAY_ENGINE, *peers.ENGINES)
DEFAULT_ENGINES = tuple(engine for engine in ALL_ENGINES
                        if engine not in ONE_CONTROLLER_ENGINES and engine not in SHARED_PROCESS_ENGINES)
STACK_SAMPLE_PERIOD_S = 0.25  # enumerating the stack's processes costs CPU the stack is measured on
LIMITS = spawner_pb2.Limits(wall_time_ms=900_000, cpu_time_ms=600_000)
ROLES = ("executor", "scheduler", "spawner", "gateway", "controller")
# --long-prompt: the long prompt goes in once every decoding stream has this many tokens, and asks for
# this many of its own; "unchunked" is a chunk as large as the executor's batch (its --max-batch-tokens).
LONG_PROMPT_AFTER_TOKENS = 8
LONG_PROMPT_NEW_TOKENS = 2
UNCHUNKED_PREFILL_TOKENS = 8192


def stack_config(args: argparse.Namespace) -> ClusterConfig:
    # Only e2e.py's own `--engines` may ask for a gateway (bench/agentic.py shares this config).
    wants_gateway = GATEWAY_ENGINE in getattr(args, "engines", "").split(",")
    gateway_port = args.gateway_port if wants_gateway else -1
    # The gateway without its prefix cache: the same work as `l4m run` (a repeat would find its prompts cached).
    return ClusterConfig(state_dir=Path(args.state_dir), spawner_port=args.spawner_port, gateway_port=gateway_port,
                         gateway_prefix_cache_pages=0,
                         scheduler_port=args.scheduler_port, metrics_port_base=args.metrics_port_base,
                         batching=args.batching, warm_pool_size=args.warm_pool_size,
                         warm_pool_quiet_wait_s=getattr(args, "warm_pool_quiet_wait_s", None),
                         max_instances_per_process=getattr(args, "max_instances_per_process", None),
                         controller_cpu_policy=getattr(args, "controller_cpu_policy", None),
                         control_plane_cpu_policy=getattr(args, "control_plane_cpu_policy", "batch"),
                         session_transport=args.session_transport, executor_transport=args.executor_transport,
                         devices=(getattr(args, "device", "cpu"),), echo_logs=False,
                         quantized_activations=getattr(args, "quantized_activations", "float32"),
                         kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def _cpu_s_and_rss(pid: int) -> tuple[float, int]:
    """User + system CPU seconds and resident bytes of one process, from one read of /proc/PID/stat."""
    fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)  # raw: the sampler reads every process 4 times a second
    try:
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    fields = data[data.rindex(b")") + 2:].split()  # fields[0] is field 3 (state) of proc(5)
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS, int(fields[21]) * _PAGE_BYTES


class StackSampler:
    """Samples every process under this one (the cluster's services and their sandboxes) in a thread:
    the peak of their summed RSS, and the CPU seconds each role (`ROLES`; "warm-up" for a sandbox
    still waiting in the warm pool at idle priority, else "sandbox") used between samples."""

    def __init__(self, period_s: float = STACK_SAMPLE_PERIOD_S) -> None:
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._last_cpu_s: dict[int, float] = {}
        self._commands: dict[int, str] = {}
        self._cpu_s_by_role: dict[str, float] = {}
        self.peak_rss_bytes = 0
        self.peak_rss_mib_by_role: dict[str, float] = {}  # the split of the peak sample
        self.num_samples = 0  # by the thread (not the first and last)

    def __enter__(self) -> StackSampler:
        self._sample(is_first=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def cpu_s_by_role(self, digits: int = 2) -> dict[str, float]:
        return {role: round(seconds, digits) for role, seconds in sorted(self._cpu_s_by_role.items())}

    def _run(self) -> None:
        # This thread runs at idle priority (Linux: the policy is per thread), so that the measuring never
        # takes a core from the stack it measures: a sample of a 64-sandbox stack is ~5 ms of CPU, and one
        # that preempts an executor thread stalls the other at the next OpenMP barrier. It still runs
        # whenever a core idles, which the executor's threads leave between and inside its steps.
        with contextlib.suppress(AttributeError, OSError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        while not self._stop.wait(self._period_s):
            self._sample()
            self.num_samples += 1

    def _role(self, pid: int, command: str) -> str:
        role = next((r for r in ROLES if f"l4m.{r}" in command), "sandbox")
        if role in ("controller", "sandbox"):
            with contextlib.suppress(OSError):
                if os.sched_getscheduler(pid) == os.SCHED_IDLE:  # a warm sandbox not handed out yet
                    return "warm-up"
        return role

    def _sample(self, is_first: bool = False) -> None:
        rss_by_role: dict[str, int] = {}
        # /proc children files, not psutil's children(): that reads every process's stat on the host,
        # ~20 % of a core at 4 Hz beside a 64-sandbox warm pool, taken from the stack it measures.
        for pid in descendants(os.getpid()):
            with contextlib.suppress(OSError, ValueError, IndexError):  # a process that just ended
                cpu_s, rss = _cpu_s_and_rss(pid)
                if pid not in self._commands:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        self._commands[pid] = f.read().replace(b"\0", b" ").decode(errors="replace")
                role = self._role(pid, self._commands[pid])
                rss_by_role[role] = rss_by_role.get(role, 0) + rss
                if not is_first:  # CPU used since the last sample (all of it, for a process new since)
                    used_s = cpu_s - self._last_cpu_s.get(pid, 0.0)
                    self._cpu_s_by_role[role] = self._cpu_s_by_role.get(role, 0.0) + used_s
                self._last_cpu_s[pid] = cpu_s
        total = sum(rss_by_role.values())
        if total > self.peak_rss_bytes:
            self.peak_rss_bytes = total
            self.peak_rss_mib_by_role = {role: round(b / 2**20) for role, b in sorted(rss_by_role.items())}


def scrape(port: int) -> dict[str, float]:
    """Every sample of a Prometheus endpoint, keyed `name{labels}`; empty if metrics are off."""
    from prometheus_client.parser import text_string_to_metric_families

    if not port:
        return {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def step_profile(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Where a forward_text step's time goes, in mean ms per batch, from the services' own histograms:
    the executor computing it (`executor_ms`), the scheduler's send-to-answer round trip to the executor
    (`executor_round_trip_ms`: + gRPC and protobuf on that hop), and a replied command's arrival to
    reply (`command_ms`: + waiting in the scheduler's queue for the batch before it)."""
    def mean_ms(name: str, kind: str) -> float:
        count = after.get(f"{name}_count{{kind={kind}}}", 0.0) - before.get(f"{name}_count{{kind={kind}}}", 0.0)
        total = after.get(f"{name}_sum{{kind={kind}}}", 0.0) - before.get(f"{name}_sum{{kind={kind}}}", 0.0)
        return round(1000 * total / count, 2) if count else 0.0

    return {"executor_ms": mean_ms("l4m_executor_batch_seconds", "ForwardText"),
            "executor_round_trip_ms": mean_ms("l4m_scheduler_executor_batch_seconds", "forward_text"),
            "command_ms": mean_ms("l4m_scheduler_command_seconds", "forward_text")}


def batch_profile(before: dict[str, float], after: dict[str, float]) -> dict[str, object]:
    """forward_text batches the scheduler sent during the run: how many, mean size, and per size bucket."""
    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    prefix = "l4m_scheduler_batch_size"
    count = delta(f"{prefix}_count{{kind=forward_text}}")
    buckets, below = {}, 0.0
    for key in sorted((k for k in after if k.startswith(f"{prefix}_bucket{{kind=forward_text,")),
                      key=lambda k: float(k.split("le=")[1].rstrip("}"))):
        cumulative = delta(key)
        buckets[key.split("le=")[1].rstrip("}")] = int(cumulative - below)
        below = cumulative
    return {"num_forward_text_commands": int(delta("l4m_scheduler_commands_total{kind=forward_text}")),
            "num_forward_text_batches": int(count),
            "mean_forward_text_batch_size": delta(f"{prefix}_sum{{kind=forward_text}}") / count if count else 0.0,
            "forward_text_batches_by_size_le": {le: n for le, n in buckets.items() if n}}


async def launch_stream(client: Client, program: str, prompt: list[int], new_tokens: int,
                        origin_s: float, max_continuation_steps: int | None = None, notify_at: int = 0,
                        on_notify: Callable[[], None] | None = None, share_process: bool = False) -> dict[str, object]:
    """One completion through the stack (a launch of completion.py); times are seconds after `origin_s` (wall
    clock). With `notify_at` (and `max_continuation_steps`), `on_notify` is called when the controller has that
    many tokens. `share_process`: the launch's LaunchRequest.share_process."""
    args = [",".join(map(str, prompt)), str(new_tokens)]
    if max_continuation_steps is not None:
        args.append(str(max_continuation_steps))
        if notify_at:
            args.append(str(notify_at))
    (stream,) = await launch_streams(client, program, args, 1, origin_s, on_notify, share_process)
    return stream


async def launch_one_controller(client: Client, program: str, prompts: list[list[int]], new_tokens: int,
                                origin_s: float, max_continuation_steps: int | None = None) -> list[dict[str, object]]:
    """Every prompt's completion from one launch of completions.py (one controller drives all the streams)."""
    args = [";".join(",".join(map(str, prompt)) for prompt in prompts), str(new_tokens)]
    if max_continuation_steps is not None:
        args.append(str(max_continuation_steps))
    return await launch_streams(client, program, args, len(prompts), origin_s)


async def launch_streams(client: Client, program: str, args: list[str], num_streams: int, origin_s: float,
                         on_notify: Callable[[], None] | None = None,
                         share_process: bool = False) -> list[dict[str, object]]:
    """Launch one controller that reports `num_streams` streams (a message without "stream" is stream 0's)
    and follow it to its exit; each stream's times, in seconds after `origin_s`."""
    launched_s = time.time() - origin_s
    instance_id = await client.launch(program, args, LIMITS, share_process=share_process)
    first_seen_s: dict[int, float] = {}
    summaries: dict[int, dict[str, object]] = {}
    log_lines: list[str] = []  # shown only if the controller fails
    async for event in client.attach(instance_id):
        kind = event.WhichOneof("event")
        if kind == "message":
            message = json.loads(event.message.text)
            stream = message.get("stream", 0)
            if "first_token_id" in message:
                first_seen_s[stream] = time.time() - origin_s
            elif "num_tokens" in message:
                if on_notify is not None:
                    on_notify()
            else:
                summaries[stream] = message
        elif kind == "log":
            log_lines.append(event.log.line)
        elif kind == "exit" and (event.exit.reason != spawner_pb2.EXIT_REASON_EXITED or event.exit.exit_code):
            reason = spawner_pb2.ExitReason.Name(event.exit.reason)
            logs = "\n".join(log_lines[-20:])
            raise RuntimeError(f"controller {instance_id} ended {reason} ({event.exit.exit_code}): "
                               f"{event.exit.message}\n{logs}")
    missing = [stream for stream in range(num_streams) if stream not in summaries or stream not in first_seen_s]
    if missing:
        raise RuntimeError(f"controller {instance_id} exited without reporting the tokens of streams {missing}")
    return [{"launched_s": launched_s, "first_seen_s": first_seen_s[stream],
             "started_s": summaries[stream]["started_at_s"] - origin_s, "token_ids": summaries[stream]["token_ids"],
             "token_times_s": [t - origin_s for t in summaries[stream]["token_times_s"]]}
            for stream in range(num_streams)]


async def run_stack(client: Client, programs: dict[Path, str], config: ClusterConfig, prompts: list[list[int]],
                    new_tokens: int, engine: str = "l4m") -> tuple[Timeline, dict[str, object]]:
    """N concurrent launches, or one launch for the N streams (the `-one` engines); the timeline
    (controller-side token times) and the l4m-only facts. `programs`: the uploaded controllers' ids."""
    metrics_before = scrape(config.metrics_port(1))
    executor_before = scrape(config.metrics_port(10))
    steps = STACK_ENGINES[engine]
    own_cpu_before_s = sum(os.times()[:2])
    with StackSampler() as sampler:
        origin_s = time.time()
        if engine in ONE_CONTROLLER_ENGINES:
            streams = await launch_one_controller(client, programs[COMPLETIONS_CONTROLLER], prompts, new_tokens,
                                                  origin_s, steps)
        else:
            program = programs[COMPLETION_CONTROLLER]
            share = engine in SHARED_PROCESS_ENGINES
            streams = await asyncio.gather(*(launch_stream(client, program, p, new_tokens, origin_s, steps,
                                                           share_process=share) for p in prompts))
    # This process: the user client (N launches, N attach streams), the services' log pumps and the
    # sampler. It shares the 2 cores with the stack; a real user's client would run elsewhere.
    cpu_s_by_role = {**sampler.cpu_s_by_role(4), "bench": round(sum(os.times()[:2]) - own_cpu_before_s, 4)}
    timeline = Timeline(engine, [s["token_ids"] for s in streams], [s["token_times_s"] for s in streams],
                        sampler.peak_rss_bytes)
    first_seen = [s["first_seen_s"] for s in streams]
    from_start = [s["token_times_s"][0] - s["started_s"] for s in streams]
    extra = {
        "ttft_user_s": first_seen,
        "ttft_controller_p50_ms": 1000 * percentile(from_start, 0.5),
        "ttft_controller_p99_ms": 1000 * percentile(from_start, 0.99),
        "controller_start_p50_ms": 1000 * percentile([s["started_s"] for s in streams], 0.5),
        "cpu_s_by_role": cpu_s_by_role,
        "peak_rss_mib_by_role": sampler.peak_rss_mib_by_role,
        # at idle priority: how often the sampler got a core (STACK_SAMPLE_PERIOD_S asks for 4 a second)
        "stack_samples_per_s": round(sampler.num_samples / max(time.time() - origin_s, 1e-9), 2),
    }
    metrics_after = scrape(config.metrics_port(1))
    extra.update(batch_profile(metrics_before, metrics_after))
    extra["step_ms"] = step_profile({**metrics_before, **executor_before},
                                    {**metrics_after, **scrape(config.metrics_port(10))})
    return timeline, extra


async def gateway_stream(client: object, model: str, prompt: list[int], new_tokens: int,
                         origin_s: float) -> tuple[list[int], list[float]]:
    """One streamed /v1/completions request: its token ids and when each chunk carrying them arrived."""
    stream = await client.completions.create(  # type: ignore[attr-defined]
        model=model, prompt=prompt, max_tokens=new_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    token_ids: list[int] = []
    times_s: list[float] = []
    async for chunk in stream:
        for choice in chunk.choices:
            ids = (choice.model_extra or {}).get("token_ids") or []
            token_ids.extend(ids)
            times_s.extend([time.time() - origin_s] * len(ids))
    return token_ids, times_s


async def run_gateway(config: ClusterConfig, prompts: list[list[int]], new_tokens: int) -> tuple[Timeline, dict]:
    """N concurrent OpenAI completion requests through the gateway (the official `openai` package)."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{config.gateway_url}/v1", api_key=config.admin_key() or "none",
                                max_retries=0, timeout=3600)
    model = (await client.models.list()).data[0].id
    await gateway_stream(client, model, prompts[0][:16], 1, time.time())  # its tokenizer cached, imports done
    own_cpu_before_s = sum(os.times()[:2])
    with StackSampler() as sampler:
        origin_s = time.time()
        streams = await asyncio.gather(*(gateway_stream(client, model, p, new_tokens, origin_s) for p in prompts))
    await client.close()
    cpu_s_by_role = {**sampler.cpu_s_by_role(4), "bench": round(sum(os.times()[:2]) - own_cpu_before_s, 4)}
    timeline = Timeline(GATEWAY_ENGINE, [s[0] for s in streams], [s[1] for s in streams], sampler.peak_rss_bytes)
    return timeline, {"cpu_s_by_role": cpu_s_by_role, "peak_rss_mib_by_role": sampler.peak_rss_mib_by_role}


def window_gaps(token_times_s: list[list[float]], start_s: float, end_s: float,
                ) -> tuple[list[tuple[float, float]], list[float]]:
    """The streams' gaps between consecutive tokens, pooled: those overlapping [start_s, end_s], each with
    where it ends in the window (0 its start, 1 its end), and the rest."""
    inside, outside = [], []
    for times in token_times_s:
        for before, after in zip(times, times[1:], strict=False):
            if after > start_s and before < end_s:
                inside.append((after - before, (after - start_s) / (end_s - start_s)))
            else:
                outside.append(after - before)
    return inside, outside


async def run_long_prompt(client: Client, program: str, config: ClusterConfig, prompts: list[list[int]],
                          new_tokens: int, long_prompt: list[int]) -> dict[str, object]:
    """N stepwise decoding streams, and a long prompt launched once each has `LONG_PROMPT_AFTER_TOKENS`
    tokens: the streams' steps outside and inside the window while it fills (seconds after the first launch)."""
    metrics_before = scrape(config.metrics_port(1))
    executor_before = scrape(config.metrics_port(10))
    num_ready = 0
    all_ready = asyncio.Event()

    def on_notify() -> None:
        nonlocal num_ready
        num_ready += 1
        if num_ready == len(prompts):
            all_ready.set()

    origin_s = time.time()
    decoding = asyncio.ensure_future(asyncio.gather(*(
        launch_stream(client, program, p, new_tokens, origin_s, 0, LONG_PROMPT_AFTER_TOKENS, on_notify)
        for p in prompts)))
    ready = asyncio.ensure_future(all_ready.wait())
    await asyncio.wait({decoding, ready}, return_when=asyncio.FIRST_COMPLETED)
    ready.cancel()
    if decoding.done():  # a controller failed (or every stream ended) before the long prompt could go in
        await decoding
        raise RuntimeError("the decoding streams ended before the long prompt was launched")
    long = await launch_stream(client, program, long_prompt, LONG_PROMPT_NEW_TOKENS, origin_s)
    streams = await decoding
    start_s, end_s = long["launched_s"], long["token_times_s"][0]
    placed, outside = window_gaps([s["token_times_s"] for s in streams], start_s, end_s)
    inside = [gap for gap, _ in placed]
    median_step_s = percentile(outside, 0.5)
    metrics_after = scrape(config.metrics_port(1))
    return {
        "window_start_s": start_s, "window_end_s": end_s,
        "long_ttft_ms": 1000 * (end_s - start_s),  # launch -> first token, the controller's clock
        "long_ttft_user_ms": 1000 * (long["first_seen_s"] - start_s),
        "median_step_ms": 1000 * median_step_s,
        "window_itl_p50_ms": 1000 * percentile(inside, 0.5),
        "window_itl_p99_ms": 1000 * percentile(inside, 0.99),
        "window_itl_max_ms": 1000 * max(inside, default=float("nan")),
        "p99_over_median_step": percentile(inside, 0.99) / median_step_s,
        "num_window_gaps": len(inside), "num_other_gaps": len(outside),
        # the window's longest gaps (what its p99 stands on), longest first
        "window_top_gaps_ms": [[round(1000 * gap, 1), round(where, 3)] for gap, where in sorted(placed, reverse=True)[:64]],
        # the long prompt's whole fill fell among the streams' steps (none had ended before it)
        "streams_outlast_window": all(s["token_times_s"][-1] >= end_s for s in streams),
        "generated_tokens": sum(len(s["token_ids"]) for s in streams),
        **batch_profile(metrics_before, metrics_after),
        "step_ms": step_profile({**metrics_before, **executor_before},
                                {**metrics_after, **scrape(config.metrics_port(10))}),
    }


def run_peer(engine: str, num_streams: int, args: argparse.Namespace) -> Timeline | None:
    """bench/peers.py in a fresh process (its RSS and threads its own); None when the engine is missing."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, str(BENCH_DIR / "peers.py"), "--engine", engine, "--streams", str(num_streams),
                   "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens),
                   "--seed", str(args.seed), "--out", out.name]
        if engine == "l4m-executor":
            command += ["--device", args.device, "--quantized-activations", args.quantized_activations,
                        "--kv-cache-dtype", args.kv_cache_dtype]
        env = dict(os.environ, HF_HUB_DISABLE_PROGRESS_BARS="1", TRANSFORMERS_VERBOSITY="error")
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.peer_timeout_s)
        if done.returncode == peers.EXIT_UNAVAILABLE:
            print(f"  skipping {engine}: {done.stderr.strip().splitlines()[-1]}", flush=True)
            return None
        if done.returncode != 0:
            raise RuntimeError(f"{engine} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        return Timeline(**json.loads(Path(out.name).read_text()))


def row_of(timeline: Timeline, extra: dict[str, object] | None = None) -> dict[str, object]:
    row = {"engine": timeline.engine, **summarize(timeline), "notes": timeline.notes, **(extra or {})}
    if "ttft_user_s" in row:  # l4m: TTFT is what the user sees, not the controller's clock
        seen = row.pop("ttft_user_s")
        row["ttft_p50_ms"], row["ttft_p99_ms"] = 1000 * percentile(seen, 0.5), 1000 * percentile(seen, 0.99)
    return row


def compare_tokens(timelines: dict[str, Timeline]) -> dict[str, object]:
    """Each engine's greedy tokens against the executor alone's: leading tokens shared on prompt 0, and
    how many streams match exactly (the full stack should match the executor everywhere)."""
    reference = timelines.get("l4m-executor")
    if reference is None:
        return {}
    checks = {}
    for engine, timeline in timelines.items():
        if engine == "l4m-executor":
            continue
        pairs = list(zip(timeline.token_ids, reference.token_ids, strict=True))
        checks[engine] = {"prompt0_matching_prefix": matching_prefix(*pairs[0]),
                          "num_streams_identical": sum(a == b for a, b in pairs), "num_streams": len(pairs)}
    return checks


async def wait_warm_pool_full(config: ClusterConfig, timeout_s: float) -> None:
    """Until the spawner's warm pool holds its size of ready sandboxes (refills run at idle CPU priority,
    so after a run they finish once the machine is quiet): every launch of the next run finds one."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = await asyncio.to_thread(scrape, config.metrics_port(0))
        size = samples.get("l4m_spawner_warm_pool_size{}", 0.0)
        ready = samples.get("l4m_spawner_warm_sandboxes{state=ready}", 0.0)
        if ready >= size:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the warm pool holds {ready:.0f} of {size:.0f} sandboxes after {timeout_s:.0f} s")
        await asyncio.sleep(0.5)


async def warm_up(client: Client, program: str) -> None:
    """One short completion first: kernel set-up, imports and page caches are not the first stream's cost."""
    await launch_stream(client, program, make_prompts(1, 16, seed=99)[0], 4, time.time())


async def sweep(args: argparse.Namespace) -> dict[str, object]:
    engines = args.engines.split(",")
    sizes = [int(n) for n in args.n.split(",")]
    config = stack_config(args)
    has_stack = any(engine in STACK_ENGINES or engine == GATEWAY_ENGINE for engine in engines)
    cluster = Cluster(config, say=lambda line: print(line, flush=True)) if has_stack else None
    results: dict[str, object] = {"rows": [], "token_checks": {}, "ratios": {}, "pair_ratios": {}}
    try:
        if cluster is not None:
            await cluster.start()
        api_key = config.admin_key() or None if cluster is not None else None
        async with Client(config.spawner_address, api_key=api_key) as client:
            programs: dict[Path, str] = {}
            if cluster is not None:
                programs = {path: await client.upload_file(path) for path in (COMPLETION_CONTROLLER,
                                                                              COMPLETIONS_CONTROLLER)}
                await warm_up(client, programs[COMPLETION_CONTROLLER])
            for num_streams in sizes:
                prompts = make_prompts(num_streams, args.prompt_tokens, args.seed)
                runs: dict[str, list[tuple[Timeline, dict[str, object] | None]]] = {}
                for repeat in range(args.repeats):  # interleaved: a slow minute of the machine hits every engine
                    for engine in engines:
                        if cluster is not None:  # nothing of the last run goes on beside this one (refills)
                            await wait_warm_pool_full(config, args.pool_timeout_s)
                        print(f"[e2e] N={num_streams} {engine} run {repeat + 1}/{args.repeats} ...", flush=True)
                        if engine in STACK_ENGINES:
                            run = await run_stack(client, programs, config, prompts, args.new_tokens, engine)
                        elif engine == GATEWAY_ENGINE:
                            run = await run_gateway(config, prompts, args.new_tokens)
                        else:
                            run = run_peer(engine, num_streams, args), None
                        if run[0] is None:  # a peer that is not installed here
                            continue
                        runs.setdefault(engine, []).append(run)  # type: ignore[arg-type]
                        tok_s = summarize(run[0])["tok_s"]  # type: ignore[arg-type]
                        print(f"[e2e] N={num_streams} {engine}: {tok_s:.1f} tok/s", flush=True)
                timelines: dict[str, Timeline] = {}
                for engine, engine_runs in runs.items():
                    # The run of median throughput stands for the engine; every run's tok/s is kept.
                    ranked = sorted(engine_runs, key=lambda run: summarize(run[0])["tok_s"])
                    timeline, extra = ranked[len(ranked) // 2]
                    timelines[engine] = timeline
                    row = {"n": num_streams, **row_of(timeline, extra),
                           "tok_s_runs": [round(summarize(run[0])["tok_s"], 1) for run in engine_runs]}
                    results["rows"].append(row)
                results["token_checks"][num_streams] = compare_tokens(timelines)
                for engine in (*STACK_ENGINES, GATEWAY_ENGINE):
                    if engine in timelines and "l4m-executor" in timelines:
                        ratio = summarize(timelines[engine])["tok_s"] / summarize(timelines["l4m-executor"])["tok_s"]
                        results["ratios"].setdefault(engine, {})[num_streams] = ratio
                        # Each repeat's run against the executor alone's run of the same repeat: the host's
                        # phases (it moves ~20 % from minute to minute) hit both alike.
                        alone = [summarize(run[0])["tok_s"] for run in runs["l4m-executor"]]
                        results["pair_ratios"].setdefault(engine, {})[num_streams] = [
                            summarize(run[0])["tok_s"] / tok_s for run, tok_s in zip(runs[engine], alone, strict=False)]
                if GATEWAY_ENGINE in timelines and "l4m" in timelines:  # issue #22: within 5 % of `l4m run`
                    ratio = summarize(timelines[GATEWAY_ENGINE])["tok_s"] / summarize(timelines["l4m"])["tok_s"]
                    results["ratios"].setdefault("l4m-gateway/l4m", {})[num_streams] = ratio
    finally:
        if cluster is not None:
            await cluster.stop()
    return results


async def long_prompt_sweep(args: argparse.Namespace) -> dict[str, object]:
    """--long-prompt: chunked and unchunked, interleaved over the repeats, each run on a fresh cluster (the
    chunk is the scheduler's flag); per (N, variant) the run of median p99 / median step stands."""
    variants = {"chunked": args.prefill_chunk_tokens, "unchunked": UNCHUNKED_PREFILL_TOKENS}
    variants = {name: chunk for name, chunk in variants.items() if name in args.variants.split(",")}
    long_prompt = make_prompts(1, args.long_prompt, args.seed + 1)[0]
    runs: dict[tuple[int, str], list[dict[str, object]]] = {}
    for repeat in range(args.repeats):
        for num_streams in [int(n) for n in args.n.split(",")]:
            prompts = make_prompts(num_streams, args.prompt_tokens, args.seed)
            for variant, chunk_tokens in variants.items():
                config = replace(stack_config(args), prefill_chunk_tokens=chunk_tokens, gateway_port=-1,
                                 prefill_chunk_token_slots=args.prefill_chunk_token_slots if variant == "chunked"
                                 else None)
                cluster = Cluster(config, say=lambda line: print(line, flush=True))
                try:
                    await cluster.start()
                    async with Client(config.spawner_address, api_key=config.admin_key() or None) as client:
                        program = await client.upload_file(COMPLETION_CONTROLLER)
                        await warm_up(client, program)
                        await wait_warm_pool_full(config, args.pool_timeout_s)
                        print(f"[e2e] N={num_streams} long prompt {args.long_prompt} {variant} run "
                              f"{repeat + 1}/{args.repeats} ...", flush=True)
                        run = await run_long_prompt(client, program, config, prompts, args.new_tokens, long_prompt)
                finally:
                    await cluster.stop()
                print(f"[e2e] {variant}: long TTFT {run['long_ttft_ms']:.0f} ms; window ITL p99 "
                      f"{run['window_itl_p99_ms']:.0f} ms = {run['p99_over_median_step']:.1f}x the median step "
                      f"{run['median_step_ms']:.1f} ms", flush=True)
                runs.setdefault((num_streams, variant), []).append(run)
    rows = []
    for (num_streams, variant), variant_runs in runs.items():
        ranked = sorted(variant_runs, key=lambda run: run["p99_over_median_step"])
        rows.append({"n": num_streams, "variant": variant, "long_prompt_tokens": args.long_prompt,
                     "prefill_chunk_tokens": variants[variant],
                     "prefill_chunk_token_slots": args.prefill_chunk_token_slots if variant == "chunked" else None,
                     **ranked[len(ranked) // 2],
                     "ratio_runs": [round(run["p99_over_median_step"], 2) for run in variant_runs],
                     "long_ttft_ms_runs": [round(run["long_ttft_ms"]) for run in variant_runs]})
    return {"rows": rows}


def print_table(results: dict[str, object]) -> None:
    print("\n| engine | N | gen tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | ITL p99 ms "
          "| peak RSS MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results["rows"]:
        print(f"| {r['engine']} | {r['n']} | {r['tok_s']:.1f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
              f"{r['tpot_p50_ms']:.1f} | {r['tpot_p99_ms']:.1f} | {r['itl_p99_ms']:.1f} | {r['peak_rss_mib']:.0f} |")
    if any(len(r["tok_s_runs"]) > 1 for r in results["rows"]):
        for r in results["rows"]:
            print(f"{r['engine']} N={r['n']}: tok/s of every run {r['tok_s_runs']}")
    for engine, ratios in results["ratios"].items():
        for n, ratio in ratios.items():
            what = engine if "/" in engine else f"{engine} (full stack) / executor alone"
            pairs = sorted(results.get("pair_ratios", {}).get(engine, {}).get(n, []))
            by_pair = (f"; repeat by repeat {100 * statistics.median(pairs):.0f} % median "
                       f"({', '.join(f'{100 * p:.0f}' for p in pairs)} %)" if len(pairs) > 1 else "")
            print(f"{what} at N={n}: {100 * ratio:.0f} % (runs of median tok/s){by_pair}")
    for r in results["rows"]:
        if r["engine"] in STACK_ENGINES:
            print(f"{r['engine']} N={r['n']}: TTFT from controller start p50 {r['ttft_controller_p50_ms']:.0f} ms; "
                  f"{r['num_forward_text_batches']} forward_text batches, mean size "
                  f"{r['mean_forward_text_batch_size']:.1f}; per batch {r['step_ms']}; CPU s by role "
                  f"{ {role: round(cpu_s, 2) for role, cpu_s in r['cpu_s_by_role'].items()} }; peak RSS MiB "
                  f"by role {r['peak_rss_mib_by_role']}")
    print_cpu_per_token(results["rows"])
    for n, checks in results["token_checks"].items():
        for engine, check in checks.items():
            print(f"tokens N={n} {engine} vs l4m-executor: prompt 0 shares {check['prompt0_matching_prefix']} "
                  f"leading tokens; {check['num_streams_identical']}/{check['num_streams']} streams identical")


def cpu_us_per_token(row: dict[str, object]) -> dict[str, float]:
    """CPU microseconds each role of the stack used per generated token of the run (the roles' CPU seconds
    over the run's generated tokens; "control plane" is every role but the executor and this process)."""
    tokens = max(int(row["generated_tokens"]), 1)  # type: ignore[call-overload]
    per_token = {role: 1e6 * cpu_s / tokens for role, cpu_s in row["cpu_s_by_role"].items()}  # type: ignore[attr-defined]
    per_token["control plane"] = sum(us for role, us in per_token.items() if role not in ("executor", "bench"))
    return per_token


def print_cpu_per_token(rows: list[dict[str, object]]) -> None:
    """Issue #19's figures: the stack's CPU per generated token, by role."""
    rows = [r for r in rows if "cpu_s_by_role" in r]
    if not rows:
        return
    roles = [role for role in (*ROLES, "warm-up", "sandbox", "bench") if any(role in r["cpu_s_by_role"] for r in rows)]  # type: ignore[operator]
    columns = [*roles, "control plane"]
    print("\nCPU us per generated token, by role (\"control plane\": all but the executor and bench, this process):")
    print("| engine | N | " + " | ".join(columns) + " |")
    print("|---|---:|" + "---:|" * len(columns))
    for r in rows:
        per_token = cpu_us_per_token(r)
        cells = " | ".join(f"{per_token[c]:.0f}" if c in per_token else "-" for c in columns)
        print(f"| {r['engine']} | {r['n']} | {cells} |")


def print_long_prompt_table(results: dict[str, object]) -> None:
    print("\n| variant | chunk tokens | N | long prompt | window = long TTFT ms | median step ms | window ITL p50 ms "
          "| window ITL p99 ms | p99 / median step | gaps in window |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results["rows"]:
        chunk = r["prefill_chunk_tokens"] or "default"
        if r.get("prefill_chunk_token_slots"):
            chunk = f"{chunk}, shrinking ({r['prefill_chunk_token_slots']} slots/token)"
        print(f"| {r['variant']} | {chunk} | {r['n']} | {r['long_prompt_tokens']} | {r['long_ttft_ms']:.0f} | "
              f"{r['median_step_ms']:.1f} | {r['window_itl_p50_ms']:.1f} | {r['window_itl_p99_ms']:.1f} | "
              f"{r['p99_over_median_step']:.1f} | {r['num_window_gaps']} |")
    for r in results["rows"]:
        print(f"{r['variant']} N={r['n']}: p99 / median step of every run {r['ratio_runs']}, long TTFT ms "
              f"{r['long_ttft_ms_runs']}; the streams outlast the window: {r['streams_outlast_window']}; "
              f"{r['num_forward_text_batches']} forward_text batches; per batch {r['step_ms']}")


def plot(results: dict[str, object], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for engine in dict.fromkeys(r["engine"] for r in results["rows"]):
        rows = [r for r in results["rows"] if r["engine"] == engine]
        axes.plot([r["n"] for r in rows], [r["tok_s"] for r in rows], marker="o", label=engine)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("concurrent streams N")
    axes.set_ylabel("generated tokens / s")
    axes.set_title(results.get("title", "SmolLM2-135M, CPU"))
    axes.grid(True, alpha=0.3)
    axes.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120, bbox_inches="tight")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", default="1,16,64", help="concurrent streams, comma separated")
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0, help="of the random token-exact prompts")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every (N, engine), interleaved; the table shows the run of median tok/s")
    parser.add_argument("--engines", default=",".join(DEFAULT_ENGINES),
                        help=f"some of {', '.join(ALL_ENGINES)} (comma-separated; default all but the -one and "
                        "-shared engines)")
    parser.add_argument("--state-dir", default="/tmp/l4m-e2e", help="the benchmark cluster's state directory")
    parser.add_argument("--spawner-port", type=int, default=7510)
    parser.add_argument("--scheduler-port", type=int, default=7511)
    parser.add_argument("--gateway-port", type=int, default=7512, help="the gateway's, when l4m-gateway runs")
    parser.add_argument("--metrics-port-base", type=int, default=9510)
    parser.add_argument("--peer-timeout-s", type=float, default=1800.0)
    parser.add_argument("--batching", default="adaptive", help="the l4m scheduler's forward-batch strategy")
    parser.add_argument("--session-transport", default="framed", choices=["framed", "grpc"],
                        help="how the controllers speak L4M (`l4m up --session-transport`)")
    parser.add_argument("--executor-transport", default="framed", choices=["framed", "grpc"],
                        help="how the scheduler sends batches (`l4m up --executor-transport`)")
    parser.add_argument("--warm-pool-size", type=int, default=None,
                        help="the spawner's warm sandboxes (default: the largest N); each l4m run starts once "
                        "the pool is full")
    parser.add_argument("--warm-pool-quiet-wait-s", type=float, default=None,
                        help="the most each round of the pool's refill waits for a CPU core to spare "
                        "(`l4m up --warm-pool-quiet-wait-s`; default: the spawner's, refill at once)")
    parser.add_argument("--max-instances-per-process", type=int, default=None,
                        help="how many `-shared` launches run in one controller process (`l4m up "
                        "--max-instances-per-process`; default: the spawner's, 16)")
    parser.add_argument("--controller-cpu-policy", choices=("batch", "normal"), default=None,
                        help="the CPU policy controllers run under (`l4m up --controller-cpu-policy`; default: "
                        "the spawner's, batch)")
    parser.add_argument("--control-plane-cpu-policy", choices=("batch", "normal"), default="batch",
                        help="the CPU policy of the stack's scheduler, spawner and gateway (`l4m up "
                        "--control-plane-cpu-policy`)")
    parser.add_argument("--pool-timeout-s", type=float, default=600.0, help="how long to wait for a full pool")
    parser.add_argument("--long-prompt", type=int, default=0, metavar="TOKENS",
                        help="issue #21: a TOKENS-token prompt arriving beside N decoding streams, chunked and "
                        "unchunked (the l4m stack only; --engines and --plot are ignored)")
    parser.add_argument("--prefill-chunk-tokens", type=int, default=None,
                        help="--long-prompt's chunked runs: the scheduler's chunk (default: the scheduler's)")
    parser.add_argument("--prefill-chunk-token-slots", type=int, default=None,
                        help="--long-prompt's chunked runs: chunks shrink as their context grows (the scheduler's "
                        "--prefill-chunk-token-slots; default: fixed-size chunks)")
    parser.add_argument("--variants", default="chunked,unchunked",
                        help="--long-prompt's variants to run, comma separated: chunked, unchunked")
    parser.add_argument("--device", default="cpu",
                        help="the stack's executor and l4m-executor's (cuda:0: bfloat16, the executor's default there); "
                             "the other peers stay on the CPU")
    parser.add_argument("--quantized-activations", default="float32", choices=["float32", "bfloat16"],
                        help="the executor's precision of x in the 4-bit products, for the stack and l4m-executor "
                        "alike (`l4m up --quantized-activations`; bfloat16 needs AVX-512 BF16)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float16"],
                        help="the executor's KV cache element type, for the stack and l4m-executor alike "
                        "(`l4m up --kv-cache-dtype`)")
    parser.add_argument("--out", default="bench/results/e2e.json")
    parser.add_argument("--plot", default="", help="write a tok/s vs N PNG here (e.g. docs/img/e2e.png)")
    args = parser.parse_args()
    unknown = set(args.engines.split(",")) - set(ALL_ENGINES)
    if unknown:
        parser.error(f"unknown engines {sorted(unknown)}; known: {', '.join(ALL_ENGINES)}")
    try:
        sizes = [int(n) for n in args.n.split(",")]
    except ValueError:
        parser.error(f"--n must be comma-separated integers, got {args.n!r}")
    if min(sizes + [args.prompt_tokens, args.new_tokens, args.repeats]) < 1:
        parser.error("--n values, --prompt-tokens, --new-tokens and --repeats must be at least 1")
    if args.long_prompt and args.new_tokens <= LONG_PROMPT_AFTER_TOKENS:
        parser.error(f"--long-prompt needs --new-tokens above {LONG_PROMPT_AFTER_TOKENS}: the streams must still "
                     "decode when it arrives")
    if not args.variants or set(args.variants.split(",")) - {"chunked", "unchunked"}:
        parser.error(f"--variants takes chunked and/or unchunked, got {args.variants!r}")
    if args.long_prompt < 0 or (args.prefill_chunk_tokens or 1) < 1:
        parser.error("--long-prompt and --prefill-chunk-tokens must be at least 1")
    if args.warm_pool_size is None:
        args.warm_pool_size = max(sizes) + (1 if args.long_prompt else 0)
    return args


def main() -> None:
    args = parse_args()
    # SIGTERM (a `timeout`, a killed job) as Ctrl-C: the sweep's `finally` stops the cluster it started,
    # whose services run in a session of their own and would otherwise outlive this process.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    load_before = os.getloadavg()
    results = asyncio.run(long_prompt_sweep(args) if args.long_prompt else sweep(args))
    results.update(args=vars(args), load_average=[load_before, os.getloadavg()], cpu=peers.cpu_model(),
                   num_cpus=os.cpu_count())
    if args.long_prompt:
        print_long_prompt_table(results)
    else:
        print_table(results)
    print(f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after; {results['cpu']}"
          + ("; x rounded to bf16 in the 4-bit products (l4m)" if args.quantized_activations == "bfloat16" else "")
          + ("; KV cache in float16 (l4m)" if args.kv_cache_dtype == "float16" else ""))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    if args.plot and not args.long_prompt:
        plot(results, Path(args.plot))


if __name__ == "__main__":
    main()
