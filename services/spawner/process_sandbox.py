"""The process backend: each instance runs under bubblewrap as its own unprivileged uid.

What runs is a chain of sh, prlimit, bwrap, setpriv and python, each exec'ing the next; its command
line, environment and rlimits are built in process_command.py (its docstring walks through the chain).
This module starts the chain, reads its output, waits for it and kills it, and hands out the uids
(`UidPool`). Because the sandbox has its own PID namespace, the instance's death (or bwrap's, thanks
to `--die-with-parent`) takes every process it started with it.

**Warm pool** (`warm_pool_size` > 0): most of a launch's time is Python importing the SDK, so the
backend keeps that many sandboxes started ahead of demand, built by the same chain but running
`zygote.py` (which imports the SDK and waits on stdin) under a uid, cgroups and rlimits of their own
set at the pool's ceilings (`warm_max_limits`), with an empty directory of their own bound read-only
at /opt/l4m/program and the pool's socket directory at /run/l4m. A launch takes one (`WarmSandbox`)
and, before any of its code runs: the spawner writes the launch's limits into the sandbox's cgroups
and copies the program into that directory; the zygote lowers its rlimits to the launch's, takes its
environment (token, TRACEPARENT...) and arguments, and runs it in place. A warm sandbox serves one
launch and ends with it; the pool refills behind it. A launch the pool cannot serve the same way a
cold start would (`process_command.warm_refusal`: another socket directory or /tmp size, a limit above the pool's
ceilings, interpreter variables in its environment) starts cold, as does any launch while the pool
is empty or when a hand-off fails.

A warm sandbox starts at idle CPU priority, since it is work done ahead of demand: its chain runs
under SCHED_IDLE, and instead of its own cpu cgroup it joins the spawner's idle one (cgroups.py,
`cpu.idle` = 1). Both are needed: CFS weighs a group as one entity among its siblings, so SCHED_IDLE
tasks inside an ordinary group (their own cpu cgroup, or the session autogroup bubblewrap's
`--new-session` gives them) would still get that group's full share. The hand-off, before the launch
is written, moves every process of the sandbox into its own cpu cgroup (the CPU bandwidth limit a
cold start runs under) and sets every thread to the launch's policy (`cpu_policy`, SCHED_BATCH by
default) at the spawner's nice value, as a cold start runs; if that fails, the launch starts cold. A start waiting for an idle CPU is not broken: its timeout
(`WARM_START_TIMEOUT_S`) counts only the time it was not waiting for one (`cpu_priority.StartClock`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import json
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from l4m.spawner import seccomp, zygote
from l4m.spawner.cgroups import CgroupManager, InstanceCgroup
from l4m.spawner.cpu_priority import StartClock, run_delays_ns, sandbox_tree, set_launch_priority
from l4m.spawner.host_load import wait_for_idle_core
from l4m.spawner.process_command import (
    UID_LOCK_DIR,
    ProcessSandboxConfig,
    build_command,
    build_warm_command,
    warm_cgroup_joins,
    warm_launch,
    warm_refusal,
)
from l4m.spawner.sandbox import (
    CPU_POLICIES,
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

# From start to READY, not counting time spent waiting for a CPU (a start runs at idle priority, so on
# a busy machine it waits as long as the machine stays busy): only a stuck start reaches it.
WARM_START_TIMEOUT_S = 120.0
READY_POLL_S = 1.0  # how often a start's clock is advanced
HANDOFF_TIMEOUT_S = 10.0  # from writing the launch to GO
_INSTANCE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_READ_CHUNK_BYTES = 64 * 1024
_STDERR_TAIL_BYTES = 8 * 1024
_REQUIRED_TOOLS = ("bwrap", "setpriv", "prlimit", "chrt")
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

    @property
    def cgroup_parents(self) -> dict[str, Path]:
        """Controller -> the directory its instance groups are made in (one for all on cgroup v2)."""
        return dict(self._cgroups.available) if self._cgroups else {}

    def enforcement(self) -> dict[str, str]:
        controllers = self.cgroup_controllers

        def cgroup(controller: str, v1: str, v2: str) -> str:
            return v2 if self._cgroups is not None and self._cgroups.is_v2(controller) else v1

        cpu_time = cgroup("cpuacct", "cgroup cpuacct", "cgroup v2 cpu.stat")
        pids = cgroup("pids", "cgroup pids", "cgroup v2 pids.max")
        return {
            "wall_time_s": "spawner timer",
            "cpu_time_s": "rlimit cpu (per process: SIGXCPU, then SIGKILL)"
            + (f" + {cpu_time} polled by the spawner (whole sandbox)" if "cpuacct" in controllers else ""),
            "memory_bytes": cgroup("memory", "cgroup memory (OOM kill)", "cgroup v2 memory.max (OOM kill)")
            if "memory" in controllers
            else "rlimit as (MemoryError)",
            "max_processes": (f"{pids} + " if "pids" in controllers else "")
            + "rlimit nproc (per-instance uid)",
            "max_open_files": "rlimit nofile",
            "max_output_bytes": "spawner pipe counter",
            "cpu_cores": cgroup("cpu", "cgroup cpu cfs quota", "cgroup v2 cpu.max")
            if "cpu" in controllers
            else "not enforced",
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
        quiet_wait_s = self.config.warm_pool_quiet_wait_s
        self._pool = WarmPool(
            self.config.warm_pool_size, self._start_warm, self._destroy_warm, WarmSandbox.is_alive,
            wait_quiet=functools.partial(wait_for_idle_core, quiet_wait_s) if quiet_wait_s > 0 else None,
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
        if self._pool is not None and not warm_refusal(self.config, spec):
            # The pool refills once no hand-over is under way: a burst is served before its refill.
            with self._pool.taking() as warm:
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
        return ProcessHandle(spec, process, cgroup, functools.partial(self._release, uid))

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
                cgroup = self._cgroups.create(name, self.config.warm_max_limits, idle=True)
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
                await self._release(uid, program_dir)
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
        accounting with cpuacct co-mounted) and, for every thread, the launch's policy (`cpu_policy`) at
        the spawner's nice value. Raises when any of it fails: the launch must then start cold, never
        idle."""
        joined: set[int] = set()

        def list_and_join() -> set[int]:
            pids = self._sandbox_pids(warm)
            if not pids:
                raise SandboxError("the warm sandbox has no process left")
            if warm.cgroup is not None and "cpu" in warm.cgroup.dirs:
                warm.cgroup.join_cpu(pids - joined)
                joined.update(pids)
            return pids

        policy = CPU_POLICIES[self.config.cpu_policy]
        set_launch_priority(list_and_join, policy, os.getpriority(os.PRIO_PROCESS, 0))

    def _prepare_hand_off(self, warm: WarmSandbox, spec: SandboxSpec) -> None:
        """The launch's limits in the sandbox's cgroups, its program in the sandbox's program directory,
        and the sandbox promoted to normal CPU priority: everything before the launch is written."""
        if warm.cgroup is not None and self._cgroups is not None:
            self._cgroups.apply_limits(warm.cgroup, spec.limits)
        program = warm.program_dir / program_file_name(spec.program_path)
        shutil.copyfile(spec.program_path, program)
        os.chmod(program, 0o644)
        self._promote(warm)

    async def _hand_off(self, warm: WarmSandbox, spec: SandboxSpec) -> ProcessHandle:
        """Turns a warm sandbox into `spec`'s instance: its limits, its program, its CPU priority, then
        GO."""
        if not warm.is_alive():
            raise SandboxError("the warm sandbox died before its launch")
        # One worker thread does the file work: cgroup writes wait on the kernel's cgroup locks, which a
        # burst of hand-overs and exits contends for, and must not hold up the event loop meanwhile.
        await asyncio.to_thread(self._prepare_hand_off, warm, spec)
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
            functools.partial(self._release, warm.uid, warm.program_dir),
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
        await self._release(warm.uid, warm.program_dir)

    async def _release(self, uid: int, program_dir: Path | None = None) -> None:
        """Frees what a sandbox held once none of its processes is left: its uid, and a warm sandbox's
        program directory, removed in a worker thread (it was a bind source of the sandbox's mount
        namespace, whose teardown the removal can wait on)."""
        try:
            if program_dir is not None:
                await asyncio.to_thread(shutil.rmtree, program_dir, ignore_errors=True)
                if program_dir.parent in self._temp_warm_dirs and program_dir.parent != self._warm_dir:
                    self._remove_temp_warm_dir(program_dir.parent)
        finally:
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
        release: Callable[[], Awaitable[None]],
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
            # In a worker thread: cgroup reads wait on the kernel's cgroup locks in a burst of exits.
            oom_kills, limit_hits, pids_refused, cpu_time_s = await asyncio.to_thread(self._exit_counters)
            facts = ExitFacts(
                limits=self._limits,
                exit_code=exit_code,
                signal=signal,
                kill_reason=self._kill_reason,
                kill_message=self._kill_message,
                memory_oom_kills=oom_kills,
                memory_limit_hits=limit_hits,
                pids_refused=pids_refused,
                cpu_time_s=cpu_time_s,
                stderr_tail=bytes(self._stderr_tail),
                memory_mechanism="cgroup memory" if cgroup and "memory" in cgroup.dirs else "rlimit as",
                pids_mechanism="cgroup pids" if cgroup and "pids" in cgroup.dirs else "rlimit nproc",
            )
            return derive_exit_info(facts)
        finally:
            if self._cgroup is not None:
                await asyncio.to_thread(self._cgroup.remove)
            await self._release()

    def _exit_counters(self) -> tuple[int | None, int | None, int | None, float | None]:
        """The cgroups' counts of OOM kills, refused memory charges and refused forks, and the CPU time."""
        cgroup = self._cgroup
        if cgroup is None:
            return None, None, None, None
        return cgroup.memory_oom_kills(), cgroup.memory_limit_hits(), cgroup.pids_refused(), self.cpu_time_s()
