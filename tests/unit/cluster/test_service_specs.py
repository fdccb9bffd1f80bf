"""How `l4m up` wires its services: order, addresses, and what sandboxes can reach."""

from __future__ import annotations

from pathlib import Path

from l4m.cluster import ClusterConfig, service_specs


def _config(tmp_path: Path, **overrides: object) -> ClusterConfig:
    return ClusterConfig(state_dir=tmp_path, devices=("cpu", "cuda:1"), **overrides)


def test_executors_start_first_and_the_scheduler_knows_each(tmp_path: Path) -> None:
    specs = service_specs(_config(tmp_path))
    assert [s.name for s in specs] == ["executor-0", "executor-1", "scheduler", "spawner"]
    scheduler_argv = specs[2].argv
    executors = [scheduler_argv[i + 1] for i, a in enumerate(scheduler_argv) if a == "--executor"]
    assert executors == [specs[0].health_address, specs[1].health_address]
    assert specs[1].argv[specs[1].argv.index("--device") + 1] == "cuda:1"


def test_sandboxes_cannot_reach_executor_sockets(tmp_path: Path) -> None:
    config = _config(tmp_path)
    specs = service_specs(config)
    spawner_argv = specs[-1].argv
    sandbox_dir = Path(spawner_argv[spawner_argv.index("--socket-dir") + 1])
    for executor in specs[:2]:
        socket_path = Path(executor.health_address.removeprefix("unix:"))
        assert sandbox_dir not in socket_path.parents, f"{socket_path} would be mounted into every sandbox"
    # The scheduler's socket is the one thing controllers need there.
    scheduler_argv = specs[2].argv
    assert Path(scheduler_argv[scheduler_argv.index("--listen-unix") + 1]).parent == sandbox_dir


def test_metrics_ports_follow_the_base(tmp_path: Path) -> None:
    specs = service_specs(_config(tmp_path, metrics_port_base=9000))
    assert {s.name: s.metrics_port for s in specs} == {
        "executor-0": 9010, "executor-1": 9011, "scheduler": 9001, "spawner": 9000,
    }
    assert all(s.metrics_port == 0 for s in service_specs(_config(tmp_path, metrics_port_base=0)))


def test_each_state_dir_gets_its_own_spawner_id(tmp_path: Path) -> None:
    """A spawner removes its id's leftover cgroups and containers at start: two clusters on one machine
    must not share an id, or starting one would kill the other's controllers."""

    def spawner_id(state_dir: Path) -> str:
        argv = service_specs(ClusterConfig(state_dir=state_dir))[-1].argv
        return argv[argv.index("--spawner-id") + 1]

    first, second = spawner_id(tmp_path / "a"), spawner_id(tmp_path / "b")
    assert first != second
    assert first == spawner_id(tmp_path / "a")  # a restart finds its own orphans
    assert first.replace("-", "").isalnum()  # usable in cgroup paths and container names


def test_warm_pool_size_reaches_the_spawner_only_when_set(tmp_path: Path) -> None:
    def spawner_argv(**overrides: object) -> tuple[str, ...]:
        return service_specs(_config(tmp_path, **overrides))[-1].argv

    assert "--warm-pool-size" not in spawner_argv()  # the spawner's own default
    argv = spawner_argv(warm_pool_size=16)
    assert argv[argv.index("--warm-pool-size") + 1] == "16"
    assert spawner_argv(warm_pool_size=0)[-1] == "0"  # 0 (no pool) is a value, not "unset"


def test_max_continuation_steps_reaches_the_scheduler_only_when_set(tmp_path: Path) -> None:
    def scheduler_argv(**overrides: object) -> tuple[str, ...]:
        return next(s.argv for s in service_specs(_config(tmp_path, **overrides)) if s.name == "scheduler")

    assert "--max-continuation-steps" not in scheduler_argv()
    argv = scheduler_argv(max_continuation_steps=0)
    assert argv[argv.index("--max-continuation-steps") + 1] == "0"
