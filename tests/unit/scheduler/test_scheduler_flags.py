"""`python -m l4m.scheduler` flags that shape what controllers may ask."""

from __future__ import annotations

from pathlib import Path

import pytest

from l4m.scheduler.__main__ import parse_config
from l4m.wire.credentials import write_secret_file
from l4m.wire.rules import MAX_CONTINUATION_STEPS


def test_max_continuation_steps_defaults_to_what_an_executor_runs_and_can_be_turned_off() -> None:
    assert parse_config(["--executor", "unix:/x"])[0].max_continuation_steps == MAX_CONTINUATION_STEPS
    assert parse_config(["--executor", "unix:/x", "--max-continuation-steps", "0"])[0].max_continuation_steps == 0


@pytest.mark.parametrize("value", ["-1", str(MAX_CONTINUATION_STEPS + 1)])
def test_max_continuation_steps_out_of_range_is_refused(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--executor", "unix:/x", "--max-continuation-steps", value])
    assert exit_info.value.code == 2
    assert f"--max-continuation-steps must be in 0..{MAX_CONTINUATION_STEPS}" in capsys.readouterr().err


def test_the_registry_never_starts_without_the_cluster_secret(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--executor", "unix:/x", "--registry-listen", "unix:/tmp/registry.sock"])
    assert exit_info.value.code == 2
    assert "--registry-listen needs --cluster-secret-file" in capsys.readouterr().err


def test_control_plane_flags_reach_the_config(tmp_path: Path) -> None:
    secret_file = tmp_path / "cluster.secret"
    secret = write_secret_file(secret_file)
    config = parse_config(["--executor", "unix:/x", "--registry-listen", "unix:/r.sock", "--cluster-secret-file",
                           str(secret_file), "--tls-cert", "c.pem", "--tls-key", "k.pem", "--executor-tls-ca", "ca.pem",
                           "--max-instances", "7"])[0]
    assert (config.registry_listen, config.cluster_secret, config.max_instances) == ("unix:/r.sock", secret, 7)
    assert config.tls is not None and config.tls.cert_path == Path("c.pem") and config.executor_tls_ca == Path("ca.pem")
    assert config.listen != config.registry_listen


def test_a_secret_file_others_can_read_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    secret_file = tmp_path / "cluster.secret"
    write_secret_file(secret_file)
    secret_file.chmod(0o644)
    with pytest.raises(SystemExit):
        parse_config(["--executor", "unix:/x", "--registry-listen", "unix:/r.sock", "--cluster-secret-file",
                      str(secret_file)])
    assert "readable by others" in capsys.readouterr().err


def test_tls_cert_without_key_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config(["--executor", "unix:/x", "--tls-cert", "c.pem"])
    assert "--tls-cert and --tls-key go together" in capsys.readouterr().err


def test_prefill_chunk_token_slots_reach_the_limits_and_a_negative_one_is_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_config(["--executor", "unix:/x"])[0].prefill_chunk_token_slots == 0  # fixed-size chunks
    config = parse_config(["--executor", "unix:/x", "--prefill-chunk-token-slots", "850"])[0]
    assert config.prefill_chunk_token_slots == 850
    with pytest.raises(SystemExit):
        parse_config(["--executor", "unix:/x", "--prefill-chunk-token-slots", "-1"])
    assert "--prefill-chunk-token-slots must be 0 (the default) or more" in capsys.readouterr().err
