"""The docker backend's container policy (no engine: only the options it would send)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from l4m.spawner import seccomp
from l4m.spawner.docker_sandbox import DockerSandboxConfig, container_options, seccomp_refusal
from l4m.spawner.sandbox import Limits, MiB, SandboxSpec

LIMITS = Limits(memory_bytes=256 * MiB, max_processes=32, tmp_bytes=16 * MiB)
SPEC = SandboxSpec("i-1", Path("/store/programs/abc"), (), {}, Path("/state/sockets"), LIMITS)
OPTIONS = container_options(DockerSandboxConfig(image="l4m-controller:x"), SPEC)


def test_no_capability_no_new_privileges_and_the_default_seccomp_profile() -> None:
    assert OPTIONS["cap_drop"] == ["ALL"]
    assert "cap_add" not in OPTIONS and not OPTIONS.get("privileged")
    assert OPTIONS["security_opt"] == ["no-new-privileges:true"]  # no seccomp=...: the default profile
    assert OPTIONS["user"] == "65534:65534"


def test_read_only_root_limited_tmp_no_network_and_limits() -> None:
    assert OPTIONS["read_only"] is True
    assert OPTIONS["tmpfs"] == {"/tmp": f"size={16 * MiB},mode=1777"}
    assert OPTIONS["network_mode"] == "none"
    assert OPTIONS["pids_limit"] == 32
    assert OPTIONS["mem_limit"] == OPTIONS["memswap_limit"] == 256 * MiB


def test_only_the_program_and_the_socket_dir_are_mounted_read_only() -> None:
    mounts = {mount["Target"]: mount for mount in OPTIONS["mounts"]}
    assert set(mounts) == {"/opt/l4m/program/main.py", "/run/l4m"}
    assert mounts["/run/l4m"]["Source"] == "/state/sockets"
    assert all(mount["ReadOnly"] for mount in mounts.values())


def test_an_engine_without_seccomp_or_with_it_unconfined_is_refused() -> None:
    assert seccomp_refusal(["name=apparmor", "name=seccomp,profile=builtin", "name=cgroupns"]) == ""
    assert seccomp_refusal(["name=seccomp,profile=default"]) == ""
    assert "no seccomp profile" in seccomp_refusal(["name=apparmor"])
    assert "unconfined" in seccomp_refusal(["name=seccomp,profile=unconfined"])


@pytest.mark.parametrize(("policy", "number"), [(None, os.SCHED_BATCH), ("normal", os.SCHED_OTHER)])
def test_the_controller_runs_under_its_cpu_policy_set_before_the_filter(policy: str | None, number: int) -> None:
    config = DockerSandboxConfig(image="l4m-controller:x", **({} if policy is None else {"cpu_policy": policy}))
    command = container_options(config, SPEC)["command"]
    prefix = seccomp.install_and_exec_argv(number)
    assert command[: len(prefix)] == prefix and prefix[-1] == str(number)
    assert command[len(prefix)] == "python3"
    # The installer sets the policy before the filter goes on: the filter denies setting it.
    script = seccomp.INSTALL_AND_EXEC
    assert script.index("sched_setscheduler") < script.index("prctl(22")


def test_an_unknown_cpu_policy_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown CPU policy 'rr'"):
        DockerSandboxConfig(image="l4m-controller:x", cpu_policy="rr")
