"""The attack suite of issue #16: every way one controller or client could reach past what it owns, tried
on one shared `l4m up` (the session's) through `l4m run` and raw gRPC clients. Each attempt must be
contained with a clear gRPC status or trap reason, and only the offender may be affected: after the suite
the same greedy completion comes back token for token and every KV page is back in the pool.

Users: the admin (the key `l4m up` wrote), alice and bob (`l4m keys add`), and a caller with no key.
The baseline (the greedy completion, the pages held) is taken before the first test of this directory;
`test_zz_unharmed.py` compares with it after the last.
"""

from __future__ import annotations

import json
import signal
import subprocess

import grpc
import pytest

from l4m.v1 import registry_pb2, registry_pb2_grpc, spawner_pb2
from l4m.wire.credentials import bearer_metadata
from tests.integration.harness import L4M_CLI, REPO, UpCluster, service_env
from tests.integration.security.conftest import ATTACKER, Baseline, Users, pages_used, wait_until


def _trapped(ended, kind: str, *words: str) -> None:  # type: ignore[no-untyped-def]
    """Ended by a trap of `kind` (the SDK's log line names it) whose reason has every one of `words`."""
    assert ended.reason == "EXIT_REASON_TRAPPED", ended.describe()
    assert any(f"({kind})" in line for line in ended.logs), ended.describe()
    for word in words:
        assert word in ended.exit.message, ended.describe()


# (a) a sandbox calls the registry on its L4M socket; the registry socket is not there to find
def test_a_registry_is_not_served_to_sandboxes(l4m_up: UpCluster, users: Users) -> None:
    registry_path = l4m_up.registry_address.removeprefix("unix:")
    ended = users.alice.run(ATTACKER, "registry", registry_path)
    assert ended.reason == "EXIT_REASON_EXITED", ended.describe()
    seen = json.loads(ended.messages[-1])
    assert seen["codes"] == dict.fromkeys(("RegisterInstance", "DestroyInstance", "WatchInstanceEvents"),
                                          "UNIMPLEMENTED")
    # The data plane's sockets only: L4M on gRPC and on frames (which carry L4M sessions and GetInfo, no
    # registry: test_framed_sessions.py), and the runtime on gRPC and on frames (user messages only).
    assert set(seen["run_l4m"]) <= {"scheduler.sock", "scheduler.frames.sock", "runtime.sock",
                                    "runtime.frames.sock"}, seen
    assert not seen["registry_visible"] and not seen["internal_visible"], seen


# (b) a host process without the cluster secret on the registry socket (and the registry on TCP)
def test_b_registry_needs_the_cluster_secret(l4m_up: UpCluster) -> None:
    request = registry_pb2.DestroyInstanceRequest(instance_id="nobody")
    for metadata in ((), bearer_metadata("not-the-secret-but-long-enough")):
        with grpc.insecure_channel(l4m_up.registry_address) as channel:
            stub = registry_pb2_grpc.InstanceRegistryServiceStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.DestroyInstance(request, timeout=10, metadata=metadata)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, caught.value
            with pytest.raises(grpc.RpcError) as caught:
                stub.RegisterInstance(registry_pb2.RegisterInstanceRequest(instance_id="ghost", token="x" * 32),
                                      timeout=10, metadata=metadata)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, caught.value
    for address in (l4m_up.scheduler_address, l4m_up.scheduler_socket):  # the data plane serves no registry
        with grpc.insecure_channel(address) as channel:
            stub = registry_pb2_grpc.InstanceRegistryServiceStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.DestroyInstance(request, timeout=10, metadata=bearer_metadata(l4m_up.cluster_secret))
            assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED, (address, caught.value)


# (c) a normal controller re-tunes batching for the whole cluster
def test_c_batching_needs_an_admin_instance(users: Users) -> None:
    before = json.loads(users.alice.run(ATTACKER, "read-batching").messages[-1])["batching"]
    _trapped(users.alice.run(ATTACKER, "batching"), "TRAP_KIND_PERMISSION_DENIED", "admin")
    after = json.loads(users.bob.run(ATTACKER, "read-batching").messages[-1])["batching"]
    assert after == before


# (d) another user's export: not listed, not importable, not removable; (e) an importer writes into it
def test_d_another_users_export_is_invisible(users: Users) -> None:
    name = "alice-private"
    exported = users.alice.run(ATTACKER, "export", name)
    assert exported.reason == "EXIT_REASON_EXITED", exported.describe()
    probe = users.bob.run(ATTACKER, "probe", name)  # lists, unexports, lists again
    if probe.reason == "EXIT_REASON_EXITED":
        seen = json.loads(probe.messages[-1])
        assert name not in seen["before"] and name not in seen["after"], seen
    else:  # an unexport of a name bob cannot see answers like a missing one
        _trapped(probe, "TRAP_KIND_INVALID_COMMAND", name)
        assert "PERMISSION" not in probe.exit.message, probe.describe()  # nothing says it exists
    _trapped(users.bob.run(ATTACKER, "import-raw", name), "TRAP_KIND_INVALID_COMMAND", name)
    assert name in json.loads(users.alice.run(ATTACKER, "list").messages[-1])["exports"]
    # (e) still there for alice, who imports it and writes (masks) into a shared page: the chosen behaviour
    # is a trap that names the page as read-only (docs/protocol.md); the write-import mode unexports first.
    _trapped(users.alice.run(ATTACKER, "write-import", name), "TRAP_KIND_INVALID_COMMAND", "read-only")
    assert name not in json.loads(users.alice.run(ATTACKER, "list").messages[-1])["exports"]  # cleaned up


# (f) SpawnerService without a key; bob against alice's running instance
def test_f_spawner_calls_need_a_key_and_see_only_their_own(users: Users) -> None:
    calls = {
        "ListInstances": lambda s: s.stub.ListInstances(spawner_pb2.ListInstancesRequest(), timeout=10,
                                                        metadata=s.metadata),
        "ListPrograms": lambda s: s.stub.ListPrograms(spawner_pb2.ListProgramsRequest(), timeout=10,
                                                      metadata=s.metadata),
        "Launch": lambda s: s.stub.Launch(spawner_pb2.LaunchRequest(program="x" * 64), timeout=10,
                                          metadata=s.metadata),
    }
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as caught:
            call(users.anonymous)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
    secret_arg = "patient-id-4711"
    victim = users.alice.launch(ATTACKER, ["wait", secret_arg])
    assert users.alice.wait_for_message(victim) == "ready"
    for name, call in {
        "Attach": lambda: next(iter(users.bob.stub.Attach(spawner_pb2.AttachRequest(instance_id=victim),
                                                          timeout=10, metadata=users.bob.metadata))),
        "SendMessage": lambda: users.bob.stub.SendMessage(
            spawner_pb2.SendMessageRequest(instance_id=victim, text="hi"), timeout=10, metadata=users.bob.metadata),
        "Terminate": lambda: users.bob.stub.Terminate(
            spawner_pb2.TerminateRequest(instance_id=victim), timeout=10, metadata=users.bob.metadata),
    }.items():
        with pytest.raises(grpc.RpcError) as caught:
            call()
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND, name
    listed = calls["ListInstances"](users.bob)
    assert victim not in {i.instance_id for i in listed.instances}
    assert secret_arg not in str(listed)
    mine = {i.instance_id: i for i in calls["ListInstances"](users.alice).instances}
    assert mine[victim].state == spawner_pb2.INSTANCE_STATE_RUNNING, mine[victim]  # bob changed nothing
    assert victim in {i.instance_id for i in calls["ListInstances"](users.admin).instances}  # the admin sees all
    users.alice.stub.Terminate(spawner_pb2.TerminateRequest(instance_id=victim), timeout=10,
                               metadata=users.alice.metadata)


# (g) a child asks for more tokens than its parent has left
def test_g_a_child_draws_from_its_parents_budget(users: Users) -> None:
    ended = users.alice.run(ATTACKER, "spawn-feed", "200", limits=spawner_pb2.Limits(max_tokens=50))
    assert ended.reason == "EXIT_REASON_EXITED", ended.describe()
    child = json.loads(ended.messages[-1])["child"]
    assert child is not None and not child["success"], child
    assert "TRAPPED" in child["reason"] and "budget" in child["message"], child


# (h) user namespaces and mounts inside the sandbox, through `l4m run`
def test_h_unshare_and_mount_fail_in_the_sandbox(l4m_run) -> None:  # type: ignore[no-untyped-def]
    result = l4m_run(ATTACKER, "unshare")
    assert result.returncode == 0, result.describe()
    seen = json.loads(result.lines[-1])
    assert seen["unshare"]["returncode"] != 0 and seen["mount"]["returncode"] != 0, seen


# (j) messages to a user on the framed runtime socket under a made-up token; a bad frame after a real opening
def test_j_runtime_frames_need_a_running_instances_token(users: Users) -> None:
    ended = users.alice.run(ATTACKER, "forge-messages")
    assert ended.reason == "EXIT_REASON_EXITED", ended.describe()
    seen = json.loads(ended.messages[-1])
    assert seen["forged"] == ["UNAUTHENTICATED"], seen  # refused at the opening: "forged" reached no one
    # Its own token: the message goes to its own user; the bad frame ends that connection, not the instance.
    assert seen["wrong_kind"] == ["OK", "OK", "INVALID_ARGUMENT"], seen
    assert ended.messages[:-1] == ["own"], ended.describe()


# (i) Ctrl-C on `l4m run` frees the instance's pages within a second
def test_i_ctrl_c_frees_the_pages(l4m_up: UpCluster, baseline: Baseline) -> None:
    argv = [str(L4M_CLI), "run", "--spawner", l4m_up.spawner_address, "--api-key-file", str(l4m_up.admin_key_path),
            str(ATTACKER), "--", "wait"]
    proc = subprocess.Popen(argv, cwd=REPO, env=service_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", proc.stderr
        pages_held = baseline.held["scheduler_kv_pages"]
        assert pages_used(l4m_up)["scheduler_kv_pages"] > pages_held
        proc.send_signal(signal.SIGINT)
        elapsed = wait_until(lambda: pages_used(l4m_up)["scheduler_kv_pages"] == pages_held, timeout_s=10)
        # The spawner ends it at once (a second is the promise); the slack is for scrapes on a loaded CI box.
        assert elapsed < 3.0, f"the pages were freed {elapsed:.2f} s after Ctrl-C"
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
