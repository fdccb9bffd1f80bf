"""`l4m up` as a user runs it: one trace per launch across every process, one per gateway request (its
built-in handler's session or the program it launches below its `gateway.request` span), metrics on every
service, health and reflection, Ctrl-C, and a dying service stopping the rest.

The cluster is the real command (`.venv/bin/l4m up`) with `OTEL_EXPORTER_OTLP_ENDPOINT` pointing at an
OTLP receiver this test serves; the controller goes through `l4m run` (traced too, so the launch's
trace starts at the user's `l4m.run` span). The processes' output is printed when a test fails.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.examples.test_examples import example
from tests.integration.harness import L4M_CLI, REPO, UpCluster, up_cluster
from tests.integration.otlp_receiver import OtlpReceiver, ReceivedSpan

TRACED_SERVICES = {"l4m.cli", "l4m.spawner", "l4m.controller", "l4m.scheduler", "l4m.executor"}
# Commands of text_completion.py that reach an executor (get_info and synchronize are answered locally).
EXECUTOR_COMMANDS = {"l4m.allocate", "l4m.forward_text", "l4m.deallocate"}

pytestmark = pytest.mark.slow


def _descendants(pid: int) -> dict[int, str]:
    """pid -> command line of every process under `pid` (read from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, its_parent in parents.items():
            if its_parent == parent and child not in found:
                found[child] = _cmdline(child)
                frontier.append(child)
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _still_running(processes: dict[int, str]) -> dict[int, str]:
    return {pid: cmd for pid, cmd in processes.items() if cmd and _cmdline(pid) == cmd}


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TRACEPARENT", "L4M_"))}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


@dataclass
class TracedCluster:
    up: UpCluster
    receiver: OtlpReceiver
    env: dict[str, str]


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TracedCluster]:
    with OtlpReceiver() as receiver:
        # A short export delay so the services' batches arrive while the test waits, not at shutdown.
        env = _clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_BSP_SCHEDULE_DELAY="200")
        with up_cluster(tmp_path_factory.mktemp("traced"), env=env, echo_logs=True) as up:
            yield TracedCluster(up, receiver, env)


@pytest.fixture
def show_logs_on_failure(traced: TracedCluster, request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(traced.up.logs(num_output_chars=8000))


@dataclass
class LaunchRun:
    returncode: int
    stdout: str
    stderr: str


TEXT_COMPLETION = REPO / "examples" / "controllers" / "text_completion.py"


def _run(traced: TracedCluster, program: Path, *flags: str) -> LaunchRun:
    done = subprocess.run(
        [str(L4M_CLI), "run", "--spawner", traced.up.spawner_address, "--api-key-file",
         str(traced.up.state_dir / "admin.key"), *flags, str(program), "--", "--max-tokens", "4", "Hi"],
        cwd=REPO, env=traced.env, capture_output=True, text=True, timeout=120,
    )
    return LaunchRun(done.returncode, done.stdout, done.stderr)


@pytest.fixture(scope="module")
def launch(traced: TracedCluster) -> LaunchRun:
    return _run(traced, TEXT_COMPLETION)


# ---- the trace ---------------------------------------------------------------------------------------


def trace_problems(spans: list[ReceivedSpan], program: Path = TEXT_COMPLETION) -> list[str]:
    """Everything wrong with the trace of the (one) `l4m.run` of `program`; empty when the whole tree is there."""
    roots = [s for s in spans if s.name == "l4m.run" and s.attributes.get("l4m.program") == str(program)]
    if len(roots) != 1:
        return [f"expected one l4m.run span of {program.name}, got {len(roots)}"]
    root = roots[0]
    tree = [s for s in spans if s.trace_id == root.trace_id]
    by_id = {s.span_id: s for s in tree}
    named = {name: [s for s in tree if s.name == name] for name in
             ("spawner.launch", "spawner.instance", "controller.run", "scheduler.batch", "executor.batch")}
    problems = [f"{len(found)} {name} spans" for name, found in named.items()
                if len(found) != 1 and name not in ("scheduler.batch", "executor.batch")]
    if problems:
        return problems
    launch_span, instance_span, run_span = (named[n][0] for n in ("spawner.launch", "spawner.instance", "controller.run"))
    instance_id = launch_span.attributes.get("l4m.instance_id")
    expect = {
        "spawner.launch is the child of l4m.run": launch_span.parent_span_id == root.span_id,
        "spawner.instance is the child of spawner.launch": instance_span.parent_span_id == launch_span.span_id,
        "controller.run is the child of spawner.launch (TRACEPARENT)": run_span.parent_span_id == launch_span.span_id,
        "controller.run names the instance": run_span.attributes.get("l4m.instance_id") == instance_id,
        "the instance exited": instance_span.attributes.get("l4m.exit_reason") == "exited",
        "every service in the one trace": {s.service for s in tree} == TRACED_SERVICES,
    }
    problems += [what for what, ok in expect.items() if not ok]

    commands = [s for s in tree if s.service == "l4m.scheduler" and s.name.startswith("l4m.")]
    if not {s.name for s in commands} >= EXECUTOR_COMMANDS:
        problems.append(f"command spans {sorted({s.name for s in commands})} lack some of {sorted(EXECUTOR_COMMANDS)}")
    for command in commands:
        if command.parent_span_id != run_span.span_id:
            problems.append(f"{command.name} is not a child of controller.run")
        if command.attributes.get("l4m.instance_id") != instance_id or "l4m.kv_pages" not in command.attributes:
            problems.append(f"{command.name} lacks instance id / page count: {command.attributes}")
        if command.name in EXECUTOR_COMMANDS:
            batches = [by_id.get(span_id) for _, span_id in command.links]
            if len(batches) != 1 or batches[0] is None or batches[0].name != "scheduler.batch":
                problems.append(f"{command.name} does not link to exactly one scheduler.batch of the trace")
            elif (command.trace_id, command.span_id) not in batches[0].links:
                problems.append(f"the batch carrying {command.name} does not link back to it")
    prompt_tokens = sum(int(c.attributes.get("l4m.tokens", 0)) for c in commands if c.name == "l4m.forward_text")
    if prompt_tokens < 4:
        problems.append(f"forward_text spans carry {prompt_tokens} tokens in all")

    executor_batches = {s.parent_span_id: s for s in named["executor.batch"]}
    for batch in named["scheduler.batch"]:
        size = batch.attributes.get("l4m.batch.size")
        if size != len(batch.links) or by_id.get(batch.parent_span_id, batch).name not in EXECUTOR_COMMANDS:
            problems.append(f"scheduler.batch (size {size}) has {len(batch.links)} links / not a command's child")
        executed = executor_batches.get(batch.span_id)
        if executed is None:
            problems.append(f"no executor.batch under the {batch.attributes.get('l4m.batch.kind')} scheduler.batch")
        elif executed.attributes.get("l4m.batch.size") != size:
            problems.append(f"executor.batch size {executed.attributes.get('l4m.batch.size')} != {size}")
    for executed in named["executor.batch"]:
        children = {s.name for s in tree if s.parent_span_id == executed.span_id}
        if executed.attributes.get("l4m.batch.kind") == "ForwardText" and children != {"prepare", "forward", "sample"}:
            problems.append(f"a forward_text executor.batch has children {sorted(children)}")
    return problems


def test_one_launch_is_one_trace_across_every_process(
    traced: TracedCluster, launch: LaunchRun, show_logs_on_failure: None
) -> None:
    assert launch.returncode == 0, launch.stderr
    assert '"stop": "length"' in launch.stdout, launch.stdout
    _wait_for_whole_trace(traced, TEXT_COMPLETION)


def _wait_for_whole_trace(traced: TracedCluster, program: Path) -> None:
    try:
        traced.receiver.wait_for(lambda spans: not trace_problems(spans, program), timeout_s=30)
    except AssertionError:
        spans = list(traced.receiver.spans)
        table = "\n".join(f"  {s.service:15} {s.name:18} {s.trace_id[:8]} {s.span_id} <- {s.parent_span_id}" for s in spans)
        pytest.fail("trace incomplete or wrong:\n  " + "\n  ".join(trace_problems(spans, program)) + f"\nspans:\n{table}")


# ---- metrics, health, reflection ----------------------------------------------------------------------


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    series = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            series[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return series


def test_every_service_serves_the_metrics_of_the_run(
    traced: TracedCluster, launch: LaunchRun, show_logs_on_failure: None
) -> None:
    assert launch.returncode == 0, launch.stderr
    base = traced.up.metrics_port_base
    spawner, scheduler, executor = _scrape(base), _scrape(base + 1), _scrape(base + 10)

    assert spawner['l4m_spawner_instances{state="running"}'] == 0, spawner
    assert spawner['l4m_spawner_instances{state="starting"}'] == 0, spawner
    assert spawner['l4m_spawner_launch_latency_seconds_count{sandbox="process"}'] == 1, spawner
    assert 0 < spawner['l4m_spawner_launch_latency_seconds_sum{sandbox="process"}'] < 30, spawner
    assert spawner['l4m_spawner_sandbox_exits_total{reason="exited"}'] == 1, spawner

    assert scheduler["l4m_scheduler_queue_depth"] == 0, scheduler
    # The prompt and 3 decode steps: one forward_text with continuation, in a batch of its own.
    assert scheduler['l4m_scheduler_batch_size_count{kind="forward_text"}'] >= 1, scheduler
    assert scheduler['l4m_scheduler_batch_size_bucket{kind="forward_text",le="1.0"}'] >= 1, scheduler
    assert scheduler['l4m_scheduler_commands_total{kind="forward_text"}'] >= 1, scheduler
    assert scheduler['l4m_scheduler_command_seconds_count{kind="forward_text"}'] >= 1, scheduler
    assert executor['l4m_executor_batch_seconds_count{kind="ForwardText"}'] >= 1, executor
    # Everything the controller held is freed once it exits.
    assert scheduler["l4m_scheduler_kv_pages_used"] == 0, scheduler
    assert scheduler["l4m_scheduler_embed_slots_used"] == 0, scheduler
    assert scheduler["l4m_scheduler_instances"] == 0, scheduler

    assert executor["l4m_executor_forward_tokens_total"] >= 4 + 3, executor  # a counter: rate() is tokens/s
    assert executor["l4m_executor_batches_total"] >= scheduler['l4m_scheduler_batch_size_count{kind="forward_text"}']
    assert executor["l4m_executor_kv_pages"] > 0, executor
    assert executor["l4m_executor_kv_pages_used"] == 0, executor
    assert executor["l4m_executor_embed_slots_used"] == 0, executor


def test_every_service_answers_health_and_reflection(traced: TracedCluster, show_logs_on_failure: None) -> None:
    services = {
        traced.up.spawner_address: "l4m.v1.SpawnerService",
        traced.up.scheduler_address: "l4m.v1.L4MService",
        f"unix:{traced.up.executor_socket}": "l4m.v1.ExecutorService",
    }
    for address, service in services.items():
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", service):
                answer = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING, (address, name)
            listed = set(ProtoReflectionDescriptorDatabase(channel).get_services())
            assert {service, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= listed, listed


# ---- the gateway's requests ------------------------------------------------------------------------------


def gateway_trace_problems(spans: list[ReceivedSpan], caller: str, launches: bool) -> list[str]:
    """Everything wrong with the trace of the gateway request the W3C `caller` context sent: its
    `gateway.request` span under the caller's, and below it the scheduler's command spans (its session's),
    or `spawner.launch` and the program's `controller.run` above them where it `launches` a program."""
    _, trace_id, caller_span_id, _ = caller.split("-")
    tree = [s for s in spans if s.trace_id == trace_id]
    requests = [s for s in tree if s.name == "gateway.request"]
    if len(requests) != 1:
        return [f"{len(requests)} gateway.request spans in the caller's trace"]
    request = requests[0]
    problems = [what for what, ok in {
        "gateway.request is the caller's child": request.parent_span_id == caller_span_id,
        "gateway.request is l4m.gateway's": request.service == "l4m.gateway",
        "gateway.request answered 200": request.attributes.get("http.response.status_code") == 200,
        "gateway.request counts completion tokens": int(request.attributes.get("l4m.completion_tokens", 0)) > 0,
        "gateway.request is the gateway's only span": [s.name for s in tree if s.service == "l4m.gateway"] == [
            "gateway.request"],
    }.items() if not ok]
    commands_parent = request
    if launches:
        launch_spans = [s for s in tree if s.name == "spawner.launch" and s.parent_span_id == request.span_id]
        runs = [s for s in tree if s.name == "controller.run"]
        if len(launch_spans) != 1 or len(runs) != 1 or runs[0].parent_span_id != launch_spans[0].span_id:
            return [*problems, "no spawner.launch under gateway.request with the program's controller.run under it"]
        commands_parent = runs[0]
    commands = [s for s in tree if s.service == "l4m.scheduler" and s.name.startswith("l4m.")]
    if "l4m.forward_text" not in {s.name for s in commands}:
        problems.append(f"no forward_text among the command spans {sorted({s.name for s in commands})}")
    problems += [f"{c.name} is not a child of {commands_parent.name}" for c in commands
                 if c.parent_span_id != commands_parent.span_id]
    if request.attributes.get("l4m.instance_id") not in {c.attributes.get("l4m.instance_id") for c in commands}:
        problems.append(f"gateway.request names instance {request.attributes.get('l4m.instance_id')}, not the commands'")
    if not {"scheduler.batch", "executor.batch"} <= {s.name for s in tree}:
        problems.append("the batches are not in the request's trace")
    return problems


def test_a_gateway_request_is_one_trace_over_the_cluster(traced: TracedCluster, show_logs_on_failure: None) -> None:
    up = traced.up
    tag = f"answer-{uuid.uuid4().hex[:8]}"
    stored = subprocess.run([str(L4M_CLI), "store", str(example("openai_program")), "--tag", tag, "--spawner",
                             up.spawner_address, "--api-key-file", str(up.admin_key_path)],
                            cwd=REPO, env=_clean_env(), capture_output=True, text=True, timeout=120)
    assert stored.returncode == 0, stored.stderr
    client = openai.OpenAI(base_url=up.gateway_url, api_key=up.admin_key, max_retries=0, timeout=120)
    callers = {model: f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-01"
               for model in (client.models.list().data[0].id, f"l4m/{tag}")}
    for model, caller in callers.items():
        answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=3, temperature=0, extra_headers={"traceparent": caller})
        assert answer.choices[0].message.content, answer

    def problems(spans: list[ReceivedSpan]) -> list[str]:
        return [f"{model}: {problem}" for model, caller in callers.items()
                for problem in gateway_trace_problems(spans, caller, launches=model.startswith("l4m/"))]

    try:
        traced.receiver.wait_for(lambda spans: not problems(spans), timeout_s=30)
    except AssertionError:
        spans = [s for s in traced.receiver.spans if any(s.trace_id in c for c in callers.values())]
        table = "\n".join(f"  {s.service:15} {s.name:18} {s.trace_id[:8]} {s.span_id} <- {s.parent_span_id}" for s in spans)
        pytest.fail("trace incomplete or wrong:\n  " + "\n  ".join(problems(spans)) + f"\nspans:\n{table}")


# ---- stopping ---------------------------------------------------------------------------------------------


# After the metrics test, whose counts are of the one launch above.
def test_a_launch_in_a_shared_process_is_one_trace_too(
    traced: TracedCluster, show_logs_on_failure: None, tmp_path: Path
) -> None:
    program = tmp_path / "shared_completion.py"  # its own name: its l4m.run span is told apart by it
    program.write_text(TEXT_COMPLETION.read_text())
    shared = _run(traced, program, "--share-process")
    assert shared.returncode == 0, shared.stderr
    assert '"stop": "length"' in shared.stdout, shared.stdout
    _wait_for_whole_trace(traced, program)


def test_ctrl_c_stops_every_service(traced: TracedCluster, show_logs_on_failure: None) -> None:
    up = traced.up
    children = _descendants(up.process.pid)
    assert sum("l4m." in cmd for cmd in children.values()) >= 3, children
    up.process.send_signal(signal.SIGINT)
    assert up.process.wait(30) == 0, up.output()[-4000:]
    assert "l4m up: stopping" in up.output()
    time.sleep(0.5)
    assert not _still_running(children), _still_running(children)


def test_a_dead_service_stops_the_cluster(tmp_path: Path) -> None:
    with up_cluster(tmp_path, env=_clean_env(), metrics=False, echo_logs=True) as up:
        try:
            children = _descendants(up.process.pid)
            executor = [pid for pid, cmd in children.items()
                        if "l4m.executor" in cmd and str(up.executor_socket) in cmd]
            assert len(executor) == 1, children
            os.kill(executor[0], signal.SIGKILL)
            code = up.process.wait(30)
            output = up.output()
            assert code != 0, output
            assert "executor-0 exited with code -9" in output, output
            assert "model ready" in output.split("executor-0 exited", 1)[1], output  # its log tail
            time.sleep(0.5)
            assert not _still_running(children), _still_running(children)
        except BaseException:
            print(up.logs(num_output_chars=8000))
            raise
