"""The spawner's core over a fake sandbox and a fake scheduler: registration and its undoing, the
environment a controller gets, traps, the child cap, metrics."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from l4m.spawner.cli import controller_spans_target, parse_config
from l4m.spawner.config import SpawnerConfig
from l4m.spawner.instances import (
    InstanceManager,
    SchedulerUnavailable,
    TooManyChildren,
)
from l4m.spawner.programs import ProgramStore
from l4m.spawner.sandbox import ExitReason, OutputStream
from l4m.spawner.span_forwarder import otlp_grpc_target, stamp_instance_id, stamp_shared_process
from tests.unit.spawner.test_supervisor import FakeSandbox, out


class FakeRegistry:
    def __init__(self, is_reachable: bool = True) -> None:
        self.is_reachable = is_reachable
        self.registered: list[str] = []
        self.registrations: dict[str, dict[str, object]] = {}
        self.destroyed: list[tuple[str, str]] = []

    async def register(
        self, instance_id: str, token: str, max_tokens: int, launched_at_unix_ms: int, **owner: object
    ) -> None:
        if not self.is_reachable:
            raise SchedulerUnavailable("the scheduler at unix:/x is unreachable")
        self.registered.append(instance_id)
        self.registrations[instance_id] = {"max_tokens": max_tokens, **owner}

    async def destroy(self, instance_id: str, reason: str) -> None:
        self.destroyed.append((instance_id, reason))


def _manager(
    tmp_path: Path, sandbox: FakeSandbox, registry: FakeRegistry | None = None, **config: object
) -> tuple[InstanceManager, str, FakeRegistry]:
    registry = registry or FakeRegistry()
    settings = SpawnerConfig(state_dir=tmp_path, socket_dir=tmp_path / "sockets", **config)
    store = ProgramStore(tmp_path / "store")
    sha = store.put(b"async def main(ctx):\n    pass\n").program.sha256
    return InstanceManager(settings, store, sandbox, registry), sha, registry


def test_a_launch_registers_runs_through_the_runner_and_destroys_at_exit(tmp_path: Path) -> None:
    async def go() -> None:
        sandbox = FakeSandbox([out(b"hi\n")])
        manager, sha, registry = _manager(
            tmp_path, sandbox, controller_spans_endpoint="http://collector:4317"
        )
        parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        instance = await manager.launch(sha, ("a",), traceparent=parent)
        info = await instance.supervisor.wait()
        assert info.reason is ExitReason.EXITED
        assert registry.registered == [instance.instance_id]
        assert registry.destroyed[0][0] == instance.instance_id
        spec = sandbox.handles[0]
        env = instance.supervisor.spec.env
        assert instance.supervisor.spec.runner_module == "l4m.controller"
        assert env["L4M_SCHEDULER_ADDR"] == "unix:///run/l4m/scheduler.sock"
        assert env["L4M_RUNTIME_ADDR"] == "unix:///run/l4m/runtime.sock"
        assert env["L4M_RUNTIME_FRAMED_ADDR"] == "framed:///run/l4m/runtime.frames.sock"
        assert env["TRACEPARENT"] == parent  # no tracer provider here: passed through
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "unix:///run/l4m/runtime.sock"
        assert env["OTEL_EXPORTER_OTLP_HEADERS"] == f"l4m-instance-token={instance.token}"
        assert env["OTEL_SERVICE_NAME"] == "l4m.controller"
        assert spec.instance_id == instance.instance_id
        assert manager.metrics.exits.labels("exited")._value.get() == 1
        assert manager.metrics.output_bytes._value.get() == 3

    asyncio.run(go())


def test_an_unreachable_scheduler_fails_the_launch_and_starts_nothing(tmp_path: Path) -> None:
    async def go() -> None:
        sandbox = FakeSandbox([])
        manager, sha, _ = _manager(tmp_path, sandbox, FakeRegistry(is_reachable=False))
        with pytest.raises(SchedulerUnavailable):
            await manager.launch(sha)
        assert sandbox.handles == [] and manager.list_instances() == []
        assert manager.metrics.instances.labels("starting")._value.get() == 0

    asyncio.run(go())


def test_a_runner_exit_on_a_trap_is_reported_as_trapped(tmp_path: Path) -> None:
    async def go() -> None:
        trap_line = b"l4m.controller: trapped: instance trapped (TRAP_KIND_TOKEN_BUDGET): over budget\n"
        sandbox = FakeSandbox([out(trap_line, OutputStream.STDERR)], exit_code=3)
        manager, sha, _ = _manager(tmp_path, sandbox)
        instance = await manager.launch(sha)
        info = await instance.supervisor.wait()
        assert info.reason is ExitReason.TRAPPED and "over budget" in info.message, info

    asyncio.run(go())


def test_a_trap_from_the_scheduler_ends_the_instance(tmp_path: Path) -> None:
    async def go() -> None:
        manager, sha, _ = _manager(tmp_path, FakeSandbox([], exit_code=None))
        instance = await manager.launch(sha)
        await manager.trap(instance.instance_id, "bad page id")
        await manager.trap("i-someone-elses", "ignored")
        info = await instance.supervisor.wait()
        assert (info.reason, info.message) == (ExitReason.TRAPPED, "bad page id")

    asyncio.run(go())


def test_the_child_cap_counts_the_whole_tree_and_failed_spawns_do_not(tmp_path: Path) -> None:
    async def go() -> None:
        manager, sha, registry = _manager(tmp_path, FakeSandbox([], exit_code=None), max_children_per_tree=2)
        root = await manager.launch(sha)
        child = await manager.spawn_child(root, "", (), None)
        registry.is_reachable = False
        with pytest.raises(SchedulerUnavailable):
            await manager.spawn_child(child, "", (), None)
        registry.is_reachable = True
        await manager.spawn_child(child, "", (), None)  # a grandchild counts against the same tree
        with pytest.raises(TooManyChildren, match="at most 2 children"):
            await manager.spawn_child(root, "", (), None)
        await manager.shutdown()

    asyncio.run(go())


def test_cli_flags_build_one_config(tmp_path: Path) -> None:
    config, args = parse_config(
        ["--listen", "127.0.0.1:0", "--scheduler", "unix:/s/scheduler.sock", "--state-dir", str(tmp_path),
         "--sandbox", "docker", "--metrics-port", "9410", "--memory-mib", "256", "--max-tokens", "1000"],
        environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_HEADERS": "Api-Key=k"},
    )  # fmt: skip
    assert config.socket_dir == tmp_path / "sockets" and config.sandbox_kind == "docker"
    assert config.default_limits.memory_bytes == 256 << 20 and config.default_max_tokens == 1000
    assert args.metrics_port == 9410
    assert (config.controller_spans_endpoint, config.controller_spans_headers) == (
        "http://c:4317",
        (("api-key", "k"),),
    )
    assert controller_spans_target({}) == ("", ())
    assert controller_spans_target({"OTEL_TRACES_EXPORTER": "console"}) == ("", ())


def test_span_forwarding_helpers() -> None:
    from opentelemetry.proto.resource.v1 import resource_pb2

    assert otlp_grpc_target("http://127.0.0.1:4317") == ("127.0.0.1:4317", False)
    assert otlp_grpc_target("https://collector:4317") == ("collector:4317", True)
    assert otlp_grpc_target("unix:///run/x.sock") == ("unix:///run/x.sock", False)
    resource = resource_pb2.Resource()
    resource.attributes.add(key="l4m.instance_id").value.string_value = "i-spoofed"
    stamp_instance_id(resource.attributes, "i-real")
    assert [(a.key, a.value.string_value) for a in resource.attributes] == [("l4m.instance_id", "i-real")]
    # A shared process's resource names the process, never an instance (it speaks for several).
    resource.attributes.add(key="l4m.shared_process").value.string_value = "p-spoofed"
    stamp_shared_process(resource.attributes, "p-real")
    assert [(a.key, a.value.string_value) for a in resource.attributes] == [("l4m.shared_process", "p-real")]
