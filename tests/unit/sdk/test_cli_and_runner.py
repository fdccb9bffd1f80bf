"""The `l4m` CLI's argument parsing, the controller runner, and the local runtime (no sockets)."""

from __future__ import annotations

from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from l4m import cli
from l4m.client import exit_status, find_api_key
from l4m.controller import ControllerConfig, load_program, run_main, run_span
from l4m.errors import L4MError, ProgramError
from l4m.fake import FakeL4M
from l4m.keys import KeyStore
from l4m.runtime import MESSAGE_PREFIX, LocalRuntime, LocalVariables
from l4m.session import Session
from l4m.v1 import spawner_pb2


def test_run_arguments_after_double_dash_go_to_the_controller(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}
    monkeypatch.setitem(cli.SUBCOMMANDS, "run", cli.SUBCOMMANDS["run"].__class__(
        cli.SUBCOMMANDS["run"].help, cli.SUBCOMMANDS["run"].add_arguments, lambda o: seen.setdefault("o", o) and 7))
    assert cli.main(["run", "prog.py", "--spawner", "h:1", "--", "a", "--max-tokens", "3"]) == 7
    options = seen["o"]
    assert (options.file, options.spawner, options.args) == ("prog.py", "h:1", ["a", "--max-tokens", "3"])


def test_subcommands_are_a_registry() -> None:
    cli.register("hello", "say hello", lambda parser: None, lambda options: 0)
    try:
        assert cli.main(["hello"]) == 0
    finally:
        del cli.SUBCOMMANDS["hello"]


def test_controller_config_needs_the_scheduler_address() -> None:
    with pytest.raises(ProgramError, match="L4M_SCHEDULER_ADDR"):
        ControllerConfig.from_env({})
    config = ControllerConfig.from_env({"L4M_SCHEDULER_ADDR": "unix:///run/l4m/scheduler.sock", "TRACEPARENT": "00-x"})
    assert config.runtime_address is None and config.traceparent == "00-x" and config.instance_id == "local"


def test_the_run_span_is_the_child_of_traceparent_and_the_parent_of_the_session() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    launch = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    config = ControllerConfig("unix:///s.sock", None, None, "i-1", launch)
    with pytest.raises(RuntimeError), run_span(config, "/p/main.py", provider.get_tracer("t")) as traced:
        raise RuntimeError("the program failed")
    (span,) = exporter.get_finished_spans()
    assert (span.name, span.parent.span_id, span.attributes["l4m.instance_id"]) == ("controller.run", 0xB7AD6B7169203331, "i-1")
    assert traced.traceparent == f"00-0af7651916cd43dd8448eb211c80319c-{span.context.span_id:016x}-01"
    assert not span.status.is_ok


def test_the_run_span_costs_nothing_untraced() -> None:
    config = ControllerConfig("unix:///s.sock", None, None, "i-1", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    with run_span(config, "main.py") as traced:  # the API's no-op tracer: the launch's context passes through
        assert traced == config


def test_load_program_errors_are_readable(tmp_path: Path) -> None:
    with pytest.raises(ProgramError, match="no program"):
        load_program(tmp_path / "missing.py")
    (tmp_path / "sync.py").write_text("def main(ctx):\n    pass\n")
    with pytest.raises(ProgramError, match="async def main"):
        load_program(tmp_path / "sync.py")
    (tmp_path / "broken.py").write_text("import no_such_module_here\n")
    with pytest.raises(ProgramError, match="ModuleNotFoundError"):
        load_program(tmp_path / "broken.py")


def test_a_program_runs_against_the_fake(run, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    program = tmp_path / "hello.py"
    program.write_text(
        "async def main(ctx):\n"
        "    async with ctx.new_context() as c:\n"
        "        c.fill_chat([{'role': 'user', 'content': ctx.args[0]}])\n"
        "        text = await c.generate_text(max_tokens=5)\n"
        "    await ctx.vars.set('done', 'yes')\n"
        "    await ctx.send(f'{len(text)} chars')\n"
        "    return 0\n"
    )
    fake = FakeL4M()
    runtime = LocalRuntime()
    result = run(run_main(load_program(program), ["hi"], Session(fake.stub()), runtime, "local"))
    assert result == 0 and run(runtime.get("done")).text == "yes"
    assert capsys.readouterr().out.startswith(MESSAGE_PREFIX)
    assert fake.num_pages_in_use == 0  # closing the session freed everything


def test_local_variables_compare_and_set_append_watch(run) -> None:
    async def body() -> None:
        variables = LocalVariables()
        watched = variables.watch("x")
        assert (await anext(watched)).exists is False
        assert (await variables.write("x", b"a", expected_version=0)).swapped
        assert not (await variables.write("x", b"b", expected_version=0)).swapped
        assert (await anext(watched)).value == b"a"
        assert (await variables.write("x", b"c", append=True)).value == b"ac"
        assert variables.get("x").version == 2

    run(body())


@pytest.mark.parametrize(("reason", "exit_code", "status"), [
    ("EXIT_REASON_EXITED", 0, 0),
    ("EXIT_REASON_CRASHED", 5, 5),  # `main` returned 5, or the program raised (1) or did not load (2)
    ("EXIT_REASON_CRASHED", 0, 1),  # killed by a signal no limit explains
    ("EXIT_REASON_TRAPPED", 3, 3),
    ("EXIT_REASON_MEMORY_LIMIT", 0, 1),
    ("EXIT_REASON_TERMINATED", 0, 1),
    ("EXIT_REASON_KILLED", 0, 1),  # a kill -9 from outside the spawner
])
def test_l4m_run_exits_with_the_controllers_own_status(reason: str, exit_code: int, status: int) -> None:
    assert exit_status(spawner_pb2.InstanceExit(reason=spawner_pb2.ExitReason.Value(reason), exit_code=exit_code)) == status


def test_run_limits_become_the_launchs_limits_in_the_protos_units() -> None:
    options = cli.build_parser().parse_args(["run", "p.py", "--wall-time-s", "1.5", "--memory-mib", "256",
                                             "--token-budget", "900", "--max-children", "2"])
    assert cli.launch_limits(options) == spawner_pb2.Limits(wall_time_ms=1500, memory_bytes=256 * 1024 * 1024,
                                                            max_tokens=900, max_children=2)
    assert cli.launch_limits(cli.build_parser().parse_args(["run", "p.py"])) is None  # the spawner's defaults


@pytest.mark.parametrize(("flag", "value", "error"), [
    ("--wall-time-s", "0", "must be a finite number > 0 (leave the flag out for the spawner's default)"),
    ("--cpu-time-s", "-3", "must be a finite number > 0"),
    ("--cpu-time-s", "inf", "must be a finite number > 0"),
    ("--token-budget", "1.5", "'1.5' is not an integer"),
    ("--memory-mib", "lots", "'lots' is not an integer"),
])
def test_bad_run_limits_are_refused_with_the_reason(flag: str, value: str, error: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "p.py", flag, value])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith(f"l4m run: error: argument {flag}: ") and error in message


def test_max_tokens_before_the_double_dash_is_refused_naming_both_meanings(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "p.py", "--max-tokens", "20", "--", "Hi"])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert "--token-budget N" in message and "`l4m run FILE -- --max-tokens 64 PROMPT`" in message


def test_run_and_attach_take_detach_and_credentials() -> None:
    options = cli.build_parser().parse_args(["run", "--detach", "p.py", "--api-key-file", "k", "--tls-ca", "ca.pem"])
    assert (options.detach, options.api_key_file, options.tls_ca) == (True, "k", "ca.pem")
    options = cli.build_parser().parse_args(["attach", "i-1", "--spawner", "h:1"])
    assert (options.command, options.instance_id, options.spawner) == ("attach", "i-1", "h:1")


def test_run_share_process_reaches_the_launch_attached_or_detached(monkeypatch: pytest.MonkeyPatch) -> None:
    import l4m.client

    calls: list[tuple[str, bool]] = []

    async def run_program(*args: object, **kwargs: object) -> int:
        calls.append(("run", bool(kwargs["share_process"])))
        return 0

    async def launch_detached(*args: object, **kwargs: object) -> str:
        calls.append(("detached", bool(kwargs["share_process"])))
        return "i-1"

    monkeypatch.setattr(l4m.client, "run_program", run_program)
    monkeypatch.setattr(l4m.client, "launch_detached", launch_detached)
    for argv in (["run", "p.py"], ["run", "--share-process", "p.py"], ["run", "--detach", "--share-process", "p.py"]):
        assert cli.main(argv) == 0
    assert calls == [("run", False), ("run", True), ("detached", True)]


def _secret_file(path: Path, text: str) -> Path:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


def test_the_api_key_comes_from_the_flag_then_the_environment_then_the_admin_key(tmp_path: Path) -> None:
    flag_file = _secret_file(tmp_path / "flag.key", "l4m_" + "f" * 43)
    env_file = _secret_file(tmp_path / "env.key", "l4m_" + "e" * 43)
    admin = _secret_file(tmp_path / "admin.key", "l4m_" + "a" * 43)
    env = {"L4M_API_KEY": "l4m_" + "k" * 43, "L4M_API_KEY_FILE": str(env_file)}
    assert find_api_key(flag_file, env, admin) == "l4m_" + "f" * 43
    assert find_api_key(None, env, admin) == "l4m_" + "k" * 43
    assert find_api_key(None, {"L4M_API_KEY_FILE": str(env_file)}, admin) == "l4m_" + "e" * 43
    assert find_api_key(None, {}, admin) == "l4m_" + "a" * 43
    assert find_api_key(None, {}, tmp_path / "missing.key") is None
    admin.chmod(0o644)
    with pytest.raises(L4MError, match="readable by others"):
        find_api_key(None, {}, admin)


def test_l4m_keys_add_prints_the_key_once_and_list_never_shows_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys_file = tmp_path / "api-keys.json"
    assert cli.main(["keys", "--keys-file", str(keys_file), "add", "alice", "--max-instances", "3"]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("l4m_") and len(key) == 47
    assert KeyStore.load(keys_file).authenticate(key).name == "alice"
    assert cli.main(["keys", "--keys-file", str(keys_file), "list"]) == 0
    listing = capsys.readouterr().out
    assert "alice" in listing and "user" in listing and key not in listing and key[4:] not in listing
    assert cli.main(["keys", "--keys-file", str(keys_file), "add", "alice"]) == 2
    assert "exists already" in capsys.readouterr().err
    assert cli.main(["keys", "--keys-file", str(keys_file), "remove", "alice"]) == 0
    assert KeyStore.load(keys_file).authenticate(key) is None


def test_l4m_store_refuses_a_missing_file_before_calling_the_spawner(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["store", "/nonexistent/prog.py", "--spawner", "127.0.0.1:1"]) == 2
    assert "/nonexistent/prog.py: no such file" in capsys.readouterr().err


def test_l4m_ps_shows_the_shared_process_and_how_ended_instances_ended() -> None:
    now_ms = 10_000_000
    running = spawner_pb2.InstanceInfo(
        instance_id="i-b", user="alice", state=spawner_pb2.INSTANCE_STATE_RUNNING, program_sha256="ab" * 32,
        launched_at_unix_ms=now_ms - 5_000, shared_process="p-1", args=["x" * 50])
    first = spawner_pb2.InstanceInfo(
        instance_id="i-a", user="alice", state=spawner_pb2.INSTANCE_STATE_STARTING, program_sha256="cd" * 32,
        launched_at_unix_ms=now_ms - 300_000, parent_instance_id="i-root")
    ended = spawner_pb2.InstanceInfo(
        instance_id="i-c", user="alice", state=spawner_pb2.INSTANCE_STATE_EXITED, program_sha256="ef" * 32,
        launched_at_unix_ms=now_ms, exit=spawner_pb2.InstanceExit(reason=spawner_pb2.EXIT_REASON_CRASHED, exit_code=7))
    header, *rows = cli.format_instances([running, ended, first], now_ms).splitlines()
    assert header.split() == ["ID", "USER", "STATUS", "AGE", "PROGRAM", "PROCESS", "PARENT", "ARGS"]
    assert [row.split() for row in rows] == [
        ["i-a", "alice", "starting", "5m", "cd" * 6, "-", "i-root"],  # oldest first; no args
        ["i-b", "alice", "running", "5s", "ab" * 6, "p-1", "-", "x" * 39 + "…"],
    ]
    _, *all_rows = cli.format_instances([running, ended, first], now_ms, show_exited=True).splitlines()
    assert all_rows[-1].split()[:4] == ["i-c", "alice", "crashed", "(7)"]
