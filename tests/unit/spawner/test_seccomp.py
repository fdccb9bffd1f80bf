"""The seccomp filter, run on a small classic-BPF interpreter: what each system call gets, per arch."""

from __future__ import annotations

import errno
import os
import struct

import pytest

from l4m.spawner import seccomp
from l4m.spawner.seccomp import (
    AARCH64,
    ARCHES,
    CLONE_NAMESPACE_FLAGS,
    DENIED_SYSCALLS,
    SECCOMP_FILTER,
    SECCOMP_RET_ALLOW,
    SECCOMP_RET_ERRNO,
    SECCOMP_RET_KILL_PROCESS,
    X86_64,
    unpack,
)

EPERM = SECCOMP_RET_ERRNO | errno.EPERM
ENOSYS = SECCOMP_RET_ERRNO | errno.ENOSYS
AUDIT_ARCH_I386 = 0x40000003
SIGCHLD = 17
CLONE_THREAD_FLAGS = 0x003D0F00  # what glibc's pthread_create passes to clone
CLONE_NEWUSER = 0x10000000
CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
# Syscalls every controller makes: they must stay allowed.
ALLOWED = ("read", "write", "openat", "mmap", "futex", "socket", "connect", "execve", "wait4", "getpid")
X86_64_ALLOWED = {"read": 0, "write": 1, "openat": 257, "mmap": 9, "futex": 202, "socket": 41, "connect": 42,
                  "execve": 59, "wait4": 61, "getpid": 39}  # fmt: skip


def run_filter(nr: int, arch: int = X86_64.audit_arch, args: tuple[int, ...] = ()) -> int:
    """What the kernel would do with the filter for `struct seccomp_data {nr, arch, ip, args}`."""
    full_args = (*args, *([0] * (6 - len(args))))
    data = struct.pack("=iIQ6Q", nr, arch, 0x401000, *full_args)
    program = unpack(SECCOMP_FILTER)
    accumulator, pc = 0, 0
    while True:
        ins = program[pc]
        if ins.code == seccomp.BPF_LD_W_ABS:
            accumulator = struct.unpack_from("=I", data, ins.k)[0]
            pc += 1
        elif ins.code == seccomp.BPF_RET_K:
            return ins.k
        elif ins.code == seccomp.BPF_JMP_JA:
            pc += 1 + ins.k
        else:
            taken = {
                seccomp.BPF_JMP_JEQ_K: accumulator == ins.k,
                seccomp.BPF_JMP_JGE_K: accumulator >= ins.k,
                seccomp.BPF_JMP_JSET_K: bool(accumulator & ins.k),
            }[ins.code]
            pc += 1 + (ins.jt if taken else ins.jf)


def test_the_program_is_whole_instructions_within_the_kernel_limit() -> None:
    assert len(SECCOMP_FILTER) % 8 == 0
    assert 0 < len(SECCOMP_FILTER) // 8 <= 4096  # BPF_MAXINSNS


@pytest.mark.parametrize("arch", ARCHES, ids=lambda arch: arch.name)
def test_every_denied_syscall_gets_eperm(arch: seccomp.Arch) -> None:
    names = [name for name in DENIED_SYSCALLS if name in arch.syscalls]
    assert len(names) >= len(DENIED_SYSCALLS) - 2  # aarch64 has no iopl/ioperm
    for name in names:
        assert run_filter(arch.syscalls[name], arch.audit_arch) == EPERM, name


@pytest.mark.parametrize("name", ["unshare", "mount", "ptrace", "bpf", "keyctl", "perf_event_open", "setns",
                                  "init_module", "reboot", "process_vm_readv", "userfaultfd"])  # fmt: skip
def test_the_issues_list_is_denied(name: str) -> None:
    assert name in DENIED_SYSCALLS


# sched_getscheduler, setpriority, sched_yield, sched_getattr: reading the policy, lowering one's own
# priority (nice) and yielding stay allowed.
SCHEDULING_ALLOWED = {"x86_64": (145, 141, 24, 315), "aarch64": (120, 140, 124, 275)}


@pytest.mark.parametrize("arch", ARCHES, ids=lambda arch: arch.name)
def test_a_controller_cannot_change_its_cpu_policy_but_may_read_it_and_lower_its_priority(
    arch: seccomp.Arch,
) -> None:
    for name in ("sched_setscheduler", "sched_setattr"):
        assert run_filter(arch.syscalls[name], arch.audit_arch) == EPERM, name
    for nr in SCHEDULING_ALLOWED[arch.name]:
        assert run_filter(nr, arch.audit_arch) == SECCOMP_RET_ALLOW, nr


def test_ordinary_syscalls_are_allowed() -> None:
    for name in ALLOWED:
        assert run_filter(X86_64_ALLOWED[name]) == SECCOMP_RET_ALLOW, name
    assert run_filter(63, AARCH64.audit_arch) == SECCOMP_RET_ALLOW  # read on aarch64


@pytest.mark.parametrize("arch", ARCHES, ids=lambda arch: arch.name)
def test_clone_is_allowed_for_threads_and_fork_but_not_for_namespaces(arch: seccomp.Arch) -> None:
    clone = arch.syscalls["clone"]
    assert run_filter(clone, arch.audit_arch, (CLONE_THREAD_FLAGS,)) == SECCOMP_RET_ALLOW
    assert run_filter(clone, arch.audit_arch, (SIGCHLD,)) == SECCOMP_RET_ALLOW  # fork
    # The high 32 bits of the flags are not namespace flags: still allowed.
    assert run_filter(clone, arch.audit_arch, (SIGCHLD | 1 << 40,)) == SECCOMP_RET_ALLOW
    for flag in (CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWNET, CLONE_NAMESPACE_FLAGS):
        assert run_filter(clone, arch.audit_arch, (SIGCHLD | flag,)) == EPERM, hex(flag)
    bits = [1 << bit for bit in range(32) if CLONE_NAMESPACE_FLAGS & 1 << bit]
    assert len(bits) == 7  # NS, CGROUP, UTS, IPC, USER, PID, NET
    for bit in bits:
        assert run_filter(clone, arch.audit_arch, (CLONE_THREAD_FLAGS | bit,)) == EPERM, hex(bit)


@pytest.mark.parametrize("arch", ARCHES, ids=lambda arch: arch.name)
def test_clone3_says_enosys_so_that_glibc_falls_back_to_clone(arch: seccomp.Arch) -> None:
    assert run_filter(arch.syscalls["clone3"], arch.audit_arch) == ENOSYS


def test_other_arches_and_x32_are_killed() -> None:
    assert run_filter(X86_64_ALLOWED["read"], AUDIT_ARCH_I386) == SECCOMP_RET_KILL_PROCESS
    assert run_filter(3, 0xC0000028) == SECCOMP_RET_KILL_PROCESS  # arm (32-bit)
    assert run_filter(0x40000000 | 0) == SECCOMP_RET_KILL_PROCESS  # x32 read


def test_filter_fd_holds_exactly_the_program_and_is_fresh_each_time() -> None:
    fds = [seccomp.filter_fd(), seccomp.filter_fd()]
    try:
        for fd in fds:
            assert os.get_inheritable(fd)
            data = b""
            while chunk := os.read(fd, 65536):
                data += chunk
            assert data == SECCOMP_FILTER
    finally:
        for fd in fds:
            os.close(fd)
