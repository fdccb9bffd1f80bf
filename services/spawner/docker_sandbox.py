"""The docker backend: each instance is a container with the same limits as the process sandbox.

No network (`network_mode="none"`), a read-only root with a private /tmp tmpfs, no capabilities,
no-new-privileges, the engine's default seccomp profile with l4m's own filter (seccomp.py) stacked on
it, uid 65534, memory/pids/CPU limits from the engine's cgroups, per-process CPU time and open files as ulimits. The program and the socket directory are bind-mounted read-only. tini
(`init=True`) is PID 1, so the program gets ordinary signal semantics (SIGXCPU at the CPU limit) and
its status comes back as "128 + signal". Containers carry `l4m.spawner` and `l4m.instance` labels so
a restarted spawner removes what its previous run left. The docker SDK is blocking: every call runs
in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from l4m.spawner import seccomp
from l4m.spawner.cgroups import stat_field
from l4m.spawner.sandbox import (
    CPU_POLICIES,
    DEFAULT_CPU_POLICY,
    SANDBOX_PROGRAM_DIR,
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
    check_cpu_policy,
    derive_exit_info,
    program_file_name,
    split_wait_status,
)

LABEL_SPAWNER = "l4m.spawner"
LABEL_INSTANCE = "l4m.instance"
_STDERR_TAIL_BYTES = 8 * 1024


@dataclass(frozen=True)
class DockerSandboxConfig:
    image: str  # see docker_image.ensure_controller_image
    spawner_id: str = "default"
    user: str = "65534:65534"
    docker_base_url: str | None = None  # None: DOCKER_HOST or the default socket
    cgroup_root: Path = Path("/sys/fs/cgroup")  # where the engine's cgroupfs groups can be read
    cpu_policy: str = DEFAULT_CPU_POLICY  # the controller's CPU policy, a name in sandbox.CPU_POLICIES

    def __post_init__(self) -> None:
        check_cpu_policy(self.cpu_policy)


def container_options(config: DockerSandboxConfig, spec: SandboxSpec) -> dict[str, Any]:
    """Keyword arguments for `containers.create`: the whole security and limits policy."""
    from docker.types import Mount, Ulimit

    limits: Limits = spec.limits
    program_dest = f"{SANDBOX_PROGRAM_DIR}/{program_file_name(spec.program_path)}"
    mounts = [Mount(program_dest, str(spec.program_path), type="bind", read_only=True)]
    if spec.socket_dir is not None:
        mounts.append(Mount(SANDBOX_SOCKET_DIR, str(spec.socket_dir), type="bind", read_only=True))
    cpu_soft = max(1, int(limits.cpu_time_s + 0.999))
    env = {"L4M_INSTANCE_ID": spec.instance_id, "HOME": "/tmp", **SANDBOX_THREAD_ENV, **spec.env}
    return {
        "image": config.image,
        # Under l4m's filter too (seccomp.py), stacked on the engine's default profile: that profile
        # allows ptrace and process_vm_* within the container, the filter does not. The CPU policy is
        # set right before the filter, which denies changing it.
        "command": [
            *seccomp.install_and_exec_argv(CPU_POLICIES[config.cpu_policy]),
            "python3",
            *spec.python_argv(program_dest),
        ],
        "name": f"l4m-{config.spawner_id}-{spec.instance_id}",
        "labels": {LABEL_SPAWNER: config.spawner_id, LABEL_INSTANCE: spec.instance_id},
        "environment": env,
        "user": config.user,
        "working_dir": "/tmp",
        "hostname": "sandbox",
        "network_mode": "none",
        "read_only": True,
        "cap_drop": ["ALL"],
        # No seccomp option: the engine's default profile applies (never "seccomp=unconfined"); with
        # no capability it refuses unshare/clone of namespaces, mount, bpf, keyctl, perf_event_open...
        "security_opt": ["no-new-privileges:true"],
        "init": True,
        "mem_limit": limits.memory_bytes,
        "memswap_limit": limits.memory_bytes,
        "pids_limit": limits.max_processes,
        "nano_cpus": int(limits.cpu_cores * 1e9) if limits.cpu_cores > 0 else 0,
        "ulimits": [
            Ulimit(name="cpu", soft=cpu_soft, hard=cpu_soft + 1),
            Ulimit(name="nofile", soft=limits.max_open_files, hard=limits.max_open_files),
            Ulimit(name="fsize", soft=limits.tmp_bytes, hard=limits.tmp_bytes),
            Ulimit(name="core", soft=0, hard=0),
        ],
        "tmpfs": {"/tmp": f"size={limits.tmp_bytes},mode=1777"},
        "mounts": mounts,
        # Output is streamed to the spawner through attach; the engine keeps no copy of it.
        "log_config": {"type": "none", "config": {}},
        "stdin_open": False,
        "tty": False,
        "detach": True,
    }


def seccomp_refusal(security_options: list[str]) -> str:
    """Why an engine reporting `security_options` (`docker info`) cannot run controllers; empty when
    it can: containers must get a seccomp profile, and the default one is what they ask for."""
    seccomp = [option for option in security_options if "name=seccomp" in option.split(",")]
    if not seccomp:
        return "the Docker engine applies no seccomp profile: it cannot run controllers"
    if "profile=unconfined" in seccomp[0].split(","):
        return "the Docker engine's default seccomp profile is 'unconfined': it cannot run controllers"
    return ""


class DockerSandbox(Sandbox):
    kind = "docker"

    def __init__(self, config: DockerSandboxConfig) -> None:
        import docker.errors

        import docker

        self.config = config
        try:
            self._client = (
                docker.DockerClient(base_url=config.docker_base_url)
                if config.docker_base_url
                else docker.from_env()
            )
            self._client.ping()
            security_options = self._client.info().get("SecurityOptions") or []
        except (docker.errors.DockerException, OSError) as exc:
            raise SandboxError(f"the docker sandbox cannot reach a Docker engine: {exc}") from exc
        refusal = seccomp_refusal(security_options)
        if refusal:
            raise SandboxError(refusal)

    def enforcement(self) -> dict[str, str]:
        return {
            "wall_time_s": "spawner timer",
            "cpu_time_s": "ulimit cpu (per process: SIGXCPU) + engine cgroup cpuacct polled by the spawner",
            "memory_bytes": "engine cgroup memory (mem_limit, OOMKilled)",
            "max_processes": "engine cgroup pids (pids_limit)",
            "max_open_files": "ulimit nofile",
            "max_output_bytes": "spawner attach-stream counter",
            "cpu_cores": "nano_cpus",
            "tmp_bytes": "tmpfs size + ulimit fsize",
            "network": 'network_mode="none"',
            "syscalls": "the engine's default seccomp profile + l4m's filter + no-new-privileges + cap_drop ALL",
        }

    async def cleanup_orphans(self) -> int:
        def remove_all() -> int:
            containers = self._client.containers.list(
                all=True, filters={"label": f"{LABEL_SPAWNER}={self.config.spawner_id}"}
            )
            for container in containers:
                with contextlib.suppress(Exception):
                    container.remove(force=True)
            return len(containers)

        return await asyncio.to_thread(remove_all)

    async def start(self, spec: SandboxSpec) -> SandboxHandle:
        import docker.errors

        if not spec.program_path.is_file():
            raise SandboxError(f"program file {spec.program_path} does not exist")
        options = container_options(self.config, spec)

        def create_attach_start() -> tuple[Any, Any]:
            container = self._client.containers.create(**options)
            try:
                # Attached before start, so not a byte of output is missed.
                stream = container.attach(stdout=True, stderr=True, stream=True, demux=True, logs=False)
                container.start()
            except BaseException:
                container.remove(force=True)
                raise
            return container, stream

        try:
            container, stream = await asyncio.to_thread(create_attach_start)
        except docker.errors.DockerException as exc:
            raise SandboxError(f"the engine could not start the container: {exc}") from exc
        return DockerHandle(spec, container, stream, self.config.cgroup_root)


class DockerHandle(SandboxHandle):
    def __init__(self, spec: SandboxSpec, container: Any, stream: Any, cgroup_root: Path) -> None:
        self.instance_id = spec.instance_id
        self._limits = spec.limits
        self._container = container
        # The engine's group for the container (its cgroupfs driver): v1, else v2 (cpu.stat's usage_usec).
        self._cpuacct_usage = cgroup_root / "cpuacct" / "docker" / container.id / "cpuacct.usage"
        self._cpu_stat = cgroup_root / "docker" / container.id / "cpu.stat"
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[OutputChunk | None] = asyncio.Queue()
        self._stderr_tail = bytearray()
        self._reader_done = asyncio.Event()
        self._stream_error: Exception | None = None
        self._reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._reader.start()
        self._kill_reason: ExitReason | None = None
        self._kill_message = ""
        self._exit: asyncio.Future[ExitInfo] | None = None

    def _read(self, stream: Any) -> None:
        try:
            for stdout, stderr in stream:
                if stdout:
                    self._loop.call_soon_threadsafe(
                        self._queue.put_nowait, OutputChunk(OutputStream.STDOUT, stdout)
                    )
                if stderr:
                    self._loop.call_soon_threadsafe(self._on_stderr, stderr)
        except Exception as exc:  # usually the connection dying with the container; see output()
            self._stream_error = exc
        finally:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
                self._loop.call_soon_threadsafe(self._queue.put_nowait, None)
                self._loop.call_soon_threadsafe(self._reader_done.set)

    def _on_stderr(self, data: bytes) -> None:
        self._stderr_tail += data
        del self._stderr_tail[:-_STDERR_TAIL_BYTES]
        self._queue.put_nowait(OutputChunk(OutputStream.STDERR, data))

    async def output(self) -> AsyncIterator[OutputChunk]:
        while (chunk := await self._queue.get()) is not None:
            yield chunk
        if self._stream_error is not None and await self._is_running():
            # Output the spawner cannot read is output it cannot count: the limit would not hold.
            await self.kill(
                ExitReason.KILLED, f"the spawner lost the container's output stream: {self._stream_error}"
            )

    async def _is_running(self) -> bool:
        try:
            await asyncio.to_thread(self._container.reload)
        except Exception:  # noqa: BLE001 - gone already
            return False
        return self._container.status == "running"

    def cpu_time_s(self) -> float | None:
        with contextlib.suppress(OSError, ValueError):
            return int(self._cpuacct_usage.read_text()) / 1e9
        with contextlib.suppress(OSError, ValueError):
            usage_us = stat_field(self._cpu_stat.read_text(), "usage_usec")
            return usage_us / 1e6 if usage_us is not None else None
        return None

    async def kill(self, reason: ExitReason, message: str) -> None:
        if self._kill_reason is None and (self._exit is None or not self._exit.done()):
            self._kill_reason, self._kill_message = reason, message
        with contextlib.suppress(Exception):  # already gone
            await asyncio.to_thread(self._container.kill)

    async def wait(self) -> ExitInfo:
        if self._exit is None:
            self._exit = asyncio.ensure_future(self._wait_once())
        return await asyncio.shield(self._exit)

    async def _wait_once(self) -> ExitInfo:
        try:
            result = await asyncio.to_thread(self._container.wait)
            await asyncio.to_thread(self._container.reload)
            state = self._container.attrs.get("State", {})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reader_done.wait(), timeout=5.0)
            exit_code, signal = split_wait_status(int(result.get("StatusCode", -1)))
            facts = ExitFacts(
                limits=self._limits,
                exit_code=exit_code,
                signal=signal,
                kill_reason=self._kill_reason,
                kill_message=self._kill_message,
                memory_oom_kills=1 if state.get("OOMKilled") else 0,
                # The engine removes the container's cgroup as it stops, so the pids counter is
                # gone by now; the symptoms in stderr tell a refused fork instead.
                pids_refused=None,
                stderr_tail=bytes(self._stderr_tail),
                memory_mechanism="engine cgroup memory",
                pids_mechanism="engine cgroup pids",
            )
            return derive_exit_info(facts)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self._container.remove, force=True)
