"""Three hosts on one machine: network namespaces joined by a bridge, a control host and two executor hosts.

The test makes its own namespaces (`NetnsHosts`, as the developers' `netns-hosts.sh` does: each host an address in
127.20.0.0/24, loopback range, so nothing leaves the machine; names unique to this run, so a developer's
own `l4mh*` namespaces are left alone) and removes them in `finally`. Host 1 runs `l4m up --role control`
(scheduler and spawner), hosts 2 and 3 `l4m up --role executor` on TLS with the control host's cluster
secret. Processes run "on" a host through `nsenter --net` (not `ip netns exec`, which remounts /sys and
hides the cgroups the spawner needs); `l4m run` runs on the control host, where the spawner listens.

The run: an executor host's listener refuses a plaintext client and a TLS one without the cluster secret;
controllers generating on both executors (placement alternates: most free pages, then fewest
instances, and both executors have the same number of pages); host 2 vanishes mid-run (its link taken down
first, so no FIN or RST reaches the scheduler, then its processes SIGKILLed): its instances end
EXECUTOR_LOST naming it, within the keepalive's detection time; those on host 3 finish; new greedy launches
succeed there with the tokens of a single-host run (the `l4m_run` fixture's cluster). Host 2's executor
restarts and rejoins while host 3 stays connected (idle, on keepalive pings); with host 3 then stopped, a
launch can only land on host 2, and it gives the same tokens.

Needs root and `ip netns` (CI runs as root); without them the test fails saying so, it does not skip.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from l4m.wire.credentials import write_secret_file
from tests.integration.harness import L4M_CLI, REPO, UP_TIMEOUT_S, CliRun, Metrics, service_env
from tests.integration.tls_certs import make_certificates

TEXT_COMPLETION = REPO / "examples" / "controllers" / "text_completion.py"
PROMPT = "Name a colour."
MAX_TOKENS = 8
EXECUTOR_PORT = 7500
NUM_PAGES = 256  # the same on both executors, so placement (most free pages, then fewest instances) alternates
DETECTION_BOUND_S = 15.0  # keepalive: 2 s between pings + 2 s for the answer; the rest is a busy machine's slack
STEP_TIMEOUT_S = 120.0

MAX_HOLD_ROUNDS = 160  # a released controller's bound: 1,280 tokens, minutes on a busy 2-core machine
# Generates greedy tokens past any stop token, 8 at a time, until its user sends "release" (at most
# MAX_HOLD_ROUNDS rounds); says "started INSTANCE_ID" after the first round, so the test knows it holds pages
# and has batches in flight on its executor when the host vanishes. Each holds its pages until host 2 is gone,
# however long the launches' stagger and the loss's detection take: placement alternates and none ends early.
HOLDING_CONTROLLER = '''
import asyncio
import json

from l4m import Greedy
from l4m.stop import on_tokens


async def main(ctx):
    release = asyncio.ensure_future(ctx.receive())
    async with ctx.new_context() as chat:
        chat.fill_chat([{"role": "user", "content": ctx.args[0]}])
        for round_ in range(int(ctx.args[1])):
            await chat.generate(Greedy(), stop=on_tokens([]), max_tokens=8)
            if round_ == 0:
                await ctx.send(f"started {ctx.instance_id}")
            elif release.done():
                break
    released = release.done() and release.result() == "release"
    release.cancel()
    await ctx.send(json.dumps({"held": True, "released": released}))
'''

# Run on the control host: sends "release" to each instance named; an instance already gone is passed over.
RELEASE = """
import asyncio
import sys
from pathlib import Path

from l4m.client import Client
from l4m.errors import L4MError


async def release(key, instance_ids):
    async with Client("127.0.0.1:7410", api_key=key) as client:
        for instance_id in instance_ids:
            try:
                await client.send(instance_id, "release")
                print(f"released {instance_id}")
            except L4MError as error:
                print(f"not released {instance_id}: {error}")


asyncio.run(release(Path(sys.argv[1]).read_text().strip(), sys.argv[2:]))
"""


# Run on the control host against an executor host's listener: GetInfo in plaintext, then over TLS without the
# cluster secret; prints each call's status code.
PROBE_EXECUTOR = """
import sys
from pathlib import Path

import grpc

from l4m.v1 import executor_pb2, executor_pb2_grpc
from l4m.wire.credentials import channel_credentials

address, ca = sys.argv[1], Path(sys.argv[2])
for channel in (grpc.insecure_channel(address), grpc.secure_channel(address, channel_credentials(ca))):
    try:
        executor_pb2_grpc.ExecutorServiceStub(channel).GetInfo(executor_pb2.ExecutorServiceGetInfoRequest(), timeout=10)
        print("OK")
    except grpc.RpcError as error:
        print(error.code().name)
"""


def _run(*argv: str) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def _require_netns() -> None:
    missing = [tool for tool in ("ip", "nsenter", "sysctl", "openssl") if shutil.which(tool) is None]
    if missing or os.geteuid() != 0:
        pytest.fail(f"the multi-host test needs root, `ip netns`, nsenter, sysctl and openssl (missing: "
                    f"{', '.join(missing) or 'root'}); CI runs it as root")


class NetnsHosts:
    """`num_hosts` network namespaces on one bridge (in a hub namespace), host i at 127.20.0.i."""

    def __init__(self, num_hosts: int) -> None:
        tag = f"l4mt{os.getpid() % 100000}"
        self.hub = f"{tag}hub"
        self.names = [f"{tag}h{i}" for i in range(1, num_hosts + 1)]
        self.made: list[str] = []

    def address(self, host: int) -> str:
        return f"127.20.0.{host}"

    def up(self) -> None:
        _run("ip", "netns", "add", self.hub)
        self.made.append(self.hub)
        _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.hub, "link", "set", "br0", "up")
        for host, name in enumerate(self.names, start=1):
            _run("ip", "netns", "add", name)
            self.made.append(name)
            _run("ip", "link", "add", f"v{host}", "netns", name, "type", "veth", "peer", "name", f"p{host}",
                 "netns", self.hub)
            _run("ip", "-n", self.hub, "link", "set", f"p{host}", "master", "br0")
            _run("ip", "-n", self.hub, "link", "set", f"p{host}", "up")
            for key in ("all", f"v{host}"):  # 127/8 off the loopback device: the kernel drops it otherwise
                _run("ip", "netns", "exec", name, "sysctl", "-qw", f"net.ipv4.conf.{key}.route_localnet=1")
            _run("ip", "-n", name, "addr", "add", f"{self.address(host)}/24", "dev", f"v{host}")
            _run("ip", "-n", name, "link", "set", "lo", "up")
            _run("ip", "-n", name, "link", "set", f"v{host}", "up")

    def on(self, host: int, argv: Sequence[str]) -> list[str]:
        """`argv` run "on" host `host` (its network namespace only)."""
        return ["nsenter", f"--net=/run/netns/{self.names[host - 1]}", *argv]

    def set_link(self, host: int, is_up: bool) -> None:
        _run("ip", "-n", self.names[host - 1], "link", "set", f"v{host}", "up" if is_up else "down")

    def kill_all(self, host: int) -> int:
        """SIGKILL every process on host `host`; returns how many there were."""
        pids = [int(p) for p in _run("ip", "netns", "pids", self.names[host - 1]).split()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)

    def down(self) -> None:
        for host in range(1, len(self.names) + 1):
            if self.names[host - 1] in self.made:
                with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                    self.kill_all(host)
        for name in reversed(self.made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self.made.clear()


class HostUp:
    """One `l4m up` on a host, its output in a file; `stop` is Ctrl-C, then SIGKILL."""

    def __init__(self, hosts: NetnsHosts, host: int, log_path: Path, flags: Sequence[str]) -> None:
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(hosts.on(host, [str(L4M_CLI), "up", "--quiet", *flags]), stdout=log,
                                            stderr=subprocess.STDOUT, cwd=REPO, env=service_env())

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_up(self) -> None:
        _wait_for(lambda: "l4m is up" in self.output(), UP_TIMEOUT_S, f"l4m up ({self.log_path})",
                  lambda: self.process.poll() is None)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _wait_for(condition: Callable[[], bool], timeout_s: float, what: str,
              is_alive: Callable[[], bool] = lambda: True) -> float:
    """Poll `condition` every 0.1 s; the seconds it took. Fails after `timeout_s` or when `is_alive` is false."""
    started = time.monotonic()
    while not condition():
        assert is_alive(), f"{what} exited before it was ready"
        assert time.monotonic() - started < timeout_s, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(0.1)
    return time.monotonic() - started


class Runs:
    """`l4m run`s on the control host, each in the background with its output in files."""

    def __init__(self, hosts: NetnsHosts, work_dir: Path, admin_key: Path) -> None:
        self.hosts, self.work_dir, self.admin_key = hosts, work_dir, admin_key
        self.started: list[tuple[list[str], subprocess.Popen[bytes], Path, Path]] = []

    def start(self, program: Path, *args: str) -> int:
        index = len(self.started)
        argv = [str(L4M_CLI), "run", "--spawner", "127.0.0.1:7410", "--api-key-file", str(self.admin_key),
                "--quiet-logs", str(program), "--", *args]
        out, err = self.work_dir / f"run-{index}.out", self.work_dir / f"run-{index}.err"
        with out.open("wb") as stdout, err.open("wb") as stderr:
            process = subprocess.Popen(self.hosts.on(1, argv), stdout=stdout, stderr=stderr, cwd=REPO,
                                       env=service_env())
        self.started.append((argv, process, out, err))
        return index

    def stdout(self, index: int) -> str:
        return self.started[index][2].read_text(errors="replace")

    def finish(self, index: int, timeout_s: float = STEP_TIMEOUT_S) -> CliRun:
        argv, process, out, err = self.started[index]
        process.wait(timeout_s)
        return CliRun(argv, process.returncode, out.read_text(errors="replace"), err.read_text(errors="replace"))

    def kill_all(self) -> None:
        for _, process, _, _ in self.started:
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.fixture
def reference_tokens(l4m_run: Callable[..., CliRun]) -> list[int]:
    """The single-host cluster's greedy tokens for the workload's prompt."""
    run = l4m_run(TEXT_COMPLETION, "--no-stream", "--max-tokens", str(MAX_TOKENS), PROMPT)
    assert run.returncode == 0, run.describe()
    return run.summary()["token_ids"]


def _greedy_tokens(run: CliRun) -> list[int]:
    assert run.returncode == 0, run.describe()
    return run.summary()["token_ids"]


def test_executor_hosts_vanish_and_return_while_the_control_host_keeps_serving(
        tmp_path: Path, reference_tokens: list[int]) -> None:
    _require_netns()
    hosts = NetnsHosts(3)
    ups: list[HostUp] = []
    runs: Runs | None = None
    scheduler_log = tmp_path / "control" / "logs" / "scheduler.log"
    started = time.monotonic()
    try:
        hosts.up()
        certificates = make_certificates(tmp_path / "tls", (hosts.address(2), hosts.address(3)))
        secret = tmp_path / "cluster.secret"
        write_secret_file(secret)
        tls = ["--tls-cert", str(certificates.cert_path), "--tls-key", str(certificates.key_path),
               "--tls-ca", str(certificates.ca_path)]

        def start_executor(host: int, generation: int) -> HostUp:
            up = HostUp(hosts, host, tmp_path / f"host{host}-{generation}.log", [
                "--role", "executor", "--state-dir", str(tmp_path / f"host{host}"), "--metrics-port-base", "0",
                "--executor-listen", f"{hosts.address(host)}:{EXECUTOR_PORT}", "--cluster-secret-file", str(secret),
                "--num-pages", str(NUM_PAGES), *tls])
            ups.append(up)
            return up

        executors = {2: start_executor(2, 0), 3: start_executor(3, 0)}
        control = HostUp(hosts, 1, tmp_path / "control.log", [
            "--role", "control", "--state-dir", str(tmp_path / "control"), "--metrics-port-base", "9410",
            "--gateway-port", "-1", "--cluster-secret-file", str(secret), "--tls-ca", str(certificates.ca_path),
            *(f"--executor={hosts.address(h)}:{EXECUTOR_PORT}" for h in (2, 3))])
        ups.append(control)
        for up in (executors[2], executors[3], control):
            up.wait_up()

        def connections(host: int, event: str) -> int:
            pattern = rf"executor \d \({re.escape(hosts.address(host))}:{EXECUTOR_PORT}\)( connected| lost)"
            return [m.group(1).strip() for m in re.finditer(pattern, scheduler_log.read_text())].count(event)

        def scheduler_metrics() -> Metrics:  # the control host's own 127.0.0.1: read there
            fetch = "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"
            return Metrics(_run(*hosts.on(1, [sys.executable, "-c", fetch, "http://127.0.0.1:9411/metrics"])))

        _wait_for(lambda: connections(2, "connected") == connections(3, "connected") == 1, 60,
                  "both executor hosts connected")
        print(f"{time.monotonic() - started:.0f} s: three hosts up")
        # Who may use an executor host's listener: the scheduler alone (TLS and the cluster secret).
        probe = _run(*hosts.on(1, [sys.executable, "-c", PROBE_EXECUTOR, f"{hosts.address(3)}:{EXECUTOR_PORT}",
                                   str(certificates.ca_path)]))
        assert probe.split() == ["UNAVAILABLE", "UNAUTHENTICATED"], "plaintext refused; TLS without the secret too"
        runs = Runs(hosts, tmp_path, tmp_path / "control" / "admin.key")

        # Host 2 vanishes mid-run: link down first (no FIN, no RST reaches the scheduler), then SIGKILL.
        holding = tmp_path / "holding.py"
        holding.write_text(HOLDING_CONTROLLER)
        long_runs = [runs.start(holding, f"Count to {n}.", str(MAX_HOLD_ROUNDS)) for n in range(4)]
        _wait_for(lambda: all("started" in runs.stdout(i) for i in long_runs), STEP_TIMEOUT_S,
                  "every holding controller generating")
        instance_ids = [runs.stdout(i).split("started ", 1)[1].split()[0] for i in long_runs]
        print(f"{time.monotonic() - started:.0f} s: holding runs started")
        hosts.set_link(2, is_up=False)
        assert hosts.kill_all(2) >= 2  # its l4m up and its executor
        detection_s = _wait_for(lambda: connections(2, "lost") == 1, DETECTION_BOUND_S, "host 2's loss detected")
        print(f"host 2's loss detected {detection_s:.1f} s after its link went down and its processes died")
        print(_run(*hosts.on(1, [sys.executable, "-c", RELEASE, str(runs.admin_key), *instance_ids])), end="")

        ended = {index: runs.finish(index) for index in long_runs}
        lost = [i for i, run in ended.items() if run.returncode != 0]
        print(f"instances lost with host 2: runs {lost} of {long_runs}")
        for index, run in ended.items():
            if index in lost:  # trapped (exit 3), the reason naming the lost host
                assert run.returncode == 3 and "EXIT_REASON_TRAPPED" in run.stderr, run.describe()
                assert f"executor 0 ({hosts.address(2)}:{EXECUTOR_PORT}) was lost" in run.stderr, run.describe()
            else:  # held its pages until released, after host 2 was gone
                assert run.summary() == {"held": True, "released": True}, run.describe()
        assert 0 < len(lost) < len(long_runs), "placement alternates: host 2 had some instances, host 3 others"
        traps = scheduler_metrics().value("l4m_scheduler_traps_total", 0, kind="TRAP_KIND_EXECUTOR_LOST")
        assert traps == len(lost), "each lost instance was trapped EXECUTOR_LOST, and no other"

        print(f"{time.monotonic() - started:.0f} s: host 2 lost")
        # Host 2's executor starts again, loading its model while its link is still down (so nothing reaches
        # it, its own health check included); meanwhile new launches go to the host that remains, and give a
        # single host's greedy tokens there.
        executors[2] = start_executor(2, 1)
        for index in [runs.start(TEXT_COMPLETION, "--no-stream", "--max-tokens", str(MAX_TOKENS), PROMPT)
                      for _ in range(2)]:
            assert _greedy_tokens(runs.finish(index)) == reference_tokens

        # Host 2 returns and rejoins; with host 3 gone, a launch can only land on host 2.
        hosts.set_link(2, is_up=True)
        executors[2].wait_up()
        print(f"{time.monotonic() - started:.0f} s: host 2's executor up again")
        rejoin_s = _wait_for(lambda: connections(2, "connected") == 2, 30, "host 2 rejoining")
        print(f"host 2 rejoined {rejoin_s:.1f} s after its executor served again")
        assert connections(3, "lost") == 0, "host 3's link held throughout, idle spells included (keepalive pings)"
        executors[3].stop()
        _wait_for(lambda: connections(3, "lost") == 1, DETECTION_BOUND_S, "host 3's departure seen")
        assert _greedy_tokens(runs.finish(runs.start(
            TEXT_COMPLETION, "--no-stream", "--max-tokens", str(MAX_TOKENS), PROMPT))) == reference_tokens
        assert control.process.poll() is None, "the control host served throughout"
        print(f"{time.monotonic() - started:.0f} s: done")
    except BaseException:
        for up in ups:
            print(f"----- {up.log_path.name} -----\n{up.output()[-3000:]}")
        if scheduler_log.exists():
            print(f"----- scheduler.log -----\n{scheduler_log.read_text(errors='replace')[-6000:]}")
        if runs is not None:
            for index, (_, process, _, _) in enumerate(runs.started):
                print(f"----- run {index} -----\n" + (runs.finish(index).describe() if process.poll() is not None
                                                      else "still running"))
        raise
    finally:
        if runs is not None:
            runs.kill_all()
        for up in reversed(ups):
            up.stop()
        hosts.down()
