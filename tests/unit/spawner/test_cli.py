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
