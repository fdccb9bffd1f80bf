"""`l4m up --role`: which services one host runs, how a control host joins executors on others, and the
flag combinations refused before anything starts."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from l4m.cluster import ClusterConfig, prepare_state_dir, service_specs
from l4m.up import add_cluster_arguments, cluster_config, run_demo
from l4m.wire.credentials import CredentialError, write_secret_file


def _parse(tmp_path: Path, *flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cluster_arguments(parser)
    return parser.parse_args(["--state-dir", str(tmp_path), *flags])


def _config(tmp_path: Path, *flags: str) -> ClusterConfig:
    return cluster_config(_parse(tmp_path, *flags))


def _values(argv: tuple[str, ...], flag: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == flag]


def test_the_executor_role_runs_executors_alone_on_tcp_with_tls(tmp_path: Path) -> None:
    config = _config(tmp_path, "--role", "executor", "--devices", "cpu,cpu", "--executor-listen", "10.1.2.3:7500",
                     "--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-ca", "ca.pem", "--num-pages", "64")
    specs = service_specs(config)
    assert [s.name for s in specs] == ["executor-0", "executor-1"]
    assert [s.health_address for s in specs] == ["10.1.2.3:7500", "10.1.2.3:7501"]
    for spec in specs:
        assert _values(spec.argv, "--listen") == [spec.health_address]
        assert _values(spec.argv, "--tls-cert") == ["c.pem"] and _values(spec.argv, "--tls-key") == ["k.pem"]
        assert _values(spec.argv, "--cluster-secret-file") == [str(tmp_path / "internal" / "cluster.secret")]
        assert _values(spec.argv, "--num-pages") == ["64"]
        assert "--listen-framed" not in spec.argv  # frames are for a scheduler on the same host
        assert spec.tls_ca == Path("ca.pem")  # the start-up health check verifies the listener's certificate


def test_the_control_role_joins_remote_executors_over_tls_and_starts_none_here(tmp_path: Path) -> None:
    config = _config(tmp_path, "--role", "control", "--executor", "10.0.0.2:7500", "--executor", "10.0.0.3:7500",
                     "--tls-ca", "ca.pem")
    specs = service_specs(config)
    assert [s.name for s in specs] == ["scheduler", "gateway", "spawner"]
    scheduler = specs[0].argv
    assert _values(scheduler, "--executor") == ["10.0.0.2:7500", "10.0.0.3:7500"]
    assert _values(scheduler, "--executor-tls-ca") == ["ca.pem"]


def test_the_control_role_adds_local_executors_only_when_devices_are_given(tmp_path: Path) -> None:
    config = _config(tmp_path, "--role", "control", "--executor", "10.0.0.2:7500", "--tls-ca", "ca.pem",
                     "--devices", "cpu")
    specs = service_specs(config)
    assert [s.name for s in specs] == ["executor-0", "scheduler", "gateway", "spawner"]
    assert _values(specs[1].argv, "--executor") == [specs[0].health_address, "10.0.0.2:7500"]
    assert specs[0].health_address.startswith("unix:")


def test_the_default_role_is_todays_single_host_cluster(tmp_path: Path) -> None:
    config = _config(tmp_path)
    assert (config.role, config.devices, config.remote_executors) == ("all", ("cpu",), ())
    specs = service_specs(config)
    assert [s.name for s in specs] == ["executor-0", "scheduler", "gateway", "spawner"]
    assert "--executor-tls-ca" not in specs[1].argv and "--num-pages" not in specs[0].argv


@pytest.mark.parametrize(("flags", "message"), [
    (["--role", "executor", "--executor-listen", "127.0.0.1:7500", "--executor", "127.0.0.1:7600"],
     "--role executor runs no scheduler"),
    (["--role", "executor"], "--role executor needs --executor-listen HOST:PORT"),
    (["--executor-listen", "127.0.0.1:7500"], "--executor-listen is for --role executor"),
    (["--role", "control"], "--role control needs executors"),
    (["--role", "executor", "--executor-listen", "7500"], "--executor-listen '7500' is not HOST:PORT"),
    (["--role", "executor", "--executor-listen", "127.0.0.1:0"], "--executor-listen '127.0.0.1:0' is not HOST:PORT"),
    (["--role", "executor", "--executor-listen", "0.0.0.0:7500", "--tls-cert", "c", "--tls-key", "k"],
     "not a wildcard"),
    (["--role", "control", "--executor", "10.0.0.2"], "--executor '10.0.0.2' is not HOST:PORT"),
    (["--role", "executor", "--executor-listen", "10.0.0.2:7500"],
     "--executor-listen 10.0.0.2:7500 is reachable from other hosts: give --tls-cert"),
    (["--role", "control", "--executor", "10.0.0.2:7500"], "--executor 10.0.0.2:7500 is on another host: give --tls-ca"),
])
def test_bad_combinations_are_refused_naming_the_flag(tmp_path: Path, flags: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as refused:
        _config(tmp_path, *flags)
    assert str(refused.value).startswith("l4m up: ") and message in str(refused.value)


def test_plaintext_executor_links_off_loopback_need_the_insecure_flag(tmp_path: Path) -> None:
    executor = _config(tmp_path, "--role", "executor", "--executor-listen", "10.0.0.2:7500",
                       "--insecure-executor-links")
    assert "--tls-cert" not in service_specs(executor)[0].argv
    control = _config(tmp_path, "--role", "control", "--executor", "10.0.0.2:7500", "--insecure-executor-links")
    assert "--executor-tls-ca" not in service_specs(control)[0].argv
    # Loopback addresses (127.0.0.0/8: they never leave the machine) need neither.
    assert _config(tmp_path, "--role", "executor", "--executor-listen", "127.20.0.2:7500").role == "executor"


def test_an_executor_host_uses_the_control_hosts_secret_and_makes_none(tmp_path: Path) -> None:
    config = _config(tmp_path / "state", "--role", "executor", "--executor-listen", "127.0.0.1:7500")
    with pytest.raises(CredentialError, match="copy its STATE_DIR/internal/cluster.secret here"):
        prepare_state_dir(config)
    assert not config.cluster_secret_file.exists()
    copy = tmp_path / "copied.secret"
    secret = write_secret_file(copy)
    config = _config(tmp_path / "state", "--role", "executor", "--executor-listen", "127.0.0.1:7500",
                     "--cluster-secret-file", str(copy))
    assert prepare_state_dir(config) == ""  # no users here: no admin key
    assert not (tmp_path / "state" / "admin.key").exists()
    assert _values(service_specs(config)[0].argv, "--cluster-secret-file") == [str(copy)]
    assert copy.read_text().strip() == secret
    copy.chmod(0o644)
    with pytest.raises(CredentialError, match="readable by others"):
        prepare_state_dir(config)


def test_a_control_host_given_a_secret_file_hands_it_to_every_service(tmp_path: Path) -> None:
    secret = tmp_path / "cluster.secret"
    config = _config(tmp_path, "--role", "control", "--executor", "127.0.0.1:7500", "--cluster-secret-file",
                     str(secret))
    prepare_state_dir(config)
    assert secret.exists()
    assert {s.name: _values(s.argv, "--cluster-secret-file") for s in service_specs(config)} == {
        "scheduler": [str(secret)], "gateway": [str(secret)], "spawner": [str(secret)]}


def test_the_demo_needs_the_whole_cluster(tmp_path: Path) -> None:
    args = _parse(tmp_path, "--role", "control", "--executor", "127.0.0.1:7500")
    with pytest.raises(SystemExit, match="the demo needs all of it"):
        run_demo(args)


def test_num_pages_reaches_every_executor_and_refuses_a_negative_count(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    specs = service_specs(_config(tmp_path, "--devices", "cpu,cpu", "--num-pages", "128"))
    assert [_values(s.argv, "--num-pages") for s in specs if s.name.startswith("executor")] == [["128"], ["128"]]
    with pytest.raises(SystemExit):
        _parse(tmp_path, "--num-pages", "-1")
    assert "--num-pages: must be 0 or more, not -1" in capsys.readouterr().err
