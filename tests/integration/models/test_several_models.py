"""`l4m up` with two models: SmolLM2 and a random-initialised Qwen2 that transformers saved to a temp
dir. Controllers on each model at once, and one on both (`ctx.load_model`), get exactly the greedy
tokens each model's engine gives run alone; GetInfo lists and describes both; an unknown model is
refused naming the served ones."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from l4m.executor.commands import SamplerKind, SamplerSpec
from l4m.executor.engine import Engine, EngineConfig
from l4m.executor.weights import default_model_path, load_model
from l4m.v1 import l4m_pb2, l4m_pb2_grpc
from tests.integration.harness import L4M_CLI, REPO, UpCluster, service_env, up_cluster
from tests.unit.executor.conftest import PageTables
from tests.unit.executor.tiny_models import build_hf

PROGRAM = Path(__file__).with_name("two_models.py")
PROMPT = [1, 30, 200, 45, 7, 1500, 12, 99]  # token ids every model here has
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen2")
    build_hf("qwen2", path)
    return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, qwen_dir: Path) -> Iterator[UpCluster]:
    args = ["--model", f"smol={default_model_path()}", "--model", f"qwen={qwen_dir}"]
    with up_cluster(tmp_path_factory.mktemp("two-models"), args, metrics=False) as up:
        yield up


def _alone(path: Path | str, name: str) -> list[int]:
    """The model's engine alone, in this process, as `l4m up` configures it: one forward per token."""
    engine = Engine(load_model(path, name), EngineConfig(page_size=16, num_pages=8, num_embed_slots=0))
    tables, out, feed = PageTables(engine), [], PROMPT
    for _ in range(NUM_TOKENS):
        item = tables.item("s", feed, outputs=(len(feed) - 1,), sampler=SamplerSpec(SamplerKind.GREEDY))
        out.append(engine.forward_text([item])[0].outputs[0].token_id)
        feed = [out[-1]]
    return out


@pytest.fixture(scope="module")
def alone(qwen_dir: Path) -> dict[str, list[int]]:
    return {"smol": _alone(default_model_path(), "smol"), "qwen": _alone(qwen_dir, "qwen")}


def _run(cluster: UpCluster, *options: str, extra: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    argv = [str(L4M_CLI), "run", "--spawner", cluster.spawner_address, "--api-key-file", str(cluster.admin_key_path),
            *options, str(PROGRAM), "--", ",".join(map(str, PROMPT)), str(NUM_TOKENS), *extra]
    return subprocess.Popen(argv, cwd=REPO, env=service_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _result(process: subprocess.Popen[str], cluster: UpCluster) -> dict:
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, f"{stdout}\n{stderr}\n{cluster.logs()}"
    return json.loads(stdout.splitlines()[-1])


def test_get_info_lists_both_models_and_describes_each(cluster: UpCluster) -> None:
    with grpc.insecure_channel(cluster.scheduler_address) as channel:
        stub = l4m_pb2_grpc.L4MServiceStub(channel)
        default = stub.GetInfo(l4m_pb2.GetInfoRequest(omit_tokenizer_json=True), timeout=30)
        qwen = stub.GetInfo(l4m_pb2.GetInfoRequest(model="qwen", omit_tokenizer_json=True), timeout=30)
        assert list(default.model_names) == ["smol", "qwen"]
        assert default.model.name == "smol" and default.model.architecture == "llama"
        assert default.model.vocab_size == 49152
        assert qwen.model.architecture == "qwen2" and qwen.model.vocab_size == 2048 and qwen.num_executors == 1
        with pytest.raises(grpc.RpcError) as refused:
            stub.GetInfo(l4m_pb2.GetInfoRequest(model="llama"), timeout=30)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert refused.value.details() == "model 'llama' is not served here; served: smol, qwen"
    assert "executor-1" in cluster.output() and "(model qwen=" in cluster.output()


def test_controllers_on_each_model_at_once_match_each_engine_alone(cluster: UpCluster, alone) -> None:  # type: ignore[no-untyped-def]
    assert alone["smol"] != alone["qwen"]
    runs = {"default": _run(cluster), "qwen": _run(cluster, "--model", "qwen"),
            "both": _run(cluster, "--model", "smol", extra=("--also", "qwen"))}
    results = {name: _result(process, cluster) for name, process in runs.items()}
    assert results["default"] == {"served": ["smol", "qwen"], "tokens": {"smol": alone["smol"]}}
    assert results["qwen"]["tokens"] == {"qwen": alone["qwen"]}
    assert results["both"]["tokens"] == {"smol": alone["smol"], "qwen": alone["qwen"]}


def test_a_launch_on_a_model_nobody_serves_ends_with_the_served_names(cluster: UpCluster) -> None:
    process = _run(cluster, "--model", "llama")
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode != 0
    assert "model 'llama' is not served here; served: smol, qwen" in stderr, stderr
