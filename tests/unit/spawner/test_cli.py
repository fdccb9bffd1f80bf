"""The spawner's flags as they become its config: the warm pool's size and what it is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from l4m.spawner.cli import parse_config


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
