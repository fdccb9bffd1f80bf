"""Every example controller on the real model (executor + scheduler on loopback, local controller
processes), asserting the property the example exists to show."""

from __future__ import annotations

import json
import re
from pathlib import Path

import grpc
import jsonschema
import pytest

from l4m.tokenizer import Tokenizer
from l4m.v1 import l4m_pb2, l4m_pb2_grpc
from tests.integration.conftest import REPO, L4MCluster, ServiceProcess, executor_argv
from tests.integration.examples.executor_alone import executor_greedy

EXAMPLES = REPO / "examples" / "controllers"

pytestmark = pytest.mark.slow


def example(name: str) -> Path:
    return EXAMPLES / f"{name}.py"


@pytest.fixture(scope="module")
def lone_executor():
    """A second executor that only the reference decoding talks to."""
    process = ServiceProcess("lone-executor", executor_argv())
    yield process.address
    process.stop()


@pytest.fixture(scope="module")
def model_info(l4m_cluster: L4MCluster) -> l4m_pb2.GetInfoResponse:
    with grpc.insecure_channel(l4m_cluster.scheduler_address) as channel:
        return l4m_pb2_grpc.L4MServiceStub(channel).GetInfo(l4m_pb2.GetInfoRequest(), timeout=30)


@pytest.fixture(scope="module")
def tokenizer(model_info: l4m_pb2.GetInfoResponse) -> Tokenizer:
    return Tokenizer(model_info.model.tokenizer_json, model_info.model.chat_template)


def test_text_completion_equals_executor_alone_greedy(run_controller, lone_executor, tokenizer, model_info) -> None:
    prompt = "What is the capital of France?"
    run = run_controller(example("text_completion"), prompt, "32")
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))
    assert len(prompt_ids) == summary["prompt_tokens"]
    reference = executor_greedy(lone_executor, prompt_ids, 32, stop_token_ids=model_info.model.stop_token_ids)
    assert summary["token_ids"] == reference
    assert "".join(run.messages[:-1]) == summary["text"]  # the streamed chunks add up to the text


def test_beam_search_results_are_sorted_by_logprob(run_controller) -> None:
    run = run_controller(example("beam_search"), "Name a fruit.", "3", "8")
    assert run.returncode == 0, run.stderr
    beams = run.summary()["beams"]
    scores = [b["logprob"] for b in beams]
    assert len(beams) == 3 and scores == sorted(scores, reverse=True)
    assert len({tuple(b["token_ids"]) for b in beams}) == 3 and all(s < 0 for s in scores)


def test_json_schema_output_parses_and_validates(run_controller) -> None:
    for who in ("a French chef", "a retired astronaut"):
        run = run_controller(example("json_schema"), who)
        assert run.returncode == 0, run.stderr
        summary = run.summary()
        jsonschema.validate(json.loads(summary["text"]), summary["schema"])


def test_regex_constrained_output_matches(run_controller) -> None:
    run = run_controller(example("regex"))
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    assert re.fullmatch(summary["date_regex"], summary["date"])
    assert re.fullmatch(summary["answer_regex"], summary["answer"])


def test_prefix_import_skips_the_prefill(run_controller, tmp_path) -> None:
    name = f"test-prefix-{tmp_path.name}"
    first = run_controller(example("prefix_cache"), "When is breakfast?", name)
    second = run_controller(example("prefix_cache"), "When is breakfast?", name)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    a, b = first.summary(), second.summary()
    assert (a["imported"], b["imported"]) == (False, True)
    assert a["text"] == b["text"]  # same KV, same greedy answer
    # All of the prefix but its last token (kept pending, fed with the question) is skipped.
    assert a["forward_tokens"] - b["forward_tokens"] == a["prefix_tokens"] - 1


def test_parallel_forks_answer_every_question(run_controller) -> None:
    run = run_controller(example("parallel_fork"))
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    assert len(summary["answers"]) == len(summary["questions"]) == 4 and all(summary["answers"])
    assert "cold" in summary["answers"][3].lower()


def test_tree_of_thought_joins_on_the_best_leaf(run_controller) -> None:
    run = run_controller(example("tree_of_thought"))
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    assert len(summary["leaves"]) == 4 and summary["scores"][summary["best"]] == max(summary["scores"])


def test_agent_tool_result_is_appended_to_the_same_kv(run_controller) -> None:
    run = run_controller(example("agent_loop"), "What is 37 times 12?")
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    assert re.fullmatch(r"calculate\([0-9]+ [-+*/] [0-9]+\)", summary["call"])
    # After the tool, only the observation and the answer are fed: nothing before it is recomputed.
    assert summary["tokens_fed_after_tool"] < summary["context_tokens"] / 2


def test_windowed_attention_keeps_page_usage_bounded(run_controller) -> None:
    run = run_controller(example("windowed_attention"), "320", "64", "4")
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    page_size = summary["kv_page_size"]
    bound = 1 + -(-summary["window"] // page_size) + 2  # sink page + window pages + the page being filled
    assert summary["generated_tokens"] == 320 and summary["max_pages_held"] <= bound
    assert summary["next_position"] > summary["kv_slots"] + 4 * page_size  # pages really were dropped


def test_speculative_decoding_is_greedy_with_fewer_passes(run_controller) -> None:
    run = run_controller(example("speculative"), "96")
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    assert summary["speculative_token_ids"] == summary["greedy_token_ids"]
    assert summary["speculative_passes"] < summary["greedy_passes"]


def test_output_validation_prefers_the_right_answer(run_controller) -> None:
    run = run_controller(example("output_validation"))
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    assert summary["best"] == "Tokyo" and max(summary["logprobs"]) == summary["logprobs"][0]


def test_parent_gathers_children_answers_through_shared_variables(run_controller) -> None:
    run = run_controller(example("spawn_children"))
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    assert all(summary["children_ok"]) and len(summary["answers"]) == 2 and all(summary["answers"])
    assert summary["log_lines"] == 2
