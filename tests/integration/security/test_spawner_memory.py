"""Issue #17's attacks on the spawner's own memory, against a real `python -m l4m.spawner` (bubblewrap
sandboxes, no scheduler): a large upload that is costly to compile, 8x10^6 empty output lines, empty
messages until the output limit, empty variables under 250-byte names until the tree's quota. Each is
refused with a clear error or ended by its limit, another client is served meanwhile, what an exited
instance keeps is bounded, and the spawner's RSS (VmRSS of its process, printed before and after) grows
by less than the bound its quotas give (`_rss_bound_bytes`).

Before the fixes: the 2 MB upload alone grew the spawner by ~680 MiB and stalled other clients ~1 s,
the empty lines kept 100-320 MB after exit, empty messages were free and all replayed, and 145,600
empty variables kept 253 MB.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from l4m.v1 import spawner_pb2, spawner_pb2_grpc
from tests.integration.harness import ServiceProcess

MiB = 1024 * 1024
ITEM_OVERHEAD_BYTES = 64  # l4m.spawner.supervisor: what each line or message costs beyond its text
VARIABLE_OVERHEAD_BYTES = 256  # l4m.spawner.variables
EXITED_REPLAY_BYTES = 64 * 1024  # l4m.spawner.supervisor: the tail an exited instance keeps
MAX_PROGRAM_MIB = 4  # the spawner's default --max-program-mib
# Smaller than the defaults so that each attack reaches its limit in seconds; each is still several times
# what the limit it is measured against leaves (the replay tail, the RSS bound's slack).
UPLOAD_VALIDATION_MIB = 256  # --upload-validation-memory-mib (default 1024: ~5 s of compiling per dense upload)
VARIABLE_MIB_PER_TREE = 1  # --max-variable-mib-per-tree (default 64; 2,072 variables of 506 charged bytes)
OUTPUT_LIMIT_BYTES = 256 * 1024  # the launches' max_output_bytes (default 16 MiB; 4 x the 64 KiB replay tail)
NAME_BYTES = 250
MEMORY_MIB_PER_USER = 2048  # --max-memory-mib-per-user for this spawner

# A plain script (the spawner runs with --controller-runner ""): it speaks RuntimeService directly.
ATTACKER = r'''
import os, sys
import grpc
from l4m.v1 import spawner_pb2, spawner_pb2_grpc

mode, count = sys.argv[1], int(sys.argv[2])
if mode == "sleep":
    import time
    time.sleep(count)
    sys.exit(0)
if mode == "lines":
    for _ in range(count // 1_000_000):
        os.write(1, b"\n" * 1_000_000)
    sys.exit(0)
channel = grpc.insecure_channel(os.environ["L4M_RUNTIME_ADDR"])
runtime = spawner_pb2_grpc.RuntimeServiceStub(channel)
metadata = (("l4m-instance-token", os.environ["L4M_INSTANCE_TOKEN"]),)
num_done, refusal = 0, "none"
try:
    for i in range(count):
        if mode == "messages":
            runtime.SendToUser(spawner_pb2.SendToUserRequest(text=""), metadata=metadata, timeout=30)
        else:
            runtime.SetVariable(spawner_pb2.SetVariableRequest(name=f"{i:0250d}", value=b""),
                                metadata=metadata, timeout=30)
        num_done += 1
except grpc.RpcError as error:
    refusal = f"{error.code().name}: {error.details()}"
runtime.SendToUser(spawner_pb2.SendToUserRequest(text=f"done {num_done} refusal {refusal}"),
                   metadata=metadata, timeout=30)
'''


def vm_rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) * 1024


def _rss_bound_bytes() -> int:
    """What the attacks may leave in the spawner, from its quotas (each at its measured real cost):
    - variables: the tree's quota, ~440 real bytes per 506 charged (tests/unit/spawner/test_variables.py),
      dropped at the tree's exit but possibly held by the allocator: 1.0 x VARIABLE_MIB_PER_TREE;
    - the running replay buffer (1 MiB of charge, ~100 real bytes per 65 charged for an empty item):
      2.5 MiB, then 64 KiB per exited instance;
    - the uploads' gRPC buffers: 2 x MAX_PROGRAM_MIB (a chunk and its copy; compiling is in a child);
    - 48 MiB of slack for gRPC, the allocator and logging, far under any one attack before the fixes
      (+253 MB to +680 MiB)."""
    return (VARIABLE_MIB_PER_TREE + 3 + 2 * MAX_PROGRAM_MIB + 48) * MiB


@dataclass
class Spawner:
    process: ServiceProcess
    stub: spawner_pb2_grpc.SpawnerServiceStub
    health: health_pb2_grpc.HealthStub

    @property
    def pid(self) -> int:
        return self.process.process.pid

    def upload(self, data: bytes, timeout_s: float = 120) -> spawner_pb2.UploadProgramResponse:
        header = spawner_pb2.ProgramHeader(size_bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        chunks = [data[i : i + MiB] for i in range(0, len(data), MiB)]
        requests = [spawner_pb2.UploadProgramRequest(header=header)]
        requests += [spawner_pb2.UploadProgramRequest(chunk=chunk) for chunk in chunks]
        return self.stub.UploadProgram(iter(requests), timeout=timeout_s)

    def run(self, sha256: str, *args: str) -> list[spawner_pb2.AttachResponse]:
        """Launches detached, waits for the exit, then attaches: the replay of an exited instance."""
        limits = spawner_pb2.Limits(max_output_bytes=OUTPUT_LIMIT_BYTES, wall_time_ms=300_000)
        request = spawner_pb2.LaunchRequest(program=sha256, args=list(args), limits=limits, detached=True)
        instance_id = self.stub.Launch(request, timeout=60).instance_id
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            listed = self.stub.ListInstances(spawner_pb2.ListInstancesRequest(), timeout=30).instances
            if any(i.instance_id == instance_id and i.HasField("exit") for i in listed):
                break
            time.sleep(0.2)
        return list(self.stub.Attach(spawner_pb2.AttachRequest(instance_id=instance_id), timeout=60))


@pytest.fixture(scope="module")
def spawner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Spawner]:
    state = tmp_path_factory.mktemp("spawner-memory")
    process = ServiceProcess(
        "l4m.spawner",
        ["--listen", "127.0.0.1:0", "--state-dir", str(state / "state"), "--socket-dir", str(state / "sockets"),
         "--insecure-local", "--warm-pool-size", "0", "--controller-runner", "", "--spawner-id",
         f"secmem-{time.monotonic_ns() % 10**9}", "--max-variable-mib-per-tree", str(VARIABLE_MIB_PER_TREE),
         "--max-memory-mib-per-user", str(MEMORY_MIB_PER_USER), "--upload-validation-memory-mib",
         str(UPLOAD_VALIDATION_MIB)],
        state / "spawner.log",
    )  # fmt: skip
    try:
        channel = grpc.insecure_channel(process.wait_listening(60))
        yield Spawner(process, spawner_pb2_grpc.SpawnerServiceStub(channel), health_pb2_grpc.HealthStub(channel))
        channel.close()
    finally:
        process.stop()
        print(f"---- spawner log ----\n{process.log_tail()}")


def _messages(events: list[spawner_pb2.AttachResponse]) -> list[str]:
    return [e.message.text for e in events if e.WhichOneof("event") == "message"]


def _exit(events: list[spawner_pb2.AttachResponse]) -> spawner_pb2.InstanceExit:
    assert events and events[-1].WhichOneof("event") == "exit", events[-3:]
    return events[-1].exit


def test_the_spawner_memory_attacks_are_bounded_by_the_quotas(spawner: Spawner) -> None:
    attacker = spawner.upload(ATTACKER.encode()).sha256
    _exit(spawner.run(attacker, "lines", "1000000"))  # warm-up: first launch, first attach
    rss_before = vm_rss_bytes(spawner.pid)
    print(f"spawner VmRSS before the attacks: {rss_before / MiB:.1f} MiB")

    # 1. Uploads: over the size limit refused naming it; four dense 3.9 MiB programs (each needs ~2.2 GiB to
    # compile, the attacker's program far less than the validators' limit) refused as out of memory by their
    # bounded validators, two at a time, while another client is served.
    with pytest.raises(grpc.RpcError) as too_large:
        spawner.upload(b"#" * (MAX_PROGRAM_MIB * MiB + 1))
    assert too_large.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"maximum of {MAX_PROGRAM_MIB * MiB} bytes" in too_large.value.details()
    dense = [b"f()\n" * (MAX_PROGRAM_MIB * MiB // 4 - 4096) + b"#%d\n" % i for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        uploads = [pool.submit(spawner.upload, data) for data in dense]
        time.sleep(0.5)  # the uploads are sent; their validations run
        check = health_pb2.HealthCheckRequest(service="")
        assert spawner.health.Check(check, timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        spawner.stub.ListInstances(spawner_pb2.ListInstancesRequest(), timeout=10)
        num_validating = sum(not upload.done() for upload in uploads)
        print(f"health and ListInstances answered while {num_validating} of 4 uploads were still validating")
        assert num_validating > 0
        for upload in uploads:
            error = upload.exception(timeout=300)
            assert isinstance(error, grpc.RpcError) and error.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "ran out of memory" in error.details() and f"limit of {UPLOAD_VALIDATION_MIB} MiB" in error.details()

    # 2. 8x10^6 empty lines: the output limit ends it; an exited instance replays at most its 64 KiB tail.
    events = spawner.run(attacker, "lines", "8000000")
    assert spawner_pb2.ExitReason.Name(_exit(events).reason) == "EXIT_REASON_OUTPUT_LIMIT"
    num_lines = sum(e.WhichOneof("event") == "log" for e in events)
    assert num_lines <= EXITED_REPLAY_BYTES // (1 + ITEM_OVERHEAD_BYTES), num_lines

    # 3. Empty messages: each costs ITEM_OVERHEAD_BYTES against the output limit.
    events = spawner.run(attacker, "messages", "1000000")
    assert spawner_pb2.ExitReason.Name(_exit(events).reason) == "EXIT_REASON_OUTPUT_LIMIT"
    assert len(_messages(events)) <= EXITED_REPLAY_BYTES // ITEM_OVERHEAD_BYTES

    # 4. Empty variables under 250-byte names: the tree's quota refuses them, naming it.
    events = spawner.run(attacker, "variables", "1000000")
    assert spawner_pb2.ExitReason.Name(_exit(events).reason) == "EXIT_REASON_EXITED"
    (report,) = _messages(events)
    num_stored = int(report.split()[1])
    assert num_stored == VARIABLE_MIB_PER_TREE * MiB // (NAME_BYTES + VARIABLE_OVERHEAD_BYTES), report
    assert "RESOURCE_EXHAUSTED: variable" in report and f"exceed {VARIABLE_MIB_PER_TREE * MiB} bytes" in report

    rss_after = vm_rss_bytes(spawner.pid)
    growth = rss_after - rss_before
    print(f"spawner VmRSS after the attacks: {rss_after / MiB:.1f} MiB (growth {growth / MiB:+.1f} MiB, "
          f"bound {_rss_bound_bytes() / MiB:.0f} MiB)")
    assert growth < _rss_bound_bytes()


def test_limits_over_the_maximum_are_refused_and_memory_is_summed_per_user(spawner: Spawner) -> None:
    attacker = spawner.upload(ATTACKER.encode()).sha256

    def launch(memory_mib: int) -> str:
        limits = spawner_pb2.Limits(memory_bytes=memory_mib * MiB)
        request = spawner_pb2.LaunchRequest(program=attacker, args=["sleep", "300"], limits=limits, detached=True)
        return spawner.stub.Launch(request, timeout=60).instance_id

    with pytest.raises(grpc.RpcError) as over_max:
        launch(8192)
    assert over_max.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "memory_bytes = 8589934592 is over the spawner's maximum of 4294967296" in over_max.value.details()
    sleepers = [launch(1024), launch(1024)]
    try:
        with pytest.raises(grpc.RpcError) as over_sum:
            launch(512)
        assert over_sum.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"max memory per user: {MEMORY_MIB_PER_USER} MiB" in over_sum.value.details()
    finally:
        for instance_id in sleepers:
            spawner.stub.Terminate(spawner_pb2.TerminateRequest(instance_id=instance_id), timeout=60)
    spawner.stub.Terminate(spawner_pb2.TerminateRequest(instance_id=launch(512)), timeout=60)
