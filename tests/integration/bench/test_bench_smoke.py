"""Smoke tests of the end-to-end benchmarks: tiny runs through a real cluster (real model, sandboxes,
gRPC) whose JSON must hold sane numbers, and the clear errors their flags give."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from l4m.executor.openmp import default_wait, describe_wait
from tests.integration.harness import REPO, free_metrics_port_base, free_ports
from tests.unit.executor.tiny_models import build_hf


def run_bench(script: str, *args: str, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "bench" / script), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout_s)


def cluster_flags(tmp_path: Path) -> list[str]:
    spawner, scheduler = free_ports(2)
    return ["--state-dir", str(tmp_path / "state"), "--spawner-port", str(spawner),
            "--scheduler-port", str(scheduler), "--metrics-port-base", str(free_metrics_port_base())]


@pytest.mark.slow
def test_e2e_full_stack_and_executor_alone(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    done = run_bench("e2e.py", "--n", "2", "--new-tokens", "4", "--engines",
                     "l4m,l4m-stepwise,l4m-one,l4m-stepwise-one,l4m-gateway,l4m-executor", "--out", str(out),
                     *cluster_flags(tmp_path),
                     "--gateway-port", str(free_ports(1)[0]))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    rows = {row["engine"]: row for row in results["rows"]}
    assert set(rows) == {"l4m", "l4m-stepwise", "l4m-one", "l4m-stepwise-one", "l4m-gateway", "l4m-executor"}
    # The executor alone waits as the executor service does (l4m/executor/openmp.py), unless the caller chose.
    assert rows["l4m-executor"]["notes"]["openmp_wait"] == describe_wait(os.environ | default_wait(os.environ))
    # The OpenAI requests through the gateway decode the same tokens, and the ratio to `l4m run` is there.
    assert results["token_checks"]["2"]["l4m-gateway"]["num_streams_identical"] == 2
    assert results["ratios"]["l4m-gateway/l4m"]["2"] > 0 and "gateway" in rows["l4m-gateway"]["cpu_s_by_role"]
    for row in rows.values():
        assert row["n"] == 2 and row["generated_tokens"] == 8
        assert row["tok_s"] > 0 and row["peak_rss_mib"] > 0
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
        assert 0 <= row["tpot_p50_ms"] <= row["tpot_p99_ms"] and 0 <= row["itl_p50_ms"] <= row["itl_p99_ms"]
    # `-one`: both streams from one controller (bench/controllers/completions.py), each reported apart.
    for engine in ("l4m", "l4m-stepwise", "l4m-one", "l4m-stepwise-one"):
        stack = rows[engine]
        assert stack["ttft_controller_p50_ms"] > 0
        assert stack["cpu_s_by_role"]["executor"] > 0
        # the full stack decodes greedily with the same executor: the same tokens as the executor alone
        assert results["token_checks"]["2"][engine] == {"prompt0_matching_prefix": 4, "num_streams_identical": 2,
                                                       "num_streams": 2}
        assert results["ratios"][engine]["2"] > 0
        # one repeat: one pair, the stack's run against the executor alone's of the same repeat
        (pair,) = results["pair_ratios"][engine]["2"]
        assert pair == pytest.approx(rows[engine]["tok_s"] / rows["l4m-executor"]["tok_s"])
    # One round trip per token: 4 commands per stream. With continuation: the prompt pass (the first
    # token comes alone), then the other three tokens in one command.
    for suffix in ("", "-one"):
        assert rows[f"l4m-stepwise{suffix}"]["num_forward_text_commands"] == 2 * 4
        assert rows[f"l4m{suffix}"]["num_forward_text_commands"] == 2 * 2
    assert "| l4m | 2 |" in done.stdout and "| l4m-stepwise | 2 |" in done.stdout
    # Issue #19's table: the stack's CPU per generated token by role, the control plane's sum among them.
    table = done.stdout[done.stdout.index("CPU us per generated token, by role"):]
    assert "| engine | N | executor | scheduler |" in table and "control plane |" in table
    stepwise = next(line for line in table.splitlines() if line.startswith("| l4m-stepwise | 2 |"))
    cells = [float(cell) for cell in stepwise.strip("| ").split(" | ")[2:] if cell != "-"]
    assert cells[0] > 0 and cells[-1] > 0  # the executor's, and the control plane's


@pytest.mark.slow
def test_e2e_long_prompt_beside_decoding_streams(tmp_path: Path) -> None:
    """--long-prompt, tiny: a 300-token prompt in chunks of 64 beside 2 stepwise decoding streams, then in
    one pass, each on a cluster of its own; the window and the streams' steps in and around it."""
    out = tmp_path / "e2e-long.json"
    done = run_bench("e2e.py", "--n", "2", "--new-tokens", "24", "--long-prompt", "300", "--prefill-chunk-tokens",
                     "64", "--out", str(out), *cluster_flags(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {row["variant"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"chunked", "unchunked"}
    assert (rows["chunked"]["prefill_chunk_tokens"], rows["unchunked"]["prefill_chunk_tokens"]) == (64, 8192)
    for row in rows.values():
        assert row["n"] == 2 and row["long_prompt_tokens"] == 300 and row["generated_tokens"] == 2 * 24
        assert 0 < row["window_start_s"] < row["window_end_s"]
        assert row["long_ttft_ms"] > 0 and row["long_ttft_user_ms"] > 0
        assert row["median_step_ms"] > 0 and row["num_window_gaps"] > 0
        assert 0 < row["window_itl_p50_ms"] <= row["window_itl_p99_ms"] <= row["window_itl_max_ms"]
        assert row["p99_over_median_step"] == pytest.approx(row["window_itl_p99_ms"] / row["median_step_ms"])
        gaps = [gap for gap, _ in row["window_top_gaps_ms"]]
        assert gaps == sorted(gaps, reverse=True) and gaps[0] == pytest.approx(row["window_itl_max_ms"], abs=0.06)
    assert "| chunked | 64 | 2 | 300 |" in done.stdout


@pytest.mark.slow
def test_agentic_variants_agree(tmp_path: Path) -> None:
    out = tmp_path / "agentic.json"
    done = run_bench("agentic.py", "--repeats", "1", "--prefix-tokens", "40", "--branches", "2",
                     "--branch-tokens", "3", "--tool-calls", "1", "--turn-tokens", "3",
                     "--observation-tokens", "5", "--out", str(out), *cluster_flags(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {row["workload"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"branches", "agent"}
    for row in rows.values():
        assert row["same_tokens"] is True
        assert row["baseline_wall_s"] > 0 and row["stateful_wall_s"] > 0
        assert row["stateful_tokens_fed"] < row["baseline_tokens_fed"]  # the point of keeping KV


def test_relay_counts_every_message_and_prices_it_by_role(tmp_path: Path) -> None:
    """bench/relay.py, tiny: every message a controller sends reaches the attached user, on frames with
    batched Attach responses and on gRPC with one response per event; CPU per message by role. The relay
    never uses the model: each mode's cluster serves a tiny random one, which loads in a second."""
    out = tmp_path / "relay.json"
    build_hf("llama", tmp_path / "tiny-llama")
    spawner, scheduler = free_ports(2)
    done = run_bench("relay.py", "--streams", "2", "--messages", "50", "--out", str(out), "--state-dir",
                     str(tmp_path / "state"), "--spawner-port", str(spawner), "--scheduler-port", str(scheduler),
                     "--modes", "framed/batched,grpc/single", "--model", str(tmp_path / "tiny-llama"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["mode"] for row in rows] == ["framed/batched", "grpc/single"]
    for row in rows:
        assert row["streams"] == 2 and row["messages"] == 100 and row["messages_per_s"] > 0
        assert row["controller_cpu_us_per_message"] > 0 and row["user_cpu_us_per_message"] > 0
        assert row["spawner_launch_cpu_ms"] > 0


def test_shared_text_launches_tokenize_in_one_process(tmp_path: Path) -> None:
    """bench/shared_text.py, tiny: 3 shared launches that tokenize, with the process's one tokenizer and with
    each instance building its own, on a cluster serving a tiny random model (its tokenizer is real)."""
    out = tmp_path / "shared_text.json"
    build_hf("llama", tmp_path / "tiny-llama")
    spawner, scheduler = free_ports(2)
    done = run_bench("shared_text.py", "--n", "3", "--repeats", "2", "--new-tokens", "2", "--out", str(out),
                     "--state-dir", str(tmp_path / "state"), "--spawner-port", str(spawner), "--scheduler-port",
                     str(scheduler), "--model", str(tmp_path / "tiny-llama"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["variant"] for row in rows] == ["shared", "each", "each", "shared"]
    assert all(row["n"] == 3 and row["last_exit_s"] >= row["median_exit_s"] > 0 for row in rows)
    assert "shared: median of 2 rounds" in done.stdout and "each: median of 2 rounds" in done.stdout


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("shared_text.py", ["--n", "0"], "--n, --new-tokens and --repeats must be at least 1"),
        ("relay.py", ["--streams", "1,x"], "--streams must be comma-separated integers"),
        ("relay.py", ["--messages", "0"], "must be at least 1"),
        ("relay.py", ["--modes", "framed/batched,carrier/single"], "unknown modes ['carrier/single']"),
        ("e2e.py", ["--engines", "l4m,vllm"], "unknown engines ['vllm']"),
        ("e2e.py", ["--n", "1,x"], "--n must be comma-separated integers"),
        ("e2e.py", ["--new-tokens", "0"], "must be at least 1"),
        ("e2e.py", ["--long-prompt", "300", "--variants", "chunked,sliced"], "--variants takes chunked and/or unchunked"),
        ("chunk_slots.py", ["--contexts", "3072,256"], "need 0 <= first context < second"),
        ("chunk_slots.py", ["--contexts", "256"], "--contexts takes two comma-separated token counts"),
        ("agentic.py", ["--workloads", "chess"], "unknown workloads ['chess']"),
        ("agentic.py", ["--branches", "0"], "must be at least 1"),
        ("peers.py", ["--engine", "l4m-executor", "--streams", "0"], "must be at least 1"),
        ("scheduler.py", ["--executor-device", "cpu"], "--executor-device goes with --grpc"),
        ("scheduler.py", ["--forward-latency-ms", "2"], "--forward-latency-ms goes with --grpc"),
        ("scheduler.py", ["--grpc", "--forward-latency-ms", "-1"], "--forward-latency-ms must be at least 0"),
        ("executor_host.py", ["--batches", "1,x"], "--batches: comma-separated integers"),
        ("executor_host.py", ["--steps", "0"], "must be at least 1"),
        ("cpu_policy.py", ["--policies", "normal,fifo"], "unknown policies ['fifo']; known: normal, batch"),
        ("cpu_policy.py", ["--wakers", "0"], "--wakers must be at least 1"),
    ],
)
def test_bad_flags_are_refused_clearly(script: str, args: list[str], message: str) -> None:
    done = run_bench(script, *args, timeout_s=60)
    assert done.returncode == 2
    assert message in done.stderr


@pytest.mark.parametrize("mode", [(), ("--grpc",), ("--grpc", "--framed")], ids=["in-process", "grpc", "framed"])
def test_scheduler_bench_prints_a_row_per_strategy(mode: tuple[str, ...]) -> None:
    """bench/scheduler.py, tiny: every strategy ran commands through the scheduler (in-process core, or
    scheduler and simulated executor processes with clients over gRPC or framed sessions)."""
    done = run_bench("scheduler.py", *mode, "--duration-s", "0.3", "--sizes", "2", timeout_s=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines()[2:] if line.strip()]
    assert [row[0] for row in rows] == ["adaptive", "t-only:1", "k-only:2", "k-or-t:8:1"], done.stdout
    for row in rows:
        assert row[1] == "2" and float(row[2].replace(",", "")) > 0, done.stdout
        if mode:  # the scheduler's CPU per command, and what one core of it takes: 1e6 / that
            scheduler_us, one_core = float(row[6]), float(row[7].replace(",", ""))
            assert scheduler_us > 0 and abs(one_core * scheduler_us / 1e6 - 1) < 0.01, done.stdout


def test_scheduler_bench_paces_the_simulated_executor() -> None:
    """bench/scheduler.py --forward-latency-ms: every forward batch takes that long, whatever its size, so two
    lock-step instances at 50 ms a batch answer at most ~40 commands/s, in batches of both."""
    done = run_bench("scheduler.py", "--grpc", "--framed", "--sdk", "--forward-latency-ms", "50", "--strategies",
                     "adaptive", "--duration-s", "0.6", "--sizes", "2", timeout_s=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "forward batches of 50 ms" in done.stdout
    rows = [line.split() for line in done.stdout.splitlines()[2:] if line.strip()]
    assert [row[:2] for row in rows] == [["adaptive", "2"]], done.stdout
    commands_per_s, mean_batch = float(rows[0][2].replace(",", "")), float(rows[0][3])
    assert 0 < commands_per_s <= 45 and mean_batch > 1.5, done.stdout


def test_scheduler_bench_runs_in_front_of_the_real_executor() -> None:
    """bench/scheduler.py --executor-device: SDK sessions -> scheduler -> l4m's executor with the default
    model (on the CPU here; cuda:0 on a GPU machine), one token per command, after a warm-up."""
    done = run_bench("scheduler.py", "--grpc", "--framed", "--sdk", "--executor-device", "cpu", "--strategies",
                     "adaptive", "--duration-s", "0.5", "--sizes", "2", timeout_s=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "scheduler + l4m executor (cpu) processes" in done.stdout
    rows = [line.split() for line in done.stdout.splitlines()[2:] if line.strip()]
    assert [row[:2] for row in rows] == [["adaptive", "2"]], done.stdout
    assert float(rows[0][2].replace(",", "")) > 0 and float(rows[0][3]) > 1.0, done.stdout  # batched pairs


@pytest.mark.parametrize("decode", ["steps", "continuation"])
def test_executor_bench_measures_each_engine(tmp_path: Path, decode: str) -> None:
    """bench/executor.py, tiny: prefill and decode rates of the executor alone, decoding one
    forward_text per token or letting continuation feed the tokens back."""
    from tests.unit.executor.test_q4_gemm import has_avx512_bf16

    out = tmp_path / "executor.json"
    done = run_bench("executor.py", "--batches", "2", "--prompt-tokens", "8", "--new-tokens", "4", "--decode", decode,
                     "--engines", "l4m-q4,l4m-q4-xbf16,l4m-q4-kv16,l4m-fp32", "--threads", "1", "--out", str(out),
                     timeout_s=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    # x in bf16 runs where the CPU has AVX-512 BF16; elsewhere the bench says why it skips it
    xbf16 = [("l4m-q4-xbf16", 2)] if has_avx512_bf16() else []
    assert [(row["engine"], row["batch"]) for row in rows] == [("l4m-q4", 2), *xbf16, ("l4m-q4-kv16", 2),
                                                              ("l4m-fp32", 2)]
    if not xbf16:
        assert "needs the CPU kernels' avx512_bf16 instruction set" in done.stdout + done.stderr
    for row in rows:
        assert row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0


def test_executor_host_bench_splits_each_batch_around_the_kernels(tmp_path: Path) -> None:
    """bench/executor_host.py, tiny: decode batches through the executor service's batch path, each phase timed;
    host work is what is not the kernels, nor the sampling (reported apart)."""
    out = tmp_path / "executor_host.json"
    done = run_bench("executor_host.py", "--batches", "1,3", "--context", "20", "--steps", "3", "--out", str(out),
                     timeout_s=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["batch"] for row in rows] == [1, 3]
    for row in rows:
        assert all(row[phase] > 0 for phase in ("convert", "prepare", "sample", "reply", "kernels")), row
        assert row["host"] == pytest.approx(row["convert"] + row["prepare"] + row["reply"])
        assert row["kernels"] > row["convert"], row  # a forward pass of the real model outweighs its conversion
    assert "| 3 |" in done.stdout


def test_cpu_policy_bench_decodes_beside_wakers_under_each_policy(tmp_path: Path) -> None:
    """bench/cpu_policy.py, tiny: decode phases with no wakers, then wakers under each policy; the wakers'
    CPU time is counted while the steps run."""
    out = tmp_path / "cpu_policy.json"
    done = run_bench("cpu_policy.py", "--batch", "2", "--prompt-tokens", "8", "--steps", "3", "--rounds", "1",
                     "--wakers", "2", "--period-ms", "2", "--burn-ms", "1", "--out", str(out), timeout_s=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["policies"]
    assert list(rows) == ["none", "normal", "batch"]
    assert rows["none"]["waker_cpu_ms_per_step"] == 0
    for name in ("normal", "batch"):
        assert rows[name]["step_ms"] > 0 and rows[name]["waker_cpu_ms_per_step"] > 0, rows[name]
    assert "| batch |" in done.stdout


def test_transport_bench_measures_both_transports(tmp_path: Path) -> None:
    """bench/transport.py, tiny: round trips through an echo server on grpc.aio and on framed messages."""
    out = tmp_path / "transport.json"
    done = run_bench("transport.py", "--streams", "2", "--duration-s", "0.3", "--out", str(out), timeout_s=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {row["mode"] for row in rows} == {"grpc.aio", "framed"}
    for row in rows:
        assert row["streams"] == 2 and row["round_trips"] > 0
        assert row["client_cpu_us_per_round_trip"] > 0 and row["server_cpu_us_per_round_trip"] > 0


def test_sdk_bench_measures_every_mode_on_both_transports(tmp_path: Path) -> None:
    """bench/sdk.py, tiny: the decode loop's CPU per token (stepwise, with continuation, with a stop string,
    under a JSON schema), over gRPC and over framed sessions; llguidance's own time apart."""
    out = tmp_path / "sdk.json"
    done = run_bench("sdk.py", "--tokens", "100", "--repeats", "1", "--out", str(out), timeout_s=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {(row["mode"], row["transport"]): row for row in json.loads(out.read_text())["rows"]}
    modes = ("stepwise", "continuation", "stop-string", "json-schema")
    assert set(rows) == {(mode, transport) for mode in modes for transport in ("grpc", "framed")}
    for (mode, _), row in rows.items():
        assert row["tokens"] == 100 and row["sdk_cpu_ms_per_token"] > 0
        assert (row["llguidance_cpu_ms_per_token"] > 0) == (mode == "json-schema")
        assert row["scheduler_cpu_ms_per_token"] >= 0
    # The scheduler's CPU is read from /proc in 10 ms ticks, and one run's 100 round trips cost it ~9 ms
    # (a run measured 0.0 in CI): the six stepwise runs together are well over a tick.
    assert sum(row["scheduler_cpu_ms_per_token"] for (mode, _), row in rows.items() if mode != "continuation") > 0


def test_sdk_bench_runs_beside_a_slow_executor_and_a_cache_thrasher(tmp_path: Path) -> None:
    """bench/sdk.py --forward-latency-ms --thrash-mib: the loop sleeps through each forward batch while a
    process streams a buffer beside it, and the run says so; the thrasher ends with the bench."""
    out = tmp_path / "sdk.json"
    done = run_bench("sdk.py", "--tokens", "50", "--repeats", "1", "--modes", "stepwise", "--transports", "framed",
                     "--forward-latency-ms", "2", "--thrash-mib", "16", "--out", str(out), timeout_s=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "forward batches of 2 ms; a 16 MiB cache thrasher beside it" in done.stdout
    result = json.loads(out.read_text())
    assert result["forward_latency_ms"] == 2 and result["thrash_mib"] == 16
    (row,) = result["rows"]
    assert row["tokens"] == 50 and row["sdk_cpu_ms_per_token"] > 0
    assert row["wall_ms_per_token"] >= 2, "every token waited for a forward batch of 2 ms"
    thrashers = subprocess.run(["pgrep", "-f", "buffer.count"], capture_output=True, text=True).stdout.split()
    assert not thrashers, f"the thrasher outlived the bench: {thrashers}"
    assert run_bench("sdk.py", "--thrash-mib", "-1").returncode == 2


def test_chunk_slots_fit_recovers_the_cost_model_and_sizes_the_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/chunk_slots.py's fit, on extra times made from the scheduler's own cost model."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import chunk_slots

    from l4m.scheduler.prefill import chunk_cost

    k, a, b, chunk = 4e-3, 0.8e-3, 0.75e-6, 32  # seconds per batch, per token, per slot read

    def extra(size: int, context: int) -> float:
        return k + a * size + b * chunk_cost(size, context, 0)

    fitted = chunk_slots.fit(chunk, (256, 3072), (extra(chunk, 256), extra(chunk, 3072), extra(chunk // 2, 256)))
    assert fitted == pytest.approx((k, a, b))
    room = 0.03  # s: the most tokens whose extra time at no context fits it
    size = chunk_slots.best_chunk(*fitted, room, 48)
    assert extra(size, 0) <= room < extra(size + 1, 0)
    assert chunk_slots.best_chunk(*fitted, 1.0, 48) == 48  # capped by the rows the fused path takes
