"""How `l4m up` wires its services: order, addresses, and what sandboxes can reach."""

from __future__ import annotations

import argparse
import asyncio
import functools
import stat
from pathlib import Path

import pytest

from l4m.cluster import Cluster, ClusterConfig, ClusterError, prepare_state_dir, service_specs
from l4m.keys import KeyStore
from l4m.up import add_cluster_arguments, cluster_config


def _config(tmp_path: Path, **overrides: object) -> ClusterConfig:
    return ClusterConfig(state_dir=tmp_path, devices=("cpu", "cuda:1"), **overrides)


def test_executors_start_first_and_the_scheduler_knows_each(tmp_path: Path) -> None:
    specs = service_specs(_config(tmp_path))
    assert [s.name for s in specs] == ["executor-0", "executor-1", "scheduler", "gateway", "spawner"]
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
        "executor-0": 9010, "executor-1": 9011, "scheduler": 9001, "spawner": 9000, "gateway": 9002,
    }
    for spec in specs:  # each service is told the port its spec names
        assert spec.argv[spec.argv.index("--metrics-port") + 1] == str(spec.metrics_port), spec.name
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


def _scheduler_argv(tmp_path: Path, **overrides: object) -> tuple[str, ...]:
    return next(s.argv for s in service_specs(_config(tmp_path, **overrides)) if s.name == "scheduler")


def test_prefill_chunk_tokens_reaches_the_scheduler_only_when_set(tmp_path: Path) -> None:
    scheduler_argv = functools.partial(_scheduler_argv, tmp_path)
    assert "--prefill-chunk-tokens" not in scheduler_argv()  # the scheduler's default chunk
    assert _flag(scheduler_argv(prefill_chunk_tokens=512), "--prefill-chunk-tokens") == "512"
    parser = argparse.ArgumentParser()
    add_cluster_arguments(parser)
    assert cluster_config(parser.parse_args(["--prefill-chunk-tokens", "256"])).prefill_chunk_tokens == 256
    assert cluster_config(parser.parse_args([])).prefill_chunk_tokens is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--prefill-chunk-tokens", "0"])


def test_prefill_chunk_token_slots_reach_the_scheduler_only_when_set(tmp_path: Path) -> None:
    scheduler_argv = functools.partial(_scheduler_argv, tmp_path)
    assert "--prefill-chunk-token-slots" not in scheduler_argv()  # fixed-size chunks
    assert _flag(scheduler_argv(prefill_chunk_token_slots=850), "--prefill-chunk-token-slots") == "850"
    parser = argparse.ArgumentParser()
    add_cluster_arguments(parser)
    assert cluster_config(parser.parse_args(["--prefill-chunk-token-slots", "900"])).prefill_chunk_token_slots == 900
    assert cluster_config(parser.parse_args([])).prefill_chunk_token_slots is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--prefill-chunk-token-slots", "0"])


def _flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


def _flags(argv: tuple[str, ...], name: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == name]


def test_the_sandbox_directory_holds_only_the_data_plane(tmp_path: Path) -> None:
    """Every path a service is given that lies in the sandboxes' directory is one of the data plane's sockets
    (scheduler.sock, scheduler.frames.sock, and runtime.sock and runtime.frames.sock, which the spawner
    creates there itself); the registry, executors and secret are elsewhere."""
    config = _config(tmp_path)
    sandbox_dir = config.socket_dir
    for spec in service_specs(config):
        for word in spec.argv:
            path = Path(word.removeprefix("unix:"))
            if sandbox_dir in path.parents:
                assert path.name in {"scheduler.sock", "scheduler.frames.sock", "runtime.sock"}, f"{spec.name}: {word}"


def test_the_registry_has_its_own_socket_that_only_the_spawner_is_given(tmp_path: Path) -> None:
    config = _config(tmp_path)
    specs = {s.name: s for s in service_specs(config)}
    registry = f"unix:{tmp_path / 'internal' / 'registry.sock'}"
    assert _flag(specs["scheduler"].argv, "--registry-listen") == registry
    assert _flag(specs["spawner"].argv, "--scheduler") == registry
    assert _flag(specs["scheduler"].argv, "--listen-unix") == str(tmp_path / "sockets" / "scheduler.sock")
    assert _flag(specs["scheduler"].argv, "--listen") == config.scheduler_address  # L4M on TCP, no registry
    for name in ("executor-0", "executor-1"):
        assert registry not in specs[name].argv


def test_every_service_gets_the_cluster_secret(tmp_path: Path) -> None:
    secret = str(tmp_path / "internal" / "cluster.secret")
    for spec in service_specs(_config(tmp_path)):
        assert _flag(spec.argv, "--cluster-secret-file") == secret, spec.name


def test_the_spawner_needs_keys_unless_insecure_local(tmp_path: Path) -> None:
    spawner = service_specs(_config(tmp_path))[-1].argv
    assert _flag(spawner, "--api-keys-file") == str(tmp_path / "api-keys.json")
    assert "--insecure-local" not in spawner
    spawner = service_specs(_config(tmp_path, insecure_local=True))[-1].argv
    assert "--insecure-local" in spawner and "--api-keys-file" not in spawner


def test_tls_reaches_the_tcp_listeners_and_their_health_checks(tmp_path: Path) -> None:
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    plain = service_specs(_config(tmp_path))
    assert all("--tls-cert" not in s.argv and s.tls_ca is None for s in plain)
    specs = {s.name: s for s in service_specs(_config(tmp_path, tls_cert=cert, tls_key=key))}
    for name in ("scheduler", "spawner"):
        assert (_flag(specs[name].argv, "--tls-cert"), _flag(specs[name].argv, "--tls-key")) == (str(cert), str(key))
    assert "--tls-cert" not in specs["executor-0"].argv  # a Unix socket: its directory protects it
    assert specs["spawner"].tls_ca == cert  # a self-signed certificate is its own CA
    assert specs["scheduler"].health_address.startswith("unix:")  # checked on its (plain) Unix socket
    ca = tmp_path / "ca.pem"
    spawner = service_specs(_config(tmp_path, tls_cert=cert, tls_key=key, tls_ca=ca))[-1]
    assert spawner.tls_ca == ca


def test_prepare_state_dir_makes_a_private_internal_dir_secret_and_admin_key(tmp_path: Path) -> None:
    config = _config(tmp_path / "state")
    key = prepare_state_dir(config)
    assert stat.S_IMODE(config.internal_socket_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(config.cluster_secret_file.stat().st_mode) == 0o600
    assert config.admin_key_file.read_text().strip() == key
    entry = KeyStore.load(config.api_keys_file).authenticate(key)
    assert entry is not None and entry.role == "admin"
    secret = config.cluster_secret_file.read_text()
    assert prepare_state_dir(config) == key and config.cluster_secret_file.read_text() == secret  # kept
    assert sorted(p.name for p in config.socket_dir.iterdir()) == []  # nothing but what services create


def test_l4m_up_flags_reach_the_config(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_cluster_arguments(parser)
    config = cluster_config(parser.parse_args(["--state-dir", str(tmp_path), "--insecure-local", "--tls-cert",
                                               "c.pem", "--tls-key", "k.pem", "--tls-ca", "ca.pem"]))
    assert (config.insecure_local, config.tls_cert, config.tls_key, config.health_ca) == (
        True, Path("c.pem"), Path("k.pem"), Path("ca.pem"))
    with pytest.raises(SystemExit, match="--tls-cert and --tls-key go together"):
        cluster_config(parser.parse_args(["--tls-cert", "c.pem"]))


@pytest.mark.parametrize("transport", ["framed", "grpc"])
def test_the_session_transport_decides_what_controllers_speak(tmp_path: Path, transport: str) -> None:
    """framed (the default): the scheduler serves framed sessions in the sandboxes' directory and the spawner
    points controllers at them, and at its own framed socket for user messages; grpc: controllers use
    scheduler.sock, and RuntimeService for their messages."""
    parser = argparse.ArgumentParser()
    add_cluster_arguments(parser)
    flags = [] if transport == "framed" else ["--session-transport", "grpc"]
    config = cluster_config(parser.parse_args(["--state-dir", str(tmp_path), *flags]))
    assert config.session_transport == transport
    specs = {spec.name: spec.argv for spec in service_specs(config)}
    framed_socket = str(config.socket_dir / "scheduler.frames.sock")
    if transport == "framed":
        assert _flags(specs["scheduler"], "--listen-framed") == [framed_socket]
        assert _flags(specs["spawner"], "--scheduler-framed-socket-name") == ["scheduler.frames.sock"]
        assert "--runtime-framed-socket-name" not in specs["spawner"]  # the spawner's default: served
    else:
        assert "--listen-framed" not in specs["scheduler"]
        assert "--scheduler-framed-socket-name" not in specs["spawner"]
        assert _flags(specs["spawner"], "--runtime-framed-socket-name") == [""]  # user messages on gRPC too
    with pytest.raises(SystemExit):
        cluster_config(parser.parse_args(["--session-transport", "carrier-pigeon"]))


def test_each_model_gets_one_executor_per_device_the_first_the_default(tmp_path: Path) -> None:
    """`l4m up --model qwen=DIR --model FILE.gguf`: models x devices executors, in model order (the
    scheduler's default model is its first executor's), each told its model and, when given, its name."""
    parser = argparse.ArgumentParser()
    add_cluster_arguments(parser)
    args = parser.parse_args(["--state-dir", str(tmp_path), "--devices", "cpu,cuda:1",
                              "--model", "qwen=/models/qwen2", "--model", "/models/smol.gguf"])
    specs = service_specs(cluster_config(args))
    executors = [s for s in specs if s.name.startswith("executor-")]
    assert [s.name for s in executors] == ["executor-0", "executor-1", "executor-2", "executor-3"]

    def flag(spec, name: str) -> str | None:  # type: ignore[no-untyped-def]
        return spec.argv[spec.argv.index(name) + 1] if name in spec.argv else None

    assert [(flag(s, "--model"), flag(s, "--model-name"), flag(s, "--device")) for s in executors] == [
        ("/models/qwen2", "qwen", "cpu"), ("/models/qwen2", "qwen", "cuda:1"),
        ("/models/smol.gguf", None, "cpu"), ("/models/smol.gguf", None, "cuda:1"),
    ]
    scheduler = next(s for s in specs if s.name == "scheduler")
    assert [a for i, a in enumerate(scheduler.argv) if i and scheduler.argv[i - 1] == "--executor"] == [
        s.health_address for s in executors]
    default = service_specs(_config(tmp_path))  # no --model: the embedded default, no --model flag
    assert all("--model" not in s.argv for s in default)


def test_the_gateway_takes_the_spawners_keys_and_the_registry_and_can_be_left_out(tmp_path: Path) -> None:
    """Who may use the gateway's port: holders of the cluster's API keys (the spawner's store), or anyone
    local with --insecure-local; it registers each request with the registry, under the cluster secret."""
    config = _config(tmp_path, gateway_port=7999)
    gateway = next(s for s in service_specs(config) if s.name == "gateway")
    argv = gateway.argv
    assert argv[argv.index("--keys-file") + 1] == str(config.api_keys_file) and "--insecure-local" not in argv
    assert argv[argv.index("--registry") + 1] == f"unix:{config.registry_socket}"
    assert argv[argv.index("--cluster-secret-file") + 1] == str(config.cluster_secret_file)
    assert argv[argv.index("--scheduler") + 1] == f"framed:{config.scheduler_framed_socket}"
    assert (gateway.health_check, gateway.health_address) == ("http", "http://127.0.0.1:7999/health")
    local = next(s for s in service_specs(_config(tmp_path, insecure_local=True)) if s.name == "gateway")
    assert "--insecure-local" in local.argv and "--keys-file" not in local.argv
    assert all(s.name != "gateway" for s in service_specs(_config(tmp_path, gateway_port=-1)))


def test_the_gateways_prefix_cache_is_its_default_unless_the_cluster_sets_it(tmp_path: Path) -> None:
    def argv(**changes: object) -> tuple[str, ...]:
        return next(s for s in service_specs(_config(tmp_path, **changes)) if s.name == "gateway").argv

    assert "--prefix-cache-pages" not in argv()
    off = argv(gateway_prefix_cache_pages=0)
    assert off[off.index("--prefix-cache-pages") + 1] == "0"
    parser = argparse.ArgumentParser()
    add_cluster_arguments(parser)
    assert cluster_config(parser.parse_args(["--gateway-prefix-cache-pages", "32"])).gateway_prefix_cache_pages == 32
    assert cluster_config(parser.parse_args([])).gateway_prefix_cache_pages is None
    with pytest.raises(SystemExit, match="--gateway-prefix-cache-pages must be 0"):
        cluster_config(parser.parse_args(["--gateway-prefix-cache-pages", "-1"]))


@pytest.mark.parametrize(
    ("flag", "field", "default", "chosen", "bad"),
    [("--quantized-activations", "quantized_activations", "float32", "bfloat16", "int8"),
     ("--kv-cache-dtype", "kv_cache_dtype", "auto", "float16", "fp8")],
    ids=["x-in-bf16", "float16-kv-cache"],
)
def test_a_precision_opt_in_reaches_the_cpu_executors_only_when_asked(
    tmp_path: Path, flag: str, field: str, default: str, chosen: str, bad: str
) -> None:
    """`l4m up --quantized-activations` and `--kv-cache-dtype` are the operator's: they reach the CPU executors'
    flags (a CUDA executor has no 4-bit CPU kernels and keeps its cache in its dtype) and nothing else; the
    default adds no flag."""
    def argvs(**overrides: object) -> dict[str, tuple[str, ...]]:
        return {s.name: s.argv for s in service_specs(_config(tmp_path, **overrides))}

    assert not any(flag in argv for argv in argvs().values())
    picked = argvs(**{field: chosen})
    assert _flag(picked["executor-0"], flag) == chosen  # the cpu one
    assert [name for name, argv in picked.items() if flag in argv] == ["executor-0"]
    parser = argparse.ArgumentParser()
    add_cluster_arguments(parser)
    assert getattr(cluster_config(parser.parse_args([flag, chosen])), field) == chosen
    assert getattr(cluster_config(parser.parse_args([])), field) == default
    with pytest.raises(SystemExit):
        parser.parse_args([flag, bad])


def test_the_refills_quiet_wait_reaches_the_spawner_only_when_set(tmp_path: Path) -> None:
    def spawner_argv(**overrides: object) -> tuple[str, ...]:
        return service_specs(_config(tmp_path, **overrides))[-1].argv

    assert "--warm-pool-quiet-wait-s" not in spawner_argv()  # the spawner's own default (0)
    assert _flag(spawner_argv(warm_pool_quiet_wait_s=30.0), "--warm-pool-quiet-wait-s") == "30.0"
    parser = argparse.ArgumentParser()
    add_cluster_arguments(parser)
    assert cluster_config(parser.parse_args(["--warm-pool-quiet-wait-s", "20"])).warm_pool_quiet_wait_s == 20.0
    assert cluster_config(parser.parse_args([])).warm_pool_quiet_wait_s is None
    for value in ("-1", "nan"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--warm-pool-quiet-wait-s", value])


def test_the_instances_per_shared_process_reach_the_spawner_only_when_set(tmp_path: Path) -> None:
    def spawner_argv(**overrides: object) -> tuple[str, ...]:
        return service_specs(_config(tmp_path, **overrides))[-1].argv

    assert "--max-instances-per-process" not in spawner_argv()  # the spawner's own default (16)
    assert _flag(spawner_argv(max_instances_per_process=1), "--max-instances-per-process") == "1"
    parser = argparse.ArgumentParser()
    add_cluster_arguments(parser)
    assert cluster_config(parser.parse_args(["--max-instances-per-process", "64"])).max_instances_per_process == 64
    assert cluster_config(parser.parse_args([])).max_instances_per_process is None
    for value in ("0", "-3", "x"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--max-instances-per-process", value])


def test_the_control_plane_runs_under_sched_batch_and_executors_under_sched_other(tmp_path: Path) -> None:
    """Who may set the services' policy: whoever runs `l4m up` (its own children); nothing reaches it
    through an API. Controllers' policy is the spawner's flag, passed on only when given."""
    specs = service_specs(_config(tmp_path))
    for spec in specs:
        if spec.name.startswith("executor"):
            assert spec.command() == spec.argv, spec.name
        else:
            assert spec.command() == ("chrt", "--batch", "0", *spec.argv), spec.name
    assert {s.name for s in specs if s.cpu_policy == "batch"} == {"scheduler", "gateway", "spawner"}
    normal = service_specs(_config(tmp_path, control_plane_cpu_policy="normal"))
    assert all(spec.command() == spec.argv for spec in normal)
    assert "--controller-cpu-policy" not in specs[-1].argv  # the spawner's own default (batch)
    chosen = service_specs(_config(tmp_path, controller_cpu_policy="normal"))[-1].argv
    assert _flag(chosen, "--controller-cpu-policy") == "normal"
    parser = argparse.ArgumentParser()
    add_cluster_arguments(parser)
    assert cluster_config(parser.parse_args([])).control_plane_cpu_policy == "batch"
    assert cluster_config(parser.parse_args([])).controller_cpu_policy is None
    args = parser.parse_args(["--control-plane-cpu-policy", "normal", "--controller-cpu-policy", "normal"])
    assert (cluster_config(args).control_plane_cpu_policy, cluster_config(args).controller_cpu_policy) == (
        "normal", "normal")
    for flag in ("--control-plane-cpu-policy", "--controller-cpu-policy"):
        for value in ("idle", "fifo"):
            with pytest.raises(SystemExit):
                parser.parse_args([flag, value])


@pytest.mark.parametrize("field", ["control_plane_cpu_policy", "controller_cpu_policy"])
def test_an_unknown_cpu_policy_in_the_config_is_refused_by_name(tmp_path: Path, field: str) -> None:
    with pytest.raises(ClusterError, match=f"{field}: unknown CPU policy 'fifo' \\(expected one of batch, normal\\)"):
        service_specs(_config(tmp_path, **{field: "fifo"}))


def test_a_missing_chrt_is_named_with_the_flag_that_does_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no chrt to be found
    config = _config(tmp_path)
    scheduler = next(s for s in service_specs(config) if s.name == "scheduler")
    config.log_dir.mkdir(parents=True, exist_ok=True)
    with pytest.raises(ClusterError, match=r"could not start the scheduler: chrt: .*--control-plane-cpu-policy normal"):
        asyncio.run(Cluster(config)._spawn(scheduler))
