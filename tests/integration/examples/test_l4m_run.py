"""`l4m run` against a real `l4m up`: messages on stdout, log lines on stderr, and an exit status that says
how the controller ended, with the reason on stderr's last line when it did not end well."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.harness import L4M_CLI, REPO, CliRun, UpCluster, free_port, service_env

pytestmark = pytest.mark.slow


def program(tmp_path: Path, source: str) -> Path:
    path = tmp_path / "controller.py"
    path.write_text(source)
    return path


def reason(run: CliRun) -> str:
    return run.stderr.strip().splitlines()[-1]


def test_messages_go_to_stdout_logs_to_stderr_and_the_exit_code_is_the_controllers(
        l4m_run: Callable[..., CliRun], tmp_path: Path) -> None:
    source = ("async def main(ctx):\n    await ctx.send(f'args {ctx.args}')\n    print('a log line')\n"
              "    await ctx.send('two\\nlines')\n    return 5\n")
    run = l4m_run(program(tmp_path, source), "a b", "--flag")
    assert run.returncode == 5
    assert run.stdout == "args ['a b', '--flag']\ntwo\nlines\n"
    assert "a log line" in run.stderr.splitlines()
    assert reason(run) == "l4m: the controller ended: EXIT_REASON_CRASHED: exited with status 5"


def test_an_exception_exits_1_with_its_message(l4m_run: Callable[..., CliRun], tmp_path: Path) -> None:
    run = l4m_run(program(tmp_path, "async def main(ctx):\n    raise ValueError('no answer for you')\n"))
    assert (run.returncode, run.stdout) == (1, "")
    assert reason(run) == ("l4m: the controller ended: EXIT_REASON_CRASHED: exited with status 1: "
                           "ValueError: no answer for you")


def test_a_program_without_main_exits_2_saying_what_it_needs(l4m_run: Callable[..., CliRun], tmp_path: Path) -> None:
    run = l4m_run(program(tmp_path, "def main(ctx):\n    pass\n"))
    assert run.returncode == 2
    assert reason(run).endswith("must define `async def main(ctx)`")


def test_a_trapped_controller_exits_3_with_the_schedulers_reason(l4m_run: Callable[..., CliRun],
                                                                 tmp_path: Path) -> None:
    source = "async def main(ctx):\n    await ctx.send('before')\n    await ctx.model.debug_query('nonsense')\n"
    run = l4m_run(program(tmp_path, source))
    assert (run.returncode, run.stdout) == (3, "before\n")
    assert reason(run).startswith("l4m: the controller ended: EXIT_REASON_TRAPPED: ")
    assert "debug_query 'nonsense' is unknown; known: ping, stats" in reason(run)


def test_quiet_logs_hides_the_log_lines_but_not_the_reason(l4m_run: Callable[..., CliRun], tmp_path: Path) -> None:
    source = "async def main(ctx):\n    print('a log line')\n    raise SystemExit(4)\n"
    run = l4m_run(program(tmp_path, source), options=["--quiet-logs"])
    assert run.returncode == 4 and "a log line" not in run.stderr
    assert run.stderr.strip() == "l4m: the controller ended: EXIT_REASON_CRASHED: exited with status 4"


def test_no_spawner_exits_2_asking_whether_it_runs(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    argv = [str(L4M_CLI), "run", "--spawner", address, str(program(tmp_path, "async def main(ctx):\n    pass\n"))]
    proc = subprocess.run(argv, cwd=REPO, env=service_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith(f"is the spawner running at {address}?")


def test_a_refused_upload_says_why_without_asking_whether_the_spawner_runs(
    l4m_run: Callable[..., CliRun], tmp_path: Path
) -> None:
    run = l4m_run(program(tmp_path, "async def main(ctx)\n    pass\n"))  # no colon: not valid Python
    assert run.returncode == 2
    assert "upload failed (INVALID_ARGUMENT): the program is not valid Python" in run.stderr
    assert "is the spawner running" not in run.stderr


def test_a_wall_time_limit_ends_the_run_with_that_reason(l4m_run: Callable[..., CliRun], tmp_path: Path) -> None:
    source = "import asyncio\n\nasync def main(ctx):\n    await ctx.send('waiting')\n    await asyncio.sleep(600)\n"
    run = l4m_run(program(tmp_path, source), options=["--wall-time-s", "2"])
    assert (run.returncode, run.stdout) == (1, "waiting\n")
    assert reason(run) == "l4m: the controller ended: EXIT_REASON_WALL_TIME_LIMIT: ran past its wall time limit of 2 s"


def test_a_token_budget_traps_with_advice_to_raise_it(l4m_run: Callable[..., CliRun]) -> None:
    run = l4m_run(REPO / "examples" / "controllers" / "text_completion.py", "Hi there", options=["--token-budget", "20"])
    assert (run.returncode, run.stdout) == (3, "")
    assert "TRAP_KIND_TOKEN_BUDGET" in run.stderr and "raise Limits.max_tokens (`l4m run --token-budget N`)" in run.stderr
    assert reason(run).startswith("l4m: the controller ended: EXIT_REASON_TRAPPED: ")
    assert reason(run).endswith("of the instance's budget of 20")


def test_controllers_of_l4m_up_speak_l4m_over_framed_sessions(l4m_run: Callable[..., CliRun], tmp_path: Path) -> None:
    """`l4m up` serves framed sessions (docs/protocol.md) and the spawner points its controllers at them."""
    source = ("import os\nasync def main(ctx):\n    await ctx.send(os.environ['L4M_SCHEDULER_ADDR'])\n"
              "    await ctx.send(await ctx.model.debug_query('ping'))\n")
    run = l4m_run(program(tmp_path, source))
    assert (run.returncode, run.stdout) == (0, "framed:///run/l4m/scheduler.frames.sock\npong\n"), run.stderr


def service_policies(state_dir: Path) -> dict[str, int]:
    """`l4m.<service>` -> the CPU policy of the process `l4m up` started for it in `state_dir` (read from
    /proc: each service's command line names the state directory)."""
    policies: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if any(str(state_dir).encode() in arg for arg in argv) and b"-m" in argv:
                module = argv[argv.index(b"-m") + 1].decode()
                if module.startswith("l4m.") and module != "l4m.cli":
                    policies[module] = os.sched_getscheduler(int(entry.name))
        except (OSError, IndexError):
            continue  # a process that ended meanwhile
    return policies


def test_the_control_plane_and_controllers_yield_to_the_executor_on_wakeup(
        l4m_up: UpCluster, l4m_run: Callable[..., CliRun], tmp_path: Path) -> None:
    """`l4m up`'s defaults: the scheduler, spawner and gateway under SCHED_BATCH, the executor under
    SCHED_OTHER; a controller under SCHED_BATCH (the spawner's default), unable to change it."""
    policies = service_policies(l4m_up.state_dir)
    assert policies == {"l4m.executor": os.SCHED_OTHER, "l4m.scheduler": os.SCHED_BATCH,
                        "l4m.gateway": os.SCHED_BATCH, "l4m.spawner": os.SCHED_BATCH}, policies
    source = ("import os\n\nasync def main(ctx):\n    await ctx.send(f'policy {os.sched_getscheduler(0)}')\n"
              "    try:\n        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))\n"
              "    except PermissionError:\n        await ctx.send('refused')\n")
    run = l4m_run(program(tmp_path, source))
    assert (run.returncode, run.stdout) == (0, f"policy {os.SCHED_BATCH}\nrefused\n"), run.describe()
