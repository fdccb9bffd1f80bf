"""The zygote on its own (a plain child process, no sandbox): READY, one launch, GO, the program.

What a warm launch must look like to the program is what a cold start gives it: its arguments,
environment, stdin at end of file, sys.path[0], `__main__`, and rlimits lowered to the launch's.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from l4m.spawner import zygote

ZYGOTE = Path(zygote.__file__)
TIMEOUT_S = 60.0
PROGRAM = """
import os, resource, sys
print("name", __name__)
print("argv", sys.argv)
print("path0", sys.path[0])
print("env", os.environ.get("L4M_INSTANCE_TOKEN"))
print("stdin", repr(sys.stdin.read()))
print("nofile", resource.getrlimit(resource.RLIMIT_NOFILE))
print("cpu", resource.getrlimit(resource.RLIMIT_CPU))
"""


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: bytes
    stderr: str


def run_zygote(
    launch: bytes | None,
    modules: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> Result:
    process = subprocess.Popen(
        [sys.executable, str(ZYGOTE), *modules],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )
    stdout, stderr = process.communicate(launch or b"", timeout=TIMEOUT_S)
    return Result(process.returncode, stdout, stderr.decode())


def launch_for(program: Path, **change: object) -> dict[str, object]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    nofile = min(64, soft)
    return {
        "program": str(program),
        "args": ["--n", "3"],
        "env": {"L4M_INSTANCE_TOKEN": "secret-1"},
        "runner": "",
        "cpu_time_s": 30,
        "rlimits": {"RLIMIT_NOFILE": [nofile, nofile], "RLIMIT_CORE": [0, 0]},
        **change,
    }


def lines(stdout: bytes) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in stdout.decode().splitlines() if " " in line)


@pytest.fixture
def program(tmp_path: Path) -> Path:
    path = tmp_path / "program" / "main.py"
    path.parent.mkdir()
    path.write_text(PROGRAM)
    return path


def test_a_launch_becomes_what_a_cold_start_would_run(program: Path) -> None:
    result = run_zygote(json.dumps(launch_for(program)).encode(), modules=("json", "no_such_module_l4m"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(zygote.READY_LINE + zygote.GO_LINE)
    seen = lines(result.stdout)
    assert seen["name"] == "__main__"
    assert seen["argv"] == str([str(program), "--n", "3"])
    assert seen["path0"] == str(program.parent)
    assert seen["env"] == "secret-1"
    assert seen["stdin"] == "''"
    nofile = min(64, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    assert seen["nofile"] == str((nofile, nofile))
    cpu_soft, cpu_hard = eval(seen["cpu"])  # noqa: S307 - a tuple of two ints the program printed
    assert 30 <= cpu_soft <= 32 and cpu_hard == cpu_soft + 1  # 30 s on top of what the imports used


def test_a_runner_module_runs_like_python_dash_m(program: Path, tmp_path: Path) -> None:
    runner_dir = tmp_path / "runner"
    runner_dir.mkdir()
    (runner_dir / "l4m_test_runner.py").write_text(
        "import sys\nprint('runner', __name__, sys.argv[1:], sys.path[0])\n"
    )
    launch = launch_for(program, runner="l4m_test_runner")
    result = run_zygote(json.dumps(launch).encode(), env={"PYTHONPATH": str(runner_dir)}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert lines(result.stdout)["runner"] == f"__main__ {[str(program), '--n', '3']} {tmp_path}"


def test_a_warmed_up_runner_runs_without_a_warning(program: Path, tmp_path: Path) -> None:
    """The pool warms the runner itself up (`l4m.controller`); running it as __main__ afterwards must not
    print runpy's "found in sys.modules" warning, which would become a failed program's exit reason."""
    runner_dir = tmp_path / "runner"
    runner_dir.mkdir()
    (runner_dir / "l4m_test_pkg").mkdir()  # runpy warns about a package's submodule, as l4m.controller is
    (runner_dir / "l4m_test_pkg" / "__init__.py").write_text("")
    (runner_dir / "l4m_test_pkg" / "runner.py").write_text("print('runner', __name__)\n")
    launch = launch_for(program, runner="l4m_test_pkg.runner")
    result = run_zygote(json.dumps(launch).encode(), modules=("l4m_test_pkg.runner",),
                        env={"PYTHONPATH": str(runner_dir), "PYTHONWARNINGS": "default"}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(b"runner l4m_test_pkg.runner") == 1  # the warm-up import ran it once, not as main
    assert lines(result.stdout)["runner"] == "__main__"
    assert "Warning" not in result.stderr, result.stderr


def test_the_program_exit_status_is_the_sandbox_status(tmp_path: Path) -> None:
    program = tmp_path / "main.py"
    program.write_text("import sys\nsys.exit(7)\n")
    assert run_zygote(json.dumps(launch_for(program)).encode()).returncode == 7


BAD_LAUNCHES = {
    "not json": (lambda program: b"{not json", "JSONDecodeError"),
    "missing keys": (lambda program: json.dumps({"program": str(program)}).encode(), "'args' is missing"),
    "no program": (
        lambda program: json.dumps(launch_for(program.parent / "gone.py")).encode(),
        "not in the sandbox",
    ),
    "unknown rlimit": (
        lambda program: json.dumps(launch_for(program, rlimits={"RLIMIT_NICE": [0, 0]})).encode(),
        "unexpected rlimit 'RLIMIT_NICE'",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_LAUNCHES))
def test_a_bad_launch_never_runs_and_says_why(program: Path, case: str) -> None:
    make_launch, error = BAD_LAUNCHES[case]
    result = run_zygote(make_launch(program))
    assert result.returncode == zygote.EXIT_BAD_LAUNCH
    assert result.stdout == zygote.READY_LINE  # no GO, and the program never ran
    assert "l4m-zygote: bad launch" in result.stderr and error in result.stderr


def test_end_of_file_without_a_launch_ends_quietly() -> None:
    result = run_zygote(None)
    assert (result.returncode, result.stdout, result.stderr) == (0, zygote.READY_LINE, "")
