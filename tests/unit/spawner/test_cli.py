"""The spawner's flags as they become its config: the warm pool's size, shared processes, and what they are
refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from l4m.spawner.cli import parse_config
from l4m.spawner.config import MiB


def test_the_warm_pool_is_on_by_default_and_can_be_turned_off(tmp_path: Path) -> None:
    default, _ = parse_config(["--state-dir", str(tmp_path)], environ={})
    assert default.warm_pool_size == 2
    off, _ = parse_config(["--state-dir", str(tmp_path), "--warm-pool-size", "0"], environ={})
    assert off.warm_pool_size == 0


@pytest.mark.parametrize("value", ["-1", "two"])
def test_a_bad_warm_pool_size_is_refused_with_a_reason(
    value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as raised:
        parse_config(["--state-dir", str(tmp_path), "--warm-pool-size", value], environ={})
    assert raised.value.code == 2
    assert "--warm-pool-size" in capsys.readouterr().err


def test_user_plane_and_control_plane_flags_reach_the_config(tmp_path: Path) -> None:
    config, _ = parse_config(
        ["--state-dir", str(tmp_path), "--api-keys-file", "/k.json", "--max-instances-per-user", "3",
         "--max-tokens-per-minute-per-user", "900", "--unattached-grace-s", "2.5", "--cluster-secret-file", "/s",
         "--scheduler-tls-ca", "/ca.pem", "--tls-cert", "/c.pem", "--tls-key", "/k.pem", "--insecure-local"],
        environ={},
    )  # fmt: skip
    assert (config.api_keys_file, config.insecure_local) == (Path("/k.json"), True)
    assert (config.max_instances_per_user, config.max_tokens_per_minute_per_user) == (3, 900)
    assert config.unattached_grace_s == 2.5
    assert (config.cluster_secret_file, config.scheduler_tls_ca) == (Path("/s"), Path("/ca.pem"))
    assert (config.tls_cert, config.tls_key) == (Path("/c.pem"), Path("/k.pem"))
    default, _ = parse_config(["--state-dir", str(tmp_path)], environ={})
    assert (default.api_keys_file, default.insecure_local, default.max_instances_per_user) == (None, False, 64)
    assert default.unattached_grace_s == 30.0


def test_upload_and_per_user_sum_flags_reach_the_config(tmp_path: Path) -> None:
    config, _ = parse_config(
        ["--state-dir", str(tmp_path), "--max-program-mib", "2", "--upload-validation-memory-mib", "512",
         "--upload-validation-timeout-s", "5", "--max-concurrent-upload-validations", "1",
         "--max-memory-mib-per-user", "2048", "--max-wall-time-s-per-user", "900", "--max-exited-instances", "10",
         "--max-variable-mib-per-tree", "8"],
        environ={},
    )  # fmt: skip
    assert (config.max_program_bytes, config.upload_validation_memory_bytes) == (2 * MiB, 512 * MiB)
    assert (config.upload_validation_timeout_s, config.max_concurrent_upload_validations) == (5.0, 1)
    assert (config.max_memory_bytes_per_user, config.max_wall_time_s_per_user) == (2048 * MiB, 900.0)
    assert (config.max_exited_instances, config.max_variable_bytes_per_tree) == (10, 8 * MiB)
    default, _ = parse_config(["--state-dir", str(tmp_path)], environ={})
    assert (default.max_program_bytes, default.upload_validation_memory_bytes) == (4 * MiB, 1024 * MiB)
    assert default.max_memory_bytes_per_user == 64 * 512 * MiB


def test_a_zero_upload_limit_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config(["--state-dir", str(tmp_path), "--max-program-mib", "0"], environ={})
    assert "--max-program-mib" in capsys.readouterr().err


def test_the_refills_quiet_wait_is_the_operators_flag_and_off_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Who may set it: whoever starts the spawner. No request of the user API names the warm pool."""
    from l4m.v1 import spawner_pb2

    default, _ = parse_config(["--state-dir", str(tmp_path)], environ={})
    assert default.warm_pool_quiet_wait_s == 0.0
    chosen, _ = parse_config(["--state-dir", str(tmp_path), "--warm-pool-quiet-wait-s", "30"], environ={})
    assert chosen.warm_pool_quiet_wait_s == 30.0
    for value in ("-1", "nan", "inf", "soon"):
        with pytest.raises(SystemExit) as raised:
            parse_config(["--state-dir", str(tmp_path), "--warm-pool-quiet-wait-s", value], environ={})
        assert raised.value.code == 2
        assert "--warm-pool-quiet-wait-s" in capsys.readouterr().err

    def fields(messages) -> set[str]:  # type: ignore[no-untyped-def]
        names: set[str] = set()
        for message in messages:
            names |= set(message.fields_by_name) | fields(message.nested_types)
        return names

    names = fields(spawner_pb2.DESCRIPTOR.message_types_by_name.values())
    assert "instance_id" in names and not [n for n in names if "warm" in n or "quiet" in n]


def test_instances_per_shared_process_default_to_16_and_1_turns_sharing_off(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    default, _ = parse_config(["--state-dir", str(tmp_path)], environ={})
    assert default.max_instances_per_process == 16
    off, _ = parse_config(["--state-dir", str(tmp_path), "--max-instances-per-process", "1"], environ={})
    assert off.max_instances_per_process == 1
    with pytest.raises(SystemExit) as raised:
        parse_config(["--state-dir", str(tmp_path), "--max-instances-per-process", "0"], environ={})
    assert raised.value.code == 2 and "--max-instances-per-process" in capsys.readouterr().err


def test_the_controllers_cpu_policy_is_the_operators_flag_batch_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Who may set it: whoever starts the spawner. No request of the user API names a CPU policy, and a
    controller cannot change its own (the seccomp filter; tests/integration/spawner/test_escape.py)."""
    from l4m.spawner.server import make_sandbox
    from l4m.v1 import spawner_pb2

    default, _ = parse_config(["--state-dir", str(tmp_path)], environ={})
    assert default.controller_cpu_policy == "batch"
    chosen, _ = parse_config(["--state-dir", str(tmp_path), "--controller-cpu-policy", "normal"], environ={})
    assert chosen.controller_cpu_policy == "normal"
    # The process backend gets it (a stand-in that returns its config: the real one claims uids).
    monkeypatch.setattr("l4m.spawner.process_sandbox.ProcessSandbox", lambda config: config)
    assert make_sandbox(chosen).cpu_policy == "normal"  # type: ignore[attr-defined]
    assert make_sandbox(default).cpu_policy == "batch"  # type: ignore[attr-defined]
    for value in ("fifo", "idle", ""):
        with pytest.raises(SystemExit) as raised:
            parse_config(["--state-dir", str(tmp_path), "--controller-cpu-policy", value], environ={})
        assert raised.value.code == 2
        assert "--controller-cpu-policy" in capsys.readouterr().err

    names = {name for message in spawner_pb2.DESCRIPTOR.message_types_by_name.values()
             for name in message.fields_by_name}  # fmt: skip
    assert not [name for name in names if "policy" in name or "sched" in name or "nice" in name]
