"""`python -m l4m.scheduler` flags that shape what controllers may ask."""

from __future__ import annotations

import pytest

from l4m.scheduler.__main__ import parse_config
from l4m.scheduler.validation import MAX_CONTINUATION_STEPS


def test_max_continuation_steps_defaults_to_what_an_executor_runs_and_can_be_turned_off() -> None:
    assert parse_config(["--executor", "unix:/x"])[0].max_continuation_steps == MAX_CONTINUATION_STEPS
    assert parse_config(["--executor", "unix:/x", "--max-continuation-steps", "0"])[0].max_continuation_steps == 0


@pytest.mark.parametrize("value", ["-1", str(MAX_CONTINUATION_STEPS + 1)])
def test_max_continuation_steps_out_of_range_is_refused(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--executor", "unix:/x", "--max-continuation-steps", value])
    assert exit_info.value.code == 2
    assert f"--max-continuation-steps must be in 0..{MAX_CONTINUATION_STEPS}" in capsys.readouterr().err
