"""Every example controller run as a user runs it, `l4m run FILE -- ARGS` against one real `l4m up`
(controllers in bubblewrap sandboxes, default limits), asserting the property the example exists to show.

What only the controller can see (its beams, its parse of the output) comes from its JSON summary, the
last line of `l4m run`'s stdout. What the cluster can count itself (tokens through forward passes,
forward_text commands, batches, pages held, sandboxes launched) is read from the services' Prometheus
endpoints around each run; the tests run one at a time, so the deltas are that run's alone.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import jsonschema
import pytest

from l4m.generation import DEFAULT_CONTINUATION_STEPS
from l4m.tokenizer import Tokenizer
from l4m.v1 import l4m_pb2, l4m_pb2_grpc
from tests.integration.examples.executor_alone import executor_greedy
from tests.integration.harness import REPO, CliRun, ServiceProcess, UpCluster, executor_args

EXAMPLES = REPO / "examples" / "controllers"

pytestmark = pytest.mark.slow


def example(name: str) -> Path:
    return EXAMPLES / f"{name}.py"


def cluster_counts(cluster: UpCluster) -> dict[str, float]:
    """The cluster's own counters: executor-0, the scheduler, the spawner."""
    executor, scheduler, spawner = (cluster.metrics(s) for s in ("executor", "scheduler", "spawner"))
    return {
        "forward_tokens": executor.value("l4m_executor_forward_tokens_total"),
        "forward_commands": scheduler.value("l4m_scheduler_commands_total", 0.0, kind="forward_text"),
        "forward_batches": scheduler.value("l4m_scheduler_batch_size_count", kind="forward_text"),
        "forward_batch_items": scheduler.value("l4m_scheduler_batch_size_sum", kind="forward_text"),
        "launches": spawner.value("l4m_spawner_launch_latency_seconds_count", 0.0, sandbox="process"),
    }


@pytest.fixture
def counted(l4m_up: UpCluster, l4m_run: Callable[..., CliRun]) -> Callable[..., tuple[CliRun, dict[str, float]]]:
    """`counted(program, *args)`: the run and what the cluster counted during it."""

    def run(program: Path, *args: str) -> tuple[CliRun, dict[str, float]]:
        before = cluster_counts(l4m_up)
        result = l4m_run(program, *args)
        after = cluster_counts(l4m_up)
        return result, {key: after[key] - before[key] for key in before}

    return run


class PageSampler:
    """Reads the scheduler's `l4m_scheduler_kv_pages_used` gauge over and over in a thread while a run goes
    on. Samples can miss a short peak, so the controller's own exact count is checked as well."""

    def __init__(self, cluster: UpCluster) -> None:
        self._cluster = cluster
        self.samples: list[float] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def pages_used(self) -> float:
        return self._cluster.metrics("scheduler").value("l4m_scheduler_kv_pages_used")

    def _sample(self) -> None:
        while not self._done.is_set():
            self.samples.append(self.pages_used())
            self._done.wait(0.02)

    def __enter__(self) -> PageSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._done.set()
        self._thread.join()


@pytest.fixture(scope="session")
def lone_executor_process() -> Iterator[ServiceProcess]:
    """A second executor that only the reference decoding talks to, started and not waited for. Session-scoped
    so that, named before the cluster's fixtures, it starts before `l4m_up` and loads its model meanwhile."""
    process = ServiceProcess("l4m.executor", executor_args(), name="lone-executor")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def lone_executor(lone_executor_process: ServiceProcess) -> Iterator[str]:
    """The lone executor's address once it serves; stopped with this module."""
    yield lone_executor_process.wait_listening(300)
    lone_executor_process.stop()


@pytest.fixture(scope="module")
def model_info(l4m_up: UpCluster) -> l4m_pb2.GetInfoResponse:
    with grpc.insecure_channel(l4m_up.scheduler_address) as channel:
        return l4m_pb2_grpc.L4MServiceStub(channel).GetInfo(l4m_pb2.GetInfoRequest(), timeout=30)


@pytest.fixture(scope="module")
def tokenizer(model_info: l4m_pb2.GetInfoResponse) -> Tokenizer:
    return Tokenizer(model_info.model.tokenizer_json, model_info.model.chat_template)


# lone_executor_process first: it starts before the session's cluster (when this is the cluster's first test).
def test_text_completion_equals_executor_alone_greedy(lone_executor_process, counted, lone_executor, tokenizer,
                                                      model_info) -> None:
    prompt = "What is the capital of France?"
    run, counts = counted(example("text_completion"), prompt, "32")
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))
    assert len(prompt_ids) == summary["prompt_tokens"]
    reference = executor_greedy(lone_executor, prompt_ids, 32, stop_token_ids=model_info.model.stop_token_ids)
    assert summary["token_ids"] == reference
    # One message per chunk, one line each, before the summary: together they spell the text.
    assert len(run.lines) > 2 and "".join(run.lines[:-1]) == summary["text"].replace("\n", "")
    # The executor saw the prompt once and every generated token but the last once, one pass per token;
    # the controller asked for the first token alone, then for the rest in round trips of
    # 1 + DEFAULT_CONTINUATION_STEPS tokens (the last one ended early at the stop token or the length).
    num_generated = len(summary["token_ids"])
    assert counts["forward_tokens"] == summary["prompt_tokens"] + num_generated - 1
    assert counts["forward_commands"] == 1 + -(-(num_generated - 1) // (1 + DEFAULT_CONTINUATION_STEPS))


def test_beam_search_results_are_sorted_by_logprob(l4m_run) -> None:
    run = l4m_run(example("beam_search"), "Name a fruit.", "3", "8")
    assert run.returncode == 0, run.stderr
    beams = run.summary()["beams"]
    scores = [b["logprob"] for b in beams]
    assert len(beams) == 3 and scores == sorted(scores, reverse=True)
    assert len({tuple(b["token_ids"]) for b in beams}) == 3 and all(s < 0 for s in scores)


def test_json_schema_output_parses_and_validates(l4m_run) -> None:
    for who in ("a French chef", "a retired astronaut"):
        run = l4m_run(example("json_schema"), who)
        assert run.returncode == 0, run.stderr
        summary = run.summary()
        assert run.lines[0] == summary["text"]
        jsonschema.validate(json.loads(summary["text"]), summary["schema"])


def test_a_custom_json_schema_is_followed(l4m_run) -> None:
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "year": {"type": "integer"}},
              "required": ["city", "year"], "additionalProperties": False}
    run = l4m_run(example("json_schema"), "the city of the Eiffel tower", json.dumps(schema))
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    assert summary["schema"] == schema
    jsonschema.validate(json.loads(summary["text"]), schema)


def test_a_bad_json_schema_fails_the_run_with_what_to_fix(counted) -> None:
    bad = {"type": "object", "properties": {"age": {"type": "no-such-type"}}}
    run, counts = counted(example("json_schema"), "a French chef", json.dumps(bad))
    assert run.returncode == 1 and run.stdout == ""
    reason = run.stderr.strip().splitlines()[-1]
    assert reason.startswith("l4m: the controller ended: EXIT_REASON_CRASHED: exited with status 1: ")
    assert ("ConstraintError: the JSON schema was rejected by llguidance: Invalid type: no-such-type -- "
            "fix the schema where the error points") in reason
    assert counts["forward_tokens"] == 0  # refused before anything was fed


def test_regex_constrained_output_matches(l4m_run) -> None:
    run = l4m_run(example("regex"))
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    assert re.fullmatch(summary["date_regex"], summary["date"])
    assert re.fullmatch(summary["answer_regex"], summary["answer"])


def test_prefix_import_skips_the_prefill(counted, tmp_path) -> None:
    name = f"test-prefix-{tmp_path.name}"
    first, first_counts = counted(example("prefix_cache"), "When is breakfast?", name)
    second, second_counts = counted(example("prefix_cache"), "When is breakfast?", name)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    a, b = first.summary(), second.summary()
    assert (a["imported"], b["imported"]) == (False, True)
    assert a["text"] == b["text"]  # same KV, same greedy answer
    # The executor fed what each controller says it fed ...
    assert (first_counts["forward_tokens"], second_counts["forward_tokens"]) == (a["forward_tokens"], b["forward_tokens"])
    # ... and the import skipped all of the prefix but its last token (kept pending, fed with the question).
    assert first_counts["forward_tokens"] - second_counts["forward_tokens"] == a["prefix_tokens"] - 1


def test_parallel_forks_answer_every_question_in_shared_batches(counted) -> None:
    run, counts = counted(example("parallel_fork"))
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    assert len(summary["answers"]) == len(summary["questions"]) == 4 and all(summary["answers"])
    assert "cold" in summary["answers"][3].lower()
    assert counts["forward_commands"] == summary["forward_commands"]
    # The forks' steps went to the executor together: fewer batches than forward_text commands.
    assert counts["forward_batches"] < counts["forward_batch_items"] == counts["forward_commands"]


def test_tree_of_thought_joins_on_the_best_leaf(l4m_run) -> None:
    run = l4m_run(example("tree_of_thought"))
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    assert len(summary["leaves"]) == 4 and summary["scores"][summary["best"]] == max(summary["scores"])


def test_agent_tool_result_is_appended_to_the_same_kv(counted) -> None:
    run, counts = counted(example("agent_loop"), "What is 37 times 12?")
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    assert re.fullmatch(r"calculate\([0-9]+ [-+*/] [0-9]+\)", summary["call"])
    # After the tool, only the observation and the answer are fed: nothing before it is recomputed ...
    assert summary["tokens_fed_after_tool"] < summary["context_tokens"] / 2
    # ... and over the whole run the executor fed no token of the context twice.
    assert counts["forward_tokens"] <= summary["context_tokens"]


def test_windowed_attention_keeps_page_usage_bounded(l4m_up, l4m_run) -> None:
    sampler = PageSampler(l4m_up)
    baseline = sampler.pages_used()  # pages other runs left on purpose (persistent exports)
    with sampler:
        run = l4m_run(example("windowed_attention"), "320", "64", "4")
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    page_size = summary["kv_page_size"]
    bound = 1 + -(-summary["window"] // page_size) + 2  # sink page + window pages + the page being filled
    assert summary["generated_tokens"] == 320 and summary["max_pages_held"] <= bound
    assert summary["next_position"] > summary["kv_slots"] + 4 * page_size  # pages really were dropped
    # The scheduler's own page count, sampled during the run: never above the bound.
    held = [s - baseline for s in sampler.samples]
    assert max(held) > 0 and max(held) <= bound, held
    deadline = time.monotonic() + 30
    while sampler.pages_used() != baseline and time.monotonic() < deadline:  # the instance's end frees its pages
        time.sleep(0.1)
    assert sampler.pages_used() == baseline


def test_speculative_decoding_is_greedy_with_fewer_passes(counted) -> None:
    run, counts = counted(example("speculative"), "96")
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    assert summary["speculative_token_ids"] == summary["greedy_token_ids"]
    assert summary["speculative_passes"] < summary["greedy_passes"]
    # The scheduler received exactly the commands the controller counted; the passes (a continuation
    # step is one on the executor) are the greedy run's and the speculative run's.
    assert counts["forward_commands"] == summary["forward_commands"]
    assert summary["forward_passes"] == summary["greedy_passes"] + summary["speculative_passes"]


def test_output_validation_prefers_the_right_answer(l4m_run) -> None:
    run = l4m_run(example("output_validation"))
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    assert summary["best"] == "Tokyo" and max(summary["logprobs"]) == summary["logprobs"][0]


def test_parent_gathers_children_answers_through_shared_variables(counted) -> None:
    run, counts = counted(example("spawn_children"))
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    assert all(summary["children_ok"]) and len(summary["answers"]) == 2 and all(summary["answers"])
    assert summary["log_lines"] == 2
    assert counts["launches"] == 1 + len(summary["questions"])  # every child had a sandbox of its own
