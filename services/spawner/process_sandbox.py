"""The process backend: each instance runs under bubblewrap as its own unprivileged uid.

The chain started for one instance, each step exec'ing the next:

    sh      joins the instance's cgroups (writes its pid into each cgroup.procs)
    chrt    warm sandboxes only: `--idle 0`, SCHED_IDLE from here on (see the warm pool below)
    prlimit sets RLIMIT_CPU, NOFILE, NPROC, FSIZE, CORE (and AS where there is no memory cgroup)
    bwrap   as root: new mount/pid/net/ipc/uts/cgroup namespaces; binds only /usr, the Python
            installation, the venv, the SDK, the program and the socket directory, all read-only;
            mounts no /proc (its mount table would name every bind's host path);
            sets no_new_privs and installs the seccomp filter (seccomp.py: no new namespaces, mount,
            ptrace, bpf, keyctl, perf...), read from a pipe only this chain inherits
    setpriv drops to a uid/gid of its own (one per live instance, from a range this spawner holds
            alone on the host: `UidPool`), no groups, no capabilities (bounding set cleared),
            no_new_privs
    python  `-m l4m.controller PROGRAM ARGS` (the SDK's runner; spec.runner_module), or the program

bwrap runs as root rather than behind setpriv because the Python installation lives under /root
(mode 0700): an unprivileged bwrap cannot even name it as a bind source. The program itself still
runs as a host uid that owns nothing, so a bind that shows too much is still guarded by file
permissions. A uid per instance keeps RLIMIT_NPROC (counted per uid across the host) per instance.
Because the sandbox has its own PID namespace, the instance's death (or bwrap's, thanks to
`--die-with-parent`) takes every process it started with it.

**Warm pool** (`warm_pool_size` > 0): most of a launch's time is Python importing the SDK, so the
backend keeps that many sandboxes started ahead of demand, built by the same chain but running
`zygote.py` (which imports the SDK and waits on stdin) under a uid, cgroups and rlimits of their own
set at the pool's ceilings (`warm_max_limits`), with an empty directory of their own bound read-only
at /opt/l4m/program and the pool's socket directory at /run/l4m. A launch takes one (`WarmSandbox`)
and, before any of its code runs: the spawner writes the launch's limits into the sandbox's cgroups
and copies the program into that directory; the zygote lowers its rlimits to the launch's, takes its
environment (token, TRACEPARENT...) and arguments, and runs it in place. A warm sandbox serves one
launch and ends with it; the pool refills behind it. A launch the pool cannot serve the same way a
cold start would (`warm_refusal`: another socket directory or /tmp size, a limit above the pool's
ceilings, interpreter variables in its environment) starts cold, as does any launch while the pool
is empty or when a hand-off fails.

A warm sandbox starts at idle CPU priority, since it is work done ahead of demand: its chain runs
under SCHED_IDLE, and instead of its own cpu cgroup it joins the spawner's idle one (cgroups.py,
`cpu.idle` = 1). Both are needed: CFS weighs a group as one entity among its siblings, so SCHED_IDLE
tasks inside an ordinary group (their own cpu cgroup, or the session autogroup bubblewrap's
`--new-session` gives them) would still get that group's full share. The hand-off, before the launch
is written, moves every process of the sandbox into its own cpu cgroup (the CPU bandwidth limit a
cold start runs under) and sets every thread to SCHED_OTHER at the spawner's nice value, what a cold
start inherits; if that fails, the launch starts cold. A start waiting for an idle CPU is not broken: its timeout
(`WARM_START_TIMEOUT_S`) counts only the time it was not waiting for one (`cpu_priority.StartClock`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import math
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import l4m
from l4m.spawner import seccomp, zygote
from l4m.spawner.cgroups import CgroupManager, InstanceCgroup
from l4m.spawner.cpu_priority import StartClock, run_delays_ns, sandbox_tree, set_normal_priority
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
from l4m.spawner.warm_pool import WarmPool, WarmPoolStats

log = logging.getLogger(__name__)

SANDBOX_VENV_DIR = "/opt/l4m/venv"
SANDBOX_ZYGOTE = "/opt/l4m/zygote/zygote.py"
ZYGOTE_PATH = Path(zygote.__file__).resolve()
# What a warm sandbox imports before it waits: the SDK a controller uses (the runner comes first).
SDK_WARM_MODULES = ("l4m.controller", "l4m.wire.brle", "l4m.constraint", "l4m.search", "l4m.drafter", "tokenizers")
# CPU seconds a warm sandbox may use before its launch (the imports take well under one); the launch
# then gets its own limit on top of what was used (see zygote.lower_rlimits).
WARM_UP_CPU_S = 30
# From start to READY, not counting time spent waiting for a CPU (a start runs at idle priority, so on
# a busy machine it waits as long as the machine stays busy): only a stuck start reaches it.
WARM_START_TIMEOUT_S = 120.0
READY_POLL_S = 1.0  # how often a start's clock is advanced
HANDOFF_TIMEOUT_S = 10.0  # from writing the launch to GO
_INSTANCE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_READ_CHUNK_BYTES = 64 * 1024
_STDERR_TAIL_BYTES = 8 * 1024
_REQUIRED_TOOLS = ("bwrap", "setpriv", "prlimit", "chrt")
# Where every spawner on this host claims its range of sandbox uids (see `UidPool`).
UID_LOCK_DIR = Path("/run/l4m-sandbox-uids")
UID_CHUNK = 1000  # uids per lock file


def _claim_uid_chunks(lock_dir: Path, start: int, count: int) -> list[int] | None:
    """Locks every chunk of uids [start, start + count); None (holding nothing) when one is taken."""
    fds: list[int] = []
    for chunk in range(start // UID_CHUNK, (start + count - 1) // UID_CHUNK + 1):
        fd = os.open(lock_dir / f"uids-{chunk * UID_CHUNK}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fds.append(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _close_all(fds)
            return None
    return fds


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


def _default_sdk_path() -> Path:
    # l4m is clients/python/l4m; the sandbox gets its parent on PYTHONPATH.
    return Path(l4m.__file__).resolve().parent.parent


@dataclass(frozen=True)
class ProcessSandboxConfig:
    spawner_id: str = "default"
    python_prefix: Path = field(default_factory=lambda: Path(sys.prefix))  # venv or installation
    python_base_prefix: Path = field(default_factory=lambda: Path(sys.base_prefix))
    sdk_path: Path = field(default_factory=_default_sdk_path)
    uid_base: int = 100_000  # first uid tried; a range another spawner on this host holds is skipped
    num_uids: int = 10_000
    uid_lock_dir: Path = UID_LOCK_DIR
    cgroup_root: Path = Path("/sys/fs/cgroup")
    use_cgroups: bool = True
    warm_pool_size: int = 0  # sandboxes kept started ahead of demand; 0: every launch starts cold
    # Ceilings a warm sandbox starts under; a launch above one starts cold. tmp_bytes must match exactly
    # (the size of /tmp is fixed when the sandbox starts).
    warm_max_limits: Limits = field(default_factory=Limits)
    warm_socket_dir: Path | None = None  # bound at /run/l4m in warm sandboxes
    warm_modules: tuple[str, ...] = SDK_WARM_MODULES
    # Holds one directory per warm sandbox (the program is copied into it); None: a private temporary
    # directory made by `open`. Its contents are orphans after a crash.
    warm_dir: Path | None = None


class UidPool:
    """Hands out one host uid per live instance, from a range no other pool on this host holds.

    A pool claims its range by holding an `flock` on one file per `UID_CHUNK` uids under `lock_dir`
    for as long as it lives; the kernel drops the locks when the process dies, so a crashed spawner
    leaves no claim behind. When any chunk of the range is held, the pool moves up by its own size (in whole chunks)
    and tries again, so two clusters (or two spawners) on one host never hand out the same uid: a
    shared uid would let one tenant's sandbox signal another's processes and would share RLIMIT_NPROC."""

    def __init__(self, base: int, count: int, lock_dir: Path = UID_LOCK_DIR, max_moves: int = 200) -> None:
        lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        lock_dir.chmod(0o700)  # root's only: nobody else may take (or hold) a range
        step = -(-count // UID_CHUNK) * UID_CHUNK  # whole chunks: a smaller step would stay in a held one
        for move in range(max_moves + 1):
            start = base + move * step
            fds = _claim_uid_chunks(lock_dir, start, count)
            if fds is not None:
                break
        else:
            raise SandboxError(
                f"no free range of {count} sandbox uids from {base} on: {max_moves + 1} ranges are held by other "
                f"spawners on this host (locks in {lock_dir})"
            )
        self.first_uid = start
        if move:
            log.info("sandbox uids %d..%d are held by another spawner; using %d..%d",
                     base, base + count - 1, start, start + count - 1)
        self._fds = fds
        weakref.finalize(self, _close_all, fds)
        self._free = list(range(start + count - 1, start - 1, -1))

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


def base_sandbox_env() -> dict[str, str]:
    """The environment every sandbox starts with, before the instance's own variables."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": "/tmp",
        "LANG": "C.UTF-8",
        "PYTHONPATH": SANDBOX_SDK_DIR,
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "L4M_SOCKET_DIR": SANDBOX_SOCKET_DIR,
        **SANDBOX_THREAD_ENV,
    }


def instance_env(spec: SandboxSpec) -> dict[str, str]:
    """The instance's variables on top of the base environment."""
    return {"L4M_INSTANCE_ID": spec.instance_id, **spec.env}


def build_sandbox_env(spec: SandboxSpec) -> dict[str, str]:
    return {**base_sandbox_env(), **instance_env(spec)}


def cpu_rlimit_s(limits: Limits) -> int:
    """RLIMIT_CPU's soft value (SIGXCPU) for `limits`; the hard one (SIGKILL) is one second later."""
    return max(1, math.ceil(limits.cpu_time_s))


def build_command(
    config: ProcessSandboxConfig,
    spec: SandboxSpec,
    uid: int,
    cgroup_procs: list[Path],
    has_memory_cgroup: bool,
    seccomp_fd: int,
) -> list[str]:
    """The whole sh → prlimit → bwrap → setpriv → python command line for one instance; bwrap reads
    the seccomp filter from `seccomp_fd` (see `seccomp.filter_fd`)."""
    program_dest = f"{SANDBOX_PROGRAM_DIR}/{program_file_name(spec.program_path)}"
    return _chain(
        config,
        spec.limits,
        [(spec.program_path, program_dest)],
        spec.socket_dir,
        build_sandbox_env(spec),
        spec.python_argv(program_dest),
        uid,
        cgroup_procs,
        has_memory_cgroup,
        cpu_rlimit_s(spec.limits),
        seccomp_fd,
        is_idle=False,
    )


def build_warm_command(
    config: ProcessSandboxConfig,
    program_dir: Path,
    uid: int,
    cgroup_procs: list[Path],
    has_memory_cgroup: bool,
    seccomp_fd: int,
) -> list[str]:
    """The chain for a warm sandbox: the zygote instead of a program, the pool's ceilings as limits,
    `program_dir` (empty until a launch) bound read-only where the program goes, and SCHED_IDLE.
    `cgroup_procs` comes from `warm_cgroup_joins`."""
    limits = config.warm_max_limits
    return _chain(
        config,
        limits,
        [(ZYGOTE_PATH, SANDBOX_ZYGOTE), (program_dir, SANDBOX_PROGRAM_DIR)],
        config.warm_socket_dir,
        base_sandbox_env(),
        [SANDBOX_ZYGOTE, *config.warm_modules],
        uid,
        cgroup_procs,
        has_memory_cgroup,
        cpu_rlimit_s(limits) + WARM_UP_CPU_S,
        seccomp_fd,
        is_idle=True,
    )


def warm_cgroup_joins(cgroup: InstanceCgroup | None, idle_cpu_group: Path | None) -> list[Path]:
    """The cgroup.procs files a warm sandbox's shell joins: its own groups but the cpu one (joined at
    the hand-off; with cpuacct co-mounted, accounting starts there too), then the idle cpu group, only
    when the hand-off has a cpu group to move it out to. The idle group comes last because every
    cgroup.procs write takes a lock that forks across the host wait on, and the shell must not hold it
    at idle priority."""
    joins = cgroup.procs_files(defer_cpu=True) if cgroup is not None else []
    if cgroup is not None and "cpu" in cgroup.dirs and idle_cpu_group is not None:
        joins.append(idle_cpu_group / "cgroup.procs")
    return joins


def _chain(
    config: ProcessSandboxConfig,
    limits: Limits,
    program_binds: list[tuple[Path, str]],
    socket_dir: Path | None,
    env: dict[str, str],
    python_argv: list[str],
    uid: int,
    cgroup_procs: list[Path],
    has_memory_cgroup: bool,
    cpu_soft_s: int,
    seccomp_fd: int,
    *,
    is_idle: bool,
) -> list[str]:
    python_binds, python_exe = _python_layout(config)
    ro_binds = [*python_binds, (config.sdk_path, SANDBOX_SDK_DIR), *program_binds]
    if socket_dir is not None:
        ro_binds.append((socket_dir, SANDBOX_SOCKET_DIR))

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
    # The filter (seccomp.py) binds every process the sandbox runs, from setpriv on.
    bwrap += ["--chdir", "/tmp", "--clearenv", "--seccomp", str(seccomp_fd)]
    for key, value in env.items():
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
        *python_argv,
    ]

    prlimit = ["prlimit", f"--cpu={cpu_soft_s}:{cpu_soft_s + 1}"]
    for name, (soft, hard) in rlimits(limits, has_memory_cgroup).items():
        prlimit.append(f"--{_PRLIMIT_FLAGS[name]}={soft}:{hard}")
    prlimit.append("--")

    join = "".join(f"echo $$ > {shlex.quote(str(path))} || exit 125; " for path in cgroup_procs)
    # After the joins, not before: the shell writes cgroup.procs at normal priority (see warm_cgroup_joins).
    idle = ["chrt", "--idle", "0"] if is_idle else []
    return ["/bin/sh", "-c", join + 'exec "$@"', "l4m-sandbox", *idle, *prlimit, *bwrap, *setpriv]


_PRLIMIT_FLAGS = {
    "RLIMIT_NOFILE": "nofile",
    "RLIMIT_NPROC": "nproc",
    "RLIMIT_FSIZE": "fsize",
    "RLIMIT_CORE": "core",
    "RLIMIT_AS": "as",
}


def rlimits(limits: Limits, has_memory_cgroup: bool) -> dict[str, tuple[int, int]]:
    """(soft, hard) per rlimit other than CPU, the same for a cold start (prlimit) and a warm one (the
    zygote lowers its own to these)."""
    values = {
        "RLIMIT_NOFILE": (limits.max_open_files, limits.max_open_files),
        "RLIMIT_NPROC": (limits.max_processes, limits.max_processes),
        "RLIMIT_FSIZE": (limits.tmp_bytes, limits.tmp_bytes),
        "RLIMIT_CORE": (0, 0),
    }
    if not has_memory_cgroup:
        values["RLIMIT_AS"] = (limits.memory_bytes, limits.memory_bytes)
    return values


def warm_refusal(config: ProcessSandboxConfig, spec: SandboxSpec) -> str:
    """Why a warm sandbox cannot run `spec` exactly as a cold start would; empty when it can."""
    ceiling, limits = config.warm_max_limits, spec.limits
    if spec.socket_dir != config.warm_socket_dir:
        return f"its socket directory is not the pool's ({config.warm_socket_dir})"
    if limits.tmp_bytes != ceiling.tmp_bytes:
        return f"its /tmp size is not the pool's ({ceiling.tmp_bytes} bytes)"
    for name in ("cpu_time_s", "memory_bytes", "max_processes", "max_open_files"):
        if getattr(limits, name) > getattr(ceiling, name):
            return f"its {name} is above the pool's ceiling ({getattr(ceiling, name)})"
    # Read when the interpreter starts or the SDK is imported: too late to change in a warm sandbox.
    late = sorted(key for key in spec.env if key.startswith("PYTHON") or key in SANDBOX_THREAD_ENV)
    if late:
        return f"its environment sets {', '.join(late)}"
    return ""


def warm_launch(spec: SandboxSpec, has_memory_cgroup: bool) -> dict[str, object]:
    """What the zygote reads on stdin to become `spec`'s instance (see zygote.read_launch)."""
    return {
        "program": f"{SANDBOX_PROGRAM_DIR}/{program_file_name(spec.program_path)}",
        "args": list(spec.args),
        "env": instance_env(spec),
        "runner": spec.runner_module,
        "cpu_time_s": cpu_rlimit_s(spec.limits),
        "rlimits": rlimits(spec.limits, has_memory_cgroup),
    }


@dataclass
class WarmSandbox:
    """A started sandbox in the warm pool, waiting for the one launch it will serve."""

    process: asyncio.subprocess.Process
    cgroup: InstanceCgroup | None
    uid: int
    program_dir: Path  # host side of /opt/l4m/program

    def is_alive(self) -> bool:
        return self.process.returncode is None


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
        self._uids = UidPool(self.config.uid_base, self.config.num_uids, self.config.uid_lock_dir)
        self._pool: WarmPool[WarmSandbox] | None = None
        self._warm_dir: Path | None = None  # the open pool's
        self._temp_warm_dirs: set[Path] = set()  # made by `open`, removed once empty and closed

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
            "syscalls": "seccomp filter (bwrap --seccomp: no namespaces, mount, ptrace, bpf, keyctl...) "
            "+ no_new_privs + no capabilities",
        }

    async def cleanup_orphans(self) -> int:
        # Sandboxes die with the spawner (--die-with-parent); only their cgroups (cold and warm alike)
        # and warm sandboxes' program directories can be left.
        if self.config.warm_dir is not None and self.config.warm_dir.is_dir():
            for orphan in self.config.warm_dir.iterdir():
                await asyncio.to_thread(shutil.rmtree, orphan, True)
        if self._cgroups is None:
            return 0
        return await asyncio.to_thread(self._cgroups.cleanup_orphans)

    async def open(self) -> None:
        """Starts filling the warm pool (when it has a size) on the running loop, which must be the one
        that launches. Call it after `cleanup_orphans`, which would take warm sandboxes for orphans."""
        if self.config.warm_pool_size <= 0 or self._pool is not None:
            return
        if self.config.warm_dir is not None:
            self.config.warm_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._warm_dir = self.config.warm_dir
        else:
            self._warm_dir = Path(tempfile.mkdtemp(prefix=f"l4m-warm-{self.config.spawner_id}-"))
            self._temp_warm_dirs.add(self._warm_dir)
        self._pool = WarmPool(
            self.config.warm_pool_size, self._start_warm, self._destroy_warm, WarmSandbox.is_alive
        )
        self._pool.open()

    async def close(self) -> None:
        """Destroys every warm sandbox not handed to a launch; running instances are not touched.
        `open` may be called again afterwards (on another loop)."""
        if self._pool is None:
            return
        pool, self._pool = self._pool, None
        await pool.close()
        # A temporary directory still holding a running instance's program goes when it ends (_release).
        self._warm_dir = None
        for directory in list(self._temp_warm_dirs):
            self._remove_temp_warm_dir(directory)

    def remove_cgroup_parents(self) -> None:
        """Forgets this spawner id's cgroup parents once every instance has ended."""
        if self._cgroups is not None:
            self._cgroups.remove_parents()

    def warm_pool_stats(self) -> WarmPoolStats | None:
        return self._pool.stats() if self._pool is not None else None

    async def wait_warm_pool_full(self) -> None:
        """Returns once the warm pool holds its size of ready sandboxes (bound it with a timeout)."""
        if self._pool is not None:
            await self._pool.wait_full()

    async def start(self, spec: SandboxSpec) -> SandboxHandle:
        if not _INSTANCE_ID_RE.match(spec.instance_id):
            raise SandboxError(f"invalid instance id {spec.instance_id!r}")
        if not spec.program_path.is_file():
            raise SandboxError(f"program file {spec.program_path} does not exist")
        warm = self._pool.take() if self._pool is not None and not warm_refusal(self.config, spec) else None
        if warm is not None:
            try:
                return await self._hand_off(warm, spec)
            except Exception as exc:  # noqa: BLE001 - logged; the launch starts cold instead
                log.warning("warm hand-off of %s failed, starting it cold: %s", spec.instance_id, exc)
                await self._destroy_warm(warm)
        return await self._start_cold(spec)

    async def _start_cold(self, spec: SandboxSpec) -> ProcessHandle:
        uid = self._uids.acquire()
        cgroup: InstanceCgroup | None = None
        try:
            if self._cgroups is not None:
                cgroup = self._cgroups.create(spec.instance_id, spec.limits)
            procs = cgroup.procs_files() if cgroup else []
            has_memory = cgroup is not None and "memory" in cgroup.dirs
            process = await _spawn_chain(
                lambda fd: build_command(self.config, spec, uid, procs, has_memory, fd),
                stdin=asyncio.subprocess.DEVNULL,
            )
        except BaseException:
            if cgroup is not None:
                cgroup.remove()
            self._uids.release(uid)
            raise
        return ProcessHandle(spec, process, cgroup, lambda: self._uids.release(uid))

    # -- the warm pool ---------------------------------------------------------------------------

    async def _start_warm(self) -> WarmSandbox:
        """Starts one warm sandbox and waits for its READY line; leaves nothing behind if that fails
        or is cancelled."""
        assert self._warm_dir is not None
        name = f"warm-{uuid.uuid4().hex[:16]}"
        uid = self._uids.acquire()
        cgroup: InstanceCgroup | None = None
        program_dir = self._warm_dir / name
        process: asyncio.subprocess.Process | None = None
        try:
            program_dir.mkdir(mode=0o755)
            if self._cgroups is not None:
                cgroup = self._cgroups.create(name, self.config.warm_max_limits)
            idle_cpu_group = self._cgroups.idle_cpu_group if self._cgroups is not None else None
            procs = warm_cgroup_joins(cgroup, idle_cpu_group)
            has_memory = cgroup is not None and "memory" in cgroup.dirs
            process = await _spawn_chain(
                lambda fd: build_warm_command(self.config, program_dir, uid, procs, has_memory, fd),
                stdin=asyncio.subprocess.PIPE,
            )
            warm = WarmSandbox(process, cgroup, uid, program_dir)
            line = await self._read_ready(warm)
            if line != zygote.READY_LINE:
                raise SandboxError(f"a warm sandbox did not start: {await _stderr_tail(process)}")
            return warm
        except BaseException:
            if process is not None:
                await self._destroy_warm(WarmSandbox(process, cgroup, uid, program_dir))
            else:
                if cgroup is not None:
                    await asyncio.to_thread(cgroup.remove)
                self._release(uid, program_dir)
            raise

    async def _read_ready(self, warm: WarmSandbox) -> bytes:
        """The warm sandbox's first line, or SandboxError once it has spent WARM_START_TIMEOUT_S
        without it while not waiting for a CPU."""
        reading = asyncio.ensure_future(warm.process.stdout.readline())
        clock = StartClock(time.monotonic())
        try:
            while not reading.done():
                await asyncio.wait((reading,), timeout=READY_POLL_S)
                if reading.done():
                    break
                delays_ns = await asyncio.to_thread(lambda: run_delays_ns(self._sandbox_pids(warm)))
                if clock.advance(time.monotonic(), delays_ns) > WARM_START_TIMEOUT_S:
                    raise SandboxError(
                        f"a warm sandbox was not ready after {WARM_START_TIMEOUT_S:.0f} s of not waiting "
                        f"for a CPU: {await _stderr_tail(warm.process)}"
                    )
            return reading.result()
        finally:
            reading.cancel()

    def _sandbox_pids(self, warm: WarmSandbox) -> set[int]:
        """Host pids of every process of the sandbox: from a group it joined as it started (exact, and
        cheap), else from the process tree under its first process."""
        if warm.cgroup is not None and warm.cgroup.procs_files(defer_cpu=True):
            return warm.cgroup.pids(defer_cpu=True)
        return sandbox_tree(warm.process.pid)

    def _promote(self, warm: WarmSandbox) -> None:
        """Gives a warm sandbox what a cold start runs under: its own cpu cgroup (CPU bandwidth limit,
        accounting with cpuacct co-mounted) and, for every thread, the spawner's policy and nice value
        (SCHED_OTHER). Raises when any of it fails: the launch must then start cold, never idle."""
        joined: set[int] = set()

        def list_and_join() -> set[int]:
            pids = self._sandbox_pids(warm)
            if not pids:
                raise SandboxError("the warm sandbox has no process left")
            if warm.cgroup is not None and "cpu" in warm.cgroup.dirs:
                warm.cgroup.join_cpu(pids - joined)
                joined.update(pids)
            return pids

        set_normal_priority(list_and_join, os.getpriority(os.PRIO_PROCESS, 0))

    async def _hand_off(self, warm: WarmSandbox, spec: SandboxSpec) -> ProcessHandle:
        """Turns a warm sandbox into `spec`'s instance: its limits, its program, its CPU priority, then
        GO."""
        if not warm.is_alive():
            raise SandboxError("the warm sandbox died before its launch")
        if warm.cgroup is not None and self._cgroups is not None:
            self._cgroups.apply_limits(warm.cgroup, spec.limits)
        program = warm.program_dir / program_file_name(spec.program_path)
        shutil.copyfile(spec.program_path, program)
        os.chmod(program, 0o644)
        await asyncio.to_thread(self._promote, warm)
        has_memory = warm.cgroup is not None and "memory" in warm.cgroup.dirs
        stdin = warm.process.stdin
        stdin.write(json.dumps(warm_launch(spec, has_memory)).encode())
        await stdin.drain()
        stdin.close()
        async with asyncio.timeout(HANDOFF_TIMEOUT_S):
            line = await warm.process.stdout.readline()
        if line != zygote.GO_LINE:
            raise SandboxError(f"the warm sandbox refused the launch: {await _stderr_tail(warm.process)}")
        # What the group counted before GO is not the launch's: the imports, or with cpu and cpuacct
        # co-mounted (a group joined only at the promotion), the hand-off alone.
        baseline_s = (warm.cgroup.cpu_time_s() if warm.cgroup else None) or 0.0
        return ProcessHandle(
            spec,
            warm.process,
            warm.cgroup,
            lambda: self._release(warm.uid, warm.program_dir),
            cpu_baseline_s=baseline_s,
            is_warm=True,
        )

    async def _destroy_warm(self, warm: WarmSandbox) -> None:
        # The cgroup first: it holds every process of the sandbox, also one that bwrap forked before
        # its --die-with-parent took effect (a sandbox destroyed while it starts).
        if warm.cgroup is not None:
            await asyncio.to_thread(warm.cgroup.kill_all)
        with contextlib.suppress(ProcessLookupError):
            warm.process.kill()
        if warm.process.stdin is not None:
            warm.process.stdin.close()
        await warm.process.wait()
        if warm.cgroup is not None:
            await asyncio.to_thread(warm.cgroup.remove)
        self._release(warm.uid, warm.program_dir)

    def _release(self, uid: int, program_dir: Path | None = None) -> None:
        if program_dir is not None:
            shutil.rmtree(program_dir, ignore_errors=True)
            if program_dir.parent in self._temp_warm_dirs and program_dir.parent != self._warm_dir:
                self._remove_temp_warm_dir(program_dir.parent)
        self._uids.release(uid)

    def _remove_temp_warm_dir(self, directory: Path) -> None:
        with contextlib.suppress(OSError):
            directory.rmdir()  # only once empty
            self._temp_warm_dirs.discard(directory)


async def _spawn_chain(command: Callable[[int], list[str]], stdin: int) -> asyncio.subprocess.Process:
    """Starts `command(fd)`, a chain whose bwrap reads the seccomp filter from `fd`: a pipe of its own
    that only the chain inherits."""
    fd = seccomp.filter_fd()
    try:
        return await asyncio.create_subprocess_exec(
            *command(fd),
            stdin=stdin,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            pass_fds=(fd,),
        )
    finally:
        os.close(fd)


async def _stderr_tail(process: asyncio.subprocess.Process) -> str:
    """The end of what a failed sandbox wrote on stderr, after making sure it ended."""
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    try:
        data = await asyncio.wait_for(process.stderr.read(), 5.0)
    except TimeoutError:
        data = b""
    tail = data[-_STDERR_TAIL_BYTES:].decode(errors="replace").strip()
    return tail or f"it exited with status {await process.wait()}"


class ProcessHandle(SandboxHandle):
    def __init__(
        self,
        spec: SandboxSpec,
        process: asyncio.subprocess.Process,
        cgroup: InstanceCgroup | None,
        release: Callable[[], None],
        *,
        cpu_baseline_s: float = 0.0,
        is_warm: bool = False,
    ) -> None:
        self.instance_id = spec.instance_id
        self.is_warm = is_warm
        self._limits: Limits = spec.limits
        self._process = process
        self._cgroup = cgroup
        self._release = release
        # A warm sandbox's cgroup counted its imports before the launch; the launch is not charged.
        self._cpu_baseline_s = cpu_baseline_s
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
        used = self._cgroup.cpu_time_s() if self._cgroup else None
        return max(0.0, used - self._cpu_baseline_s) if used is not None else None

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
                cpu_time_s=self.cpu_time_s(),
                stderr_tail=bytes(self._stderr_tail),
                memory_mechanism="cgroup memory" if cgroup and "memory" in cgroup.dirs else "rlimit as",
                pids_mechanism="cgroup pids" if cgroup and "pids" in cgroup.dirs else "rlimit nproc",
            )
            return derive_exit_info(facts)
        finally:
            if self._cgroup is not None:
                await asyncio.to_thread(self._cgroup.remove)
            self._release()
