"""The process sandbox's command line, as pure functions of its configuration and a launch.

The chain started for one instance, each step exec'ing the next:

    sh      joins the instance's cgroups (writes its pid into each cgroup.procs)
    chrt    the launch's CPU policy (`--batch 0` by default, `--other 0` for "normal": config.cpu_policy);
            a warm sandbox's `--idle 0` instead, SCHED_IDLE until its launch (see process_sandbox.py)
    prlimit sets RLIMIT_CPU, NOFILE, NPROC, FSIZE, CORE (and AS where there is no memory cgroup)
    bwrap   as root: new mount/pid/net/ipc/uts/cgroup namespaces; binds only /usr, the Python
            installation, the venv, the SDK, the program and the socket directory, all read-only;
            mounts no /proc (its mount table would name every bind's host path);
            sets no_new_privs and installs the seccomp filter (seccomp.py: no new namespaces, mount,
            ptrace, bpf, keyctl, perf...), read from a pipe only this chain inherits
    setpriv drops to a uid/gid of its own (one per live instance, from a range this spawner holds
            alone on the host: `process_sandbox.UidPool`), no groups, no capabilities (bounding set
            cleared), no_new_privs
    python  `-m l4m.controller PROGRAM ARGS` (the SDK's runner; spec.runner_module), or the program

bwrap runs as root rather than behind setpriv because the Python installation lives under /root
(mode 0700): an unprivileged bwrap cannot even name it as a bind source. The program itself still
runs as a host uid that owns nothing, so a bind that shows too much is still guarded by file
permissions. A uid per instance keeps RLIMIT_NPROC (counted per uid across the host) per instance.

Everything here is a function of plain values (the config, the launch's spec, a uid, cgroup files, a
file descriptor number): what runs it, waits for it and kills it is process_sandbox.py.
"""

from __future__ import annotations

import math
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

import l4m
from l4m.spawner import zygote
from l4m.spawner.sandbox import (
    DEFAULT_CPU_POLICY,
    SANDBOX_PROGRAM_DIR,
    SANDBOX_SDK_DIR,
    SANDBOX_SOCKET_DIR,
    SANDBOX_THREAD_ENV,
    Limits,
    SandboxSpec,
    check_cpu_policy,
    program_file_name,
)

if TYPE_CHECKING:
    from l4m.spawner.cgroups import InstanceCgroup

SANDBOX_VENV_DIR = "/opt/l4m/venv"
SANDBOX_ZYGOTE = "/opt/l4m/zygote/zygote.py"
ZYGOTE_PATH = Path(zygote.__file__).resolve()
# What a warm sandbox imports before it waits: the SDK a controller uses (the runner comes first) and
# the runner's event loop (l4m.eventloop imports uvloop only when it runs: ~8 ms of CPU per launch). A
# context's modules, which a cold runner leaves to the first context, come right after the runner: in
# that order a warm sandbox holds 0.8 MiB less than with them after numpy (docs/benchmarks.md).
SDK_WARM_MODULES = ("l4m.controller", "l4m.context", "l4m.wire.brle", "l4m.constraint", "l4m.search", "l4m.drafter",
                    "tokenizers", "uvloop")
# CPU seconds a warm sandbox may use before its launch (the imports take well under one); the launch
# then gets its own limit on top of what was used (see zygote.lower_rlimits).
WARM_UP_CPU_S = 30
# Where every spawner on this host claims its range of sandbox uids (see `UidPool`).
UID_LOCK_DIR = Path("/run/l4m-sandbox-uids")


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
    # The most a round of the pool's refill waits for the host to have a core to spare (host_load.py);
    # 0: refill at once.
    warm_pool_quiet_wait_s: float = 0.0
    # Ceilings a warm sandbox starts under; a launch above one starts cold. tmp_bytes must match exactly
    # (the size of /tmp is fixed when the sandbox starts).
    warm_max_limits: Limits = field(default_factory=Limits)
    warm_socket_dir: Path | None = None  # bound at /run/l4m in warm sandboxes
    warm_modules: tuple[str, ...] = SDK_WARM_MODULES
    # Holds one directory per warm sandbox (the program is copied into it); None: a private temporary
    # directory made by `open`. Its contents are orphans after a crash.
    warm_dir: Path | None = None
    # A launch's CPU scheduling policy, a name in sandbox.CPU_POLICIES: a cold start's chain sets it
    # (chrt), a warm sandbox's hand-off sets it on every thread.
    cpu_policy: str = DEFAULT_CPU_POLICY

    def __post_init__(self) -> None:
        check_cpu_policy(self.cpu_policy)


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
    """The whole sh → chrt → prlimit → bwrap → setpriv → python command line for one instance; bwrap reads
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
    chrt = ["chrt", "--idle" if is_idle else _CHRT_FLAGS[config.cpu_policy], "0"]
    return ["/bin/sh", "-c", join + 'exec "$@"', "l4m-sandbox", *chrt, *prlimit, *bwrap, *setpriv]


_CHRT_FLAGS = {"normal": "--other", "batch": "--batch"}  # per name in sandbox.CPU_POLICIES


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
