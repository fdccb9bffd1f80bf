"""The sandbox interface every backend implements, and how an exit becomes an exit reason.

A backend (`ProcessSandbox`: bubblewrap; `DockerSandbox`: a container) turns a `SandboxSpec` into a
running `SandboxHandle`. The handle yields raw output chunks, can be killed with a reason, reports
resource usage it can measure, and resolves to one `ExitInfo`. Wall time, output bytes and
CPU-time polling are the supervisor's (`supervisor.py`), the same for every backend; what only the
kernel or the engine can enforce (memory, process count, open files, per-process CPU time) the
backend sets up, and `derive_exit_info` reads its counters back to say which limit was hit.
"""

from __future__ import annotations

import abc
import os
import signal as signal_module
import zipfile
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

MiB = 1024 * 1024

# How a program's process is named inside every sandbox, whatever the backend.
SANDBOX_SOCKET_DIR = "/run/l4m"
SANDBOX_PROGRAM_DIR = "/opt/l4m/program"
SANDBOX_SDK_DIR = "/opt/l4m/python"
# Numeric libraries start one thread per host core at import; in a sandbox those count against the
# process limit (and the CPU share is one core anyway), so they get one. glibc gives threads malloc arenas
# of their own, up to 8 per core, each reserving 64 MiB of address space: where the memory limit is
# RLIMIT_AS (no writable memory cgroup, e.g. in a Kubernetes pod), a controller whose gRPC threads
# multiply under load ran out of address space starting one (pthread_create: EAGAIN, then SIGABRT;
# 6-13 of a burst of 64 warm launches on 2 cores, none with two arenas), so they get two.
SANDBOX_THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                      "MALLOC_ARENA_MAX": "2"}
# The CPU scheduling policy a launched controller runs under (the spawner's --controller-cpu-policy), by
# name. "batch" (SCHED_BATCH, the default): the same share of CPU time by weight as "normal"
# (SCHED_OTHER), but a controller that wakes never preempts a running task; it waits for a CPU to come
# free or for the running task's time slice to end. On a host where an executor decodes on the same
# cores, a preempted thread of the executor holds its partner threads at their next barrier, so a
# controller's wake-up costs the executor more than the controller's own CPU time (docs/benchmarks.md,
# round 14). A controller cannot change its policy: the seccomp filter denies sched_setscheduler and
# sched_setattr (seccomp.py).
CPU_POLICIES = {"normal": os.SCHED_OTHER, "batch": os.SCHED_BATCH}
DEFAULT_CPU_POLICY = "batch"


def check_cpu_policy(name: str) -> None:
    """Raises ValueError naming `name` and the choices unless it is in CPU_POLICIES."""
    if name not in CPU_POLICIES:
        raise ValueError(f"unknown CPU policy {name!r} (expected one of {', '.join(CPU_POLICIES)})")


@dataclass(frozen=True)
class Limits:
    """Per-instance resource limits. Zero means "no limit" only where a field says so."""

    wall_time_s: float = 300.0
    cpu_time_s: float = 60.0
    memory_bytes: int = 512 * MiB
    max_processes: int = 64  # tasks (processes + threads) alive at once in the sandbox
    max_open_files: int = 256
    max_output_bytes: int = 16 * MiB  # stdout + stderr together
    cpu_cores: float = 1.0  # CPU bandwidth share; 0 = unthrottled
    tmp_bytes: int = 64 * MiB  # size of the private /tmp (also the largest file it may write)


class ExitReason(StrEnum):
    EXITED = "exited"  # ran to its end and exited with status 0
    CRASHED = "crashed"  # non-zero status or a fatal signal that no limit explains
    KILLED = "killed"  # killed from outside the sandbox for a reason the spawner did not choose
    WALL_TIME_LIMIT = "wall_time_limit"
    CPU_TIME_LIMIT = "cpu_time_limit"
    MEMORY_LIMIT = "memory_limit"
    PROCESS_LIMIT = "process_limit"
    OUTPUT_LIMIT = "output_limit"
    TRAPPED = "trapped"  # the scheduler trapped the instance (a bad L4M command)
    TERMINATED = "terminated"  # the user asked for it
    LAUNCH_FAILED = "launch_failed"  # the sandbox could not start
    PARENT_EXITED = "parent_exited"  # a child controller whose parent ended first


@dataclass(frozen=True)
class ExitInfo:
    reason: ExitReason
    message: str
    exit_code: int | None = None
    signal: int | None = None
    enforced_by: str = ""  # the mechanism that stopped it, e.g. "cgroup memory", "rlimit cpu"

    @property
    def is_limit(self) -> bool:
        return self.reason.value.endswith("_limit")


@dataclass(frozen=True)
class SandboxSpec:
    """What to run and under which limits. Paths are host paths; the backend binds them in."""

    instance_id: str
    program_path: Path
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    socket_dir: Path | None = None  # mounted at /run/l4m; its sockets must be usable by any uid
    limits: Limits = field(default_factory=Limits)
    # `python -m <runner_module> <program> <args>` when set (the spawner uses the SDK's runner,
    # `l4m.controller`, which calls the program's `async def main(ctx)`); empty: `python <program>`.
    runner_module: str = ""

    def python_argv(self, program_dest: str) -> list[str]:
        """What follows the interpreter on its command line, for the program mounted at `program_dest`."""
        runner = ["-m", self.runner_module] if self.runner_module else []
        return [*runner, program_dest, *self.args]


def program_file_name(program_path: Path) -> str:
    """The program's name inside a sandbox. Python runs a zip through its `__main__.py` whatever the
    file is called; the suffix is for people reading `ps`."""
    return "main.pyz" if zipfile.is_zipfile(program_path) else "main.py"


class OutputStream(StrEnum):
    STDOUT = "stdout"
    STDERR = "stderr"


@dataclass(frozen=True)
class OutputChunk:
    stream: OutputStream
    data: bytes


@dataclass(frozen=True)
class ExitFacts:
    """Everything a backend observed about an exit; `derive_exit_info` turns it into an ExitInfo.

    `exit_code`/`signal` describe the program's own end (a backend decodes "128 + N" statuses).
    Counters come from cgroups or the engine; None means "this backend cannot tell".
    """

    limits: Limits
    exit_code: int | None = None
    signal: int | None = None
    kill_reason: ExitReason | None = None  # set when the spawner killed it, for that reason
    kill_message: str = ""
    memory_oom_kills: int | None = None
    memory_limit_hits: int | None = None
    pids_refused: int | None = None
    cpu_time_s: float | None = None
    stderr_tail: bytes = b""
    memory_mechanism: str = "cgroup memory"  # what enforces the memory limit on this backend
    pids_mechanism: str = "cgroup pids"  # what enforces the process limit on this backend


class SandboxHandle(abc.ABC):
    """One running sandbox. `wait()` resolves once, after the output has been fully read."""

    instance_id: str
    is_warm: bool = False  # taken from a warm pool rather than started for this launch

    @abc.abstractmethod
    def output(self) -> AsyncIterator[OutputChunk]:
        """Raw output chunks in arrival order; ends when both streams are closed."""

    @abc.abstractmethod
    async def wait(self) -> ExitInfo:
        """Waits for the exit, releases every resource the sandbox held, and says why it ended."""

    @abc.abstractmethod
    async def kill(self, reason: ExitReason, message: str) -> None:
        """Kills everything in the sandbox; the first reason given is the one `wait()` reports."""

    def cpu_time_s(self) -> float | None:
        """CPU seconds used by every process of the sandbox so far, if the backend can measure it."""
        return None


class Sandbox(abc.ABC):
    """A sandbox backend: starts programs under limits and cleans up after a crashed spawner."""

    kind: str

    @abc.abstractmethod
    async def start(self, spec: SandboxSpec) -> SandboxHandle: ...

    @abc.abstractmethod
    async def cleanup_orphans(self) -> int:
        """Removes sandboxes a previous run of this spawner left behind; returns how many."""

    @abc.abstractmethod
    def enforcement(self) -> dict[str, str]:
        """Which mechanism enforces each limit on this machine (limit name -> mechanism)."""

    async def open(self) -> None:
        """Starts what the backend runs in the background (the process backend's warm pool) on the
        running loop, the one that will launch. Call it after `cleanup_orphans`."""
        return None

    async def close(self) -> None:
        """Stops that background work and destroys whatever it had started ahead of demand; running
        instances are not touched. `open` may follow again."""
        return None


class SandboxError(Exception):
    """A sandbox could not be started (missing tool, engine down, bad spec)."""


_MEMORY_MARKERS = (b"MemoryError", b"Cannot allocate memory", b"std::bad_alloc", b"out of memory")
_PROCESS_MARKERS = (
    b"BlockingIOError: [Errno 11]",
    b"Resource temporarily unavailable",
    b"can't start new thread",
)


# Signals that end a program from outside: none is raised by a fault of the program's own (those are
# SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL: crashes). Checked after every limit, so a SIGKILL the
# spawner, the kernel's cgroup OOM killer or RLIMIT_CPU sent is named after that cause. A program that
# sends one of these to itself is reported KILLED too: it cannot be told apart, and says nothing false.
_OUTSIDE_SIGNALS = frozenset({signal_module.SIGKILL, signal_module.SIGTERM, signal_module.SIGINT,
                              signal_module.SIGHUP, signal_module.SIGQUIT})


def derive_exit_info(facts: ExitFacts) -> ExitInfo:
    """Says why a sandbox ended, most specific cause first: a spawner kill, then a limit the kernel
    counted, then the symptoms a limit leaves in stderr (for machines without cgroups), then the
    program's own status."""
    code, sig = facts.exit_code, facts.signal
    status = _describe_status(code, sig)
    if facts.kill_reason is not None:
        return ExitInfo(facts.kill_reason, facts.kill_message or status, code, sig, "spawner")
    if facts.memory_oom_kills:
        return ExitInfo(
            ExitReason.MEMORY_LIMIT,
            f"killed by the kernel's OOM killer at the memory limit of {facts.limits.memory_bytes} bytes",
            code,
            sig,
            facts.memory_mechanism,
        )
    if sig == signal_module.SIGXCPU or (
        sig == signal_module.SIGKILL
        and facts.cpu_time_s is not None
        and facts.cpu_time_s >= facts.limits.cpu_time_s
    ):
        return ExitInfo(
            ExitReason.CPU_TIME_LIMIT,
            f"used its CPU time limit of {facts.limits.cpu_time_s:g} s ({status})",
            code,
            sig,
            "rlimit cpu",
        )
    failed = sig is not None or (code is not None and code != 0)
    if failed and facts.memory_limit_hits and _has_marker(facts.stderr_tail, _MEMORY_MARKERS):
        return _memory_refused(facts, status)
    if failed and facts.pids_refused:
        return _processes_refused(facts, status)
    if failed and _has_marker(facts.stderr_tail, _MEMORY_MARKERS):
        return _memory_refused(facts, status)
    if failed and _has_marker(facts.stderr_tail, _PROCESS_MARKERS):
        if facts.memory_mechanism == "rlimit as" and facts.pids_mechanism == "rlimit nproc":
            return _process_or_address_space_refused(facts, status)
        return _processes_refused(facts, status)
    if code == 0 and sig is None:
        return ExitInfo(ExitReason.EXITED, status, code, sig)
    if sig in _OUTSIDE_SIGNALS:
        return ExitInfo(
            ExitReason.KILLED,
            f"{status}, sent from outside the spawner (an operator, a supervisor or the host's OOM killer); "
            "no limit explains it",
            code,
            sig,
        )
    last_line = last_stderr_line(facts.stderr_tail)
    return ExitInfo(ExitReason.CRASHED, f"{status}: {last_line}" if last_line else status, code, sig)


def last_stderr_line(stderr_tail: bytes, max_chars: int = 500) -> str:
    """The last non-blank line the program wrote to stderr: for a Python exception, "Error: why"."""
    for line in reversed(stderr_tail.decode("utf-8", errors="replace").splitlines()):
        if line.strip():
            return line.strip()[:max_chars]
    return ""


def _memory_refused(facts: ExitFacts, status: str) -> ExitInfo:
    return ExitInfo(
        ExitReason.MEMORY_LIMIT,
        f"an allocation was refused at the memory limit of {facts.limits.memory_bytes} bytes ({status})",
        facts.exit_code,
        facts.signal,
        facts.memory_mechanism,
    )


def _processes_refused(facts: ExitFacts, status: str) -> ExitInfo:
    return ExitInfo(
        ExitReason.PROCESS_LIMIT,
        f"creating a process or thread was refused at the limit of {facts.limits.max_processes} ({status})",
        facts.exit_code,
        facts.signal,
        facts.pids_mechanism,
    )


def _process_or_address_space_refused(facts: ExitFacts, status: str) -> ExitInfo:
    """EAGAIN from fork or a thread start under rlimits alone: RLIMIT_NPROC refuses a task, and RLIMIT_AS
    refuses a thread's stack the same way; no counter says which."""
    return ExitInfo(
        ExitReason.PROCESS_LIMIT,
        f"creating a process or thread was refused ({status}): at the limit of {facts.limits.max_processes} "
        f"processes, or for address space under the memory limit of {facts.limits.memory_bytes} bytes (a "
        "thread's stack needs some); without cgroups nothing counts which",
        facts.exit_code,
        facts.signal,
        f"{facts.pids_mechanism} or {facts.memory_mechanism}",
    )


def _has_marker(stderr_tail: bytes, markers: tuple[bytes, ...]) -> bool:
    return any(marker in stderr_tail for marker in markers)


def _describe_status(code: int | None, sig: int | None) -> str:
    if sig is not None:
        try:
            name = signal_module.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"killed by {name}"
    return f"exited with status {code}"


def split_wait_status(status: int) -> tuple[int | None, int | None]:
    """(exit code, signal) from a status where "128 + N" means "killed by signal N" (bwrap, tini,
    docker) and a negative value means the supervised process itself got signal -N."""
    if status < 0:
        return None, -status
    if 128 < status <= 128 + 64:
        return None, status - 128
    return status, None
