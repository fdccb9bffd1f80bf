"""The executor's command line reaches its engine configuration."""

from __future__ import annotations

import pytest

from l4m.executor.__main__ import parse_config


def test_decode_kernel_is_on_by_default_and_can_be_turned_off() -> None:
    assert parse_config(["--model", "m.gguf"])[0].engine.decode_kernel is True
    assert parse_config(["--model", "m.gguf", "--decode-kernel", "off"])[0].engine.decode_kernel is False


def test_a_bad_decode_kernel_value_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_config(["--decode-kernel", "maybe"])
    assert exit_.value.code == 2
    assert "--decode-kernel" in capsys.readouterr().err
