"""`--metrics-port` / `--metrics-host`, the same on the scheduler, the executor and the spawner
(`l4m.common.metrics.add_metrics_flags`): loopback unless the operator names another address; a bad port or host is a usage error
naming the flag and the value, before anything listens."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from l4m.common.metrics import LOOPBACK, MetricsEndpoint
from l4m.executor.__main__ import parse_config as executor_config
from l4m.scheduler.__main__ import parse_config as scheduler_config
from l4m.spawner.cli import parse_config as spawner_config


def _scheduler(*flags: str) -> MetricsEndpoint:
    return scheduler_config(["--executor", "unix:/x", *flags])[1]


def _executor(*flags: str) -> MetricsEndpoint:
    return executor_config(["--model", "m.gguf", *flags])[1]


def _spawner(*flags: str) -> MetricsEndpoint:
    return spawner_config(list(flags), environ={})[1].metrics


SERVICES = pytest.mark.parametrize("parse", [_scheduler, _executor, _spawner], ids=["scheduler", "executor", "spawner"])


@SERVICES
def test_metrics_are_off_and_loopback_by_default(parse: Callable[..., MetricsEndpoint]) -> None:
    assert parse() == MetricsEndpoint(port=0, host=LOOPBACK) == MetricsEndpoint(0, "127.0.0.1")


@SERVICES
@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "::1"])
def test_metrics_host_takes_an_ip_address(parse: Callable[..., MetricsEndpoint], host: str) -> None:
    assert parse("--metrics-port", "9411", "--metrics-host", host) == MetricsEndpoint(9411, host)


@SERVICES
@pytest.mark.parametrize(("flags", "message"), [
    (("--metrics-host", "prometheus.example"), "--metrics-host must be an IP address"),
    (("--metrics-host", ""), "--metrics-host must be an IP address"),
    (("--metrics-host", "0.0.0.0:9411"), "got '0.0.0.0:9411'"),
    (("--metrics-port", "-1"), "--metrics-port must be in 0..65535 (0: off), got -1"),
    (("--metrics-port", "65536"), "got 65536"),
])
def test_a_bad_metrics_flag_is_a_usage_error_naming_it(
    parse: Callable[..., MetricsEndpoint], flags: Sequence[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse(*flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
