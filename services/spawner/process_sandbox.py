"""The process backend: each instance runs under bubblewrap as its own unprivileged uid.

The chain started for one instance, each step exec'ing the next:

    sh      joins the instance's cgroups (writes its pid into each cgroup.procs)
    prlimit sets RLIMIT_CPU, NOFILE, NPROC, FSIZE, CORE (and AS where there is no memory cgroup)
    bwrap   as root: new mount/pid/net/ipc/uts/cgroup namespaces; binds only /usr, the Python
            installation, the venv, the SDK, the program and the socket directory, all read-only
    setpriv drops to uid/gid `uid_base + n` (one per live instance), no groups, no capabilities
            (bounding set cleared), no_new_privs
    python  `-m l4m.controller PROGRAM ARGS` (the SDK's runner; spec.runner_module), or the program

bwrap runs as root rather than behind setpriv because the Python installation lives under /root
(mode 0700): an unprivileged bwrap cannot even name it as a bind source. The program itself still
runs as a host uid that owns nothing, so a bind that shows too much is still guarded by file
permissions. A uid per instance keeps RLIMIT_NPROC (counted per uid across the host) per instance.
Because the sandbox has its own PID namespace, the instance's death (or bwrap's, thanks to
`--die-with-parent`) takes every process it started with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import shlex
import shutil
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import l4m
from l4m.spawner.cgroups import CgroupManager, InstanceCgroup
from l4m.spawner.sandbox import (
    SANDBOX_PROGRAM_DIR,
    SANDBOX_SDK_DIR,
    SANDBOX_SOCKET_DIR,
    SANDBOX_THREAD_ENV,
    ExitFacts,
    ExitInfo,
    ExitReason,
    Limits,
    OutputChunk,
    OutputStream,
    Sandbox,
    SandboxError,
    SandboxHandle,
    SandboxSpec,
    derive_exit_info,
    program_file_name,
    split_wait_status,
)

SANDBOX_VENV_DIR = "/opt/l4m/venv"
_INSTANCE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_READ_CHUNK_BYTES = 64 * 1024
_STDERR_TAIL_BYTES = 8 * 1024
_REQUIRED_TOOLS = ("bwrap", "setpriv", "prlimit")


def _default_sdk_path() -> Path:
    # l4m is clients/python/l4m; the sandbox gets its parent on PYTHONPATH.
    return Path(l4m.__file__).resolve().parent.parent


@dataclass(frozen=True)
class ProcessSandboxConfig:
    spawner_id: str = "default"
    python_prefix: Path = field(default_factory=lambda: Path(sys.prefix))  # venv or installation
    python_base_prefix: Path = field(default_factory=lambda: Path(sys.base_prefix))
    sdk_path: Path = field(default_factory=_default_sdk_path)
    uid_base: int = 100_000
    num_uids: int = 10_000
    cgroup_root: Path = Path("/sys/fs/cgroup")
    use_cgroups: bool = True


class UidPool:
    """Hands out one host uid per live instance."""

    def __init__(self, base: int, count: int) -> None:
        self._free = list(range(base + count - 1, base - 1, -1))

    def acquire(self) -> int:
        if not self._free:
            raise SandboxError("no free sandbox uid: too many instances alive at once")
        return self._free.pop()

    def release(self, uid: int) -> None:
        self._free.append(uid)


def _python_layout(config: ProcessSandboxConfig) -> tuple[list[tuple[Path, str]], str]:
    """(host dir, sandbox dir) binds for the interpreter, and the interpreter's path inside."""
    base = config.python_base_prefix
    binds: list[tuple[Path, str]] = []
    if not str(base).startswith("/usr/"):
        # Bound at its own path: a venv's bin/python is a symlink to it and pyvenv.cfg names it.
        binds.append((base.resolve(), str(base)))
    if config.python_prefix != base:
        binds.append((config.python_prefix.resolve(), SANDBOX_VENV_DIR))
        return binds, f"{SANDBOX_VENV_DIR}/bin/python3"
    return binds, str(base / "bin" / "python3")


def build_sandbox_env(spec: SandboxSpec) -> dict[str, str]:
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": "/tmp",
        "LANG": "C.UTF-8",
        "PYTHONPATH": SANDBOX_SDK_DIR,
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "L4M_SOCKET_DIR": SANDBOX_SOCKET_DIR,
        "L4M_INSTANCE_ID": spec.instance_id,
        **SANDBOX_THREAD_ENV,
    }
    env.update(spec.env)
    return env


def build_command(
    config: ProcessSandboxConfig,
    spec: SandboxSpec,
    uid: int,
    cgroup_procs: list[Path],
    has_memory_cgroup: bool,
) -> list[str]:
    """The whole sh → prlimit → bwrap → setpriv → python command line for one instance."""
    limits = spec.limits
    python_binds, python_exe = _python_layout(config)
    program_dest = f"{SANDBOX_PROGRAM_DIR}/{program_file_name(spec.program_path)}"
    ro_binds = [*python_binds, (config.sdk_path, SANDBOX_SDK_DIR), (spec.program_path, program_dest)]
    if spec.socket_dir is not None:
        ro_binds.append((spec.socket_dir, SANDBOX_SOCKET_DIR))

    bwrap = [
        "bwrap",
        "--die-with-parent",
        "--new-session",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--hostname",
        "sandbox",
        "--ro-bind", "/usr", "/usr",
        "--symlink", "usr/lib", "/lib",
        "--symlink", "usr/lib64", "/lib64",
        "--symlink", "usr/bin", "/bin",
        "--proc", "/proc",
        "--dev", "/dev",
        "--size", str(limits.tmp_bytes), "--perms", "1777", "--tmpfs", "/tmp",
        "--perms", "0755", "--tmpfs", "/run",
    ]  # fmt: skip
    # Directories bwrap creates for mount points copy the mode of the host's parents (0700 for
    # /root), which the sandbox uid could not traverse: create every ancestor 0755 first.
    created: set[str] = {"/", "/run", "/usr", "/tmp"}
    for source, dest in ro_binds:
        for ancestor in reversed(PurePosixPath(dest).parents):
            if str(ancestor) not in created:
                bwrap += ["--perms", "0755", "--dir", str(ancestor)]
                created.add(str(ancestor))
        bwrap += ["--ro-bind", str(source), dest]
    bwrap += ["--chdir", "/tmp", "--clearenv"]
    for key, value in build_sandbox_env(spec).items():
        bwrap += ["--setenv", key, value]
    # setpriv needs CAP_SETUID/SETGID (and SETPCAP to clear the bounding set); it drops them all.
    bwrap += ["--cap-drop", "ALL"]
    for cap in ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP"):
        bwrap += ["--cap-add", cap]
    bwrap += ["--"]

    setpriv = [
        "setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--no-new-privs",
        "--bounding-set=-all",
        "--inh-caps=-all",
        "--",
        python_exe,
        *spec.python_argv(program_dest),
    ]

    cpu_soft = max(1, math.ceil(limits.cpu_time_s))
    prlimit = [
        "prlimit",
        f"--cpu={cpu_soft}:{cpu_soft + 1}",
        f"--nofile={limits.max_open_files}:{limits.max_open_files}",
        f"--nproc={limits.max_processes}:{limits.max_processes}",
        f"--fsize={limits.tmp_bytes}:{limits.tmp_bytes}",
        "--core=0:0",
    ]
    if not has_memory_cgroup:
        prlimit.append(f"--as={limits.memory_bytes}:{limits.memory_bytes}")
    prlimit.append("--")

    join = "".join(f"echo $$ > {shlex.quote(str(path))} || exit 125; " for path in cgroup_procs)
    return ["/bin/sh", "-c", join + 'exec "$@"', "l4m-sandbox", *prlimit, *bwrap, *setpriv]


class ProcessSandbox(Sandbox):
    kind = "process"

    def __init__(self, config: ProcessSandboxConfig | None = None) -> None:
        self.config = config or ProcessSandboxConfig()
        missing = [tool for tool in _REQUIRED_TOOLS if shutil.which(tool) is None]
        if missing:
            raise SandboxError(
                f"the process sandbox needs {', '.join(missing)} on PATH "
                "(Debian: apt-get install bubblewrap util-linux)"
            )
        if os.geteuid() != 0:
            raise SandboxError(
                "the process sandbox must run as root: it switches each instance to its own uid"
            )
        self._cgroups = (
            CgroupManager(self.config.spawner_id, self.config.cgroup_root)
            if self.config.use_cgroups
            else None
        )
        self._uids = UidPool(self.config.uid_base, self.config.num_uids)

    @property
    def cgroup_controllers(self) -> tuple[str, ...]:
        return tuple(self._cgroups.available) if self._cgroups else ()

    def enforcement(self) -> dict[str, str]:
        controllers = self.cgroup_controllers
        return {
            "wall_time_s": "spawner timer",
            "cpu_time_s": "rlimit cpu (per process: SIGXCPU, then SIGKILL)"
            + (" + cgroup cpuacct polled by the spawner (whole sandbox)" if "cpuacct" in controllers else ""),
            "memory_bytes": "cgroup memory (OOM kill)"
            if "memory" in controllers
            else "rlimit as (MemoryError)",
            "max_processes": ("cgroup pids + " if "pids" in controllers else "")
            + "rlimit nproc (per-instance uid)",
            "max_open_files": "rlimit nofile",
            "max_output_bytes": "spawner pipe counter",
            "cpu_cores": "cgroup cpu cfs quota" if "cpu" in controllers else "not enforced",
            "tmp_bytes": "tmpfs size + rlimit fsize",
            "network": "bwrap --unshare-net (no interfaces but lo)",
        }

    async def cleanup_orphans(self) -> int:
        # Sandboxes die with the spawner (--die-with-parent); only their cgroups can be left.
        if self._cgroups is None:
            return 0
        return await asyncio.to_thread(self._cgroups.cleanup_orphans)

    def close(self) -> None:
        """Forgets this spawner id's cgroup parents once every instance has ended."""
        if self._cgroups is not None:
            self._cgroups.remove_parents()

    async def start(self, spec: SandboxSpec) -> SandboxHandle:
        if not _INSTANCE_ID_RE.match(spec.instance_id):
            raise SandboxError(f"invalid instance id {spec.instance_id!r}")
        if not spec.program_path.is_file():
            raise SandboxError(f"program file {spec.program_path} does not exist")
        uid = self._uids.acquire()
        cgroup: InstanceCgroup | None = None
        try:
            if self._cgroups is not None:
                cgroup = self._cgroups.create(spec.instance_id, spec.limits)
            procs = cgroup.procs_files() if cgroup else []
            has_memory = cgroup is not None and "memory" in cgroup.dirs
            command = build_command(self.config, spec, uid, procs, has_memory)
            process = await asyncio.create_subprocess_exec(
                *command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
        except BaseException:
            if cgroup is not None:
                cgroup.remove()
            self._uids.release(uid)
            raise
        return ProcessHandle(spec, process, cgroup, lambda: self._uids.release(uid))


class ProcessHandle(SandboxHandle):
    def __init__(
        self,
        spec: SandboxSpec,
        process: asyncio.subprocess.Process,
        cgroup: InstanceCgroup | None,
        release_uid: Callable[[], None],
    ) -> None:
        self.instance_id = spec.instance_id
        self._limits: Limits = spec.limits
        self._process = process
        self._cgroup = cgroup
        self._release_uid = release_uid
        self._queue: asyncio.Queue[OutputChunk | None] = asyncio.Queue()
        self._stderr_tail = bytearray()
        self._readers = [
            asyncio.create_task(self._read(process.stdout, OutputStream.STDOUT)),
            asyncio.create_task(self._read(process.stderr, OutputStream.STDERR)),
        ]
        self._kill_reason: ExitReason | None = None
        self._kill_message = ""
        self._exit: asyncio.Task[ExitInfo] | None = None

    async def _read(self, stream: asyncio.StreamReader, name: OutputStream) -> None:
        try:
            while data := await stream.read(_READ_CHUNK_BYTES):
                if name is OutputStream.STDERR:
                    self._stderr_tail += data
                    del self._stderr_tail[:-_STDERR_TAIL_BYTES]
                self._queue.put_nowait(OutputChunk(name, data))
        finally:
            self._queue.put_nowait(None)

    async def output(self) -> AsyncIterator[OutputChunk]:
        num_open = len(self._readers)
        while num_open:
            chunk = await self._queue.get()
            if chunk is None:
                num_open -= 1
            else:
                yield chunk

    def cpu_time_s(self) -> float | None:
        return self._cgroup.cpu_time_s() if self._cgroup else None

    async def kill(self, reason: ExitReason, message: str) -> None:
        if self._kill_reason is None and self._process.returncode is None:
            self._kill_reason, self._kill_message = reason, message
        with contextlib.suppress(ProcessLookupError):
            self._process.kill()
        if self._cgroup is not None:
            await asyncio.to_thread(self._cgroup.kill_all)

    async def wait(self) -> ExitInfo:
        if self._exit is None:
            self._exit = asyncio.ensure_future(self._wait_once())
        return await asyncio.shield(self._exit)

    async def _wait_once(self) -> ExitInfo:
        try:
            status = await self._process.wait()
            # Every process of the sandbox died with its PID namespace, so the pipes close at once;
            # the timeout only guards against a kernel that kept one alive.
            _, pending = await asyncio.wait(self._readers, timeout=5.0)
            if pending:
                if self._cgroup is not None:
                    await asyncio.to_thread(self._cgroup.kill_all)
                await asyncio.wait(pending, timeout=1.0)
                for task in pending:
                    task.cancel()
            exit_code, signal = split_wait_status(status)
            cgroup = self._cgroup
            facts = ExitFacts(
                limits=self._limits,
                exit_code=exit_code,
                signal=signal,
                kill_reason=self._kill_reason,
                kill_message=self._kill_message,
                memory_oom_kills=cgroup.memory_oom_kills() if cgroup else None,
                memory_limit_hits=cgroup.memory_limit_hits() if cgroup else None,
                pids_refused=cgroup.pids_refused() if cgroup else None,
                cpu_time_s=cgroup.cpu_time_s() if cgroup else None,
                stderr_tail=bytes(self._stderr_tail),
                memory_mechanism="cgroup memory" if cgroup and "memory" in cgroup.dirs else "rlimit as",
                pids_mechanism="cgroup pids" if cgroup and "pids" in cgroup.dirs else "rlimit nproc",
            )
            return derive_exit_info(facts)
        finally:
            if self._cgroup is not None:
                await asyncio.to_thread(self._cgroup.remove)
            self._release_uid()
