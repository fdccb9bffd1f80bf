"""`l4m.eventloop`: which loop the scheduler and the controllers run on, and a bad L4M_EVENT_LOOP named."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from l4m import eventloop

HAS_UVLOOP = importlib.util.find_spec("uvloop") is not None


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_asyncio_is_used_when_asked_for() -> None:
    environ = {eventloop.ENV: "asyncio"}
    assert eventloop.loop_name(environ) == "asyncio"
    assert eventloop.run(_loop_module(), environ).startswith("asyncio")


@pytest.mark.parametrize("value", ["", "auto", "AUTO", "uvloop"])
def test_uvloop_is_used_where_it_is_installed(value: str) -> None:
    # uvloop is a dependency (pyproject.toml): it is installed wherever the tests run.
    assert HAS_UVLOOP
    environ = {eventloop.ENV: value}
    assert eventloop.loop_name(environ) == "uvloop"
    assert eventloop.run(_loop_module(), environ).startswith("uvloop")


def test_an_unknown_choice_is_named() -> None:
    with pytest.raises(ValueError, match="L4M_EVENT_LOOP='tokio' is not one of auto, uvloop, asyncio"):
        eventloop.loop_name({eventloop.ENV: "tokio"})


def test_uvloop_required_but_missing_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_uvloop(name: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name == "uvloop":
            raise ImportError("no uvloop here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_uvloop)
    with pytest.raises(ValueError, match="uvloop is not installed"):
        eventloop.loop_name({eventloop.ENV: "uvloop"})
    assert eventloop.loop_name({}) == "asyncio"  # auto falls back
