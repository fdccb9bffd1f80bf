"""The seccomp filter every process sandbox runs under, as a classic BPF program built in Python.

bubblewrap installs it (`bwrap --seccomp FD`, the program's bytes read from FD) right before it
execs the sandbox's first process, after setting no_new_privs, so it binds everything the sandbox
ever runs, warm sandboxes included, and nothing can remove it. The docker backend runs the controller
through `install_and_exec_argv`, which installs it on top of the engine's default profile. The sandbox runs as a host uid with no
capability, so most of what it denies would fail anyway; the filter is for what an unprivileged
process may still do and is the kernel's attack surface: a new user namespace (in which it is root,
and may mount filesystems), ptrace of its own processes, BPF, keyrings, perf, io_uring.

The program, per system call:

    load the audit arch        not x86-64 or aarch64 (i386 on x86-64 included)  -> kill the process
    load the syscall number    x86-64's x32 range (bit 30 set)                  -> kill the process
                               one of DENIED_SYSCALLS                            -> errno EPERM
                               clone with any CLONE_NEW* flag in its flags (arg 0) -> errno EPERM
                               clone3 (its flags sit in memory, where BPF cannot look)
                                                                                 -> errno ENOSYS
    everything else                                                              -> allow

clone3 answers ENOSYS rather than EPERM so that glibc (and anything else written for kernels that
lack it) falls back to clone, whose flags the filter can read; threads and fork keep working.
Standard library only.
"""

from __future__ import annotations

import errno
import os
import struct
from dataclasses import dataclass

# Classic BPF opcodes (linux/bpf_common.h) and seccomp's return values and data layout
# (linux/seccomp.h, linux/audit.h).
BPF_LD_W_ABS = 0x00 | 0x00 | 0x20  # BPF_LD | BPF_W | BPF_ABS
BPF_JMP_JA = 0x05 | 0x00  # BPF_JMP | BPF_JA
BPF_JMP_JEQ_K = 0x05 | 0x10 | 0x00  # BPF_JMP | BPF_JEQ | BPF_K
BPF_JMP_JGE_K = 0x05 | 0x30 | 0x00  # BPF_JMP | BPF_JGE | BPF_K
BPF_JMP_JSET_K = 0x05 | 0x40 | 0x00  # BPF_JMP | BPF_JSET | BPF_K
BPF_RET_K = 0x06 | 0x00  # BPF_RET | BPF_K

SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_ALLOW = 0x7FFF0000

OFFSET_NR = 0  # struct seccomp_data { int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]; }
OFFSET_ARCH = 4
OFFSET_ARG0_LOW = 16  # both arches are little-endian: the low 32 bits of args[0] come first

AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_AARCH64 = 0xC00000B7
X32_SYSCALL_BIT = 0x40000000

# Every CLONE_NEW* flag clone() takes (CLONE_NEWTIME, 0x80, exists only for clone3 and unshare: in
# clone's flags that bit belongs to the exit signal).
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NAMESPACE_FLAGS = (
    CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
)

# Denied with EPERM, by what they would give a controller.
DENIED_SYSCALLS = (
    # namespaces and mounts: a user namespace makes the sandbox root again, with mounts of its own
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "mount_setattr",
    "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree",
    # other processes' memory (the sandbox's processes share a uid)
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd",
    # kernel attack surface an unprivileged process can still reach
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key",
    # the CPU policy the spawner set (sandbox.CPU_POLICIES): an unprivileged thread may switch itself
    # from SCHED_BATCH back to SCHED_OTHER, and from then on preempt the executor's threads when it wakes
    "sched_setscheduler", "sched_setattr",
    # privileged anyway: denied so that a kernel bug in their permission checks is not reachable
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot",
    "swapon", "swapoff", "open_by_handle_at", "name_to_handle_at", "quotactl", "acct", "syslog",
    "settimeofday", "clock_settime", "clock_adjtime", "vhangup", "lookup_dcookie", "iopl", "ioperm",
)  # fmt: skip


@dataclass(frozen=True)
class Arch:
    name: str
    audit_arch: int
    syscalls: dict[str, int]  # every name in DENIED_SYSCALLS the arch has, clone and clone3


# From the kernel's uapi tables (asm/unistd_64.h on x86-64; asm-generic/unistd.h on aarch64, which has
# no iopl/ioperm).
X86_64 = Arch(
    "x86_64",
    AUDIT_ARCH_X86_64,
    {
        "unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
        "mount_setattr": 442, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "move_mount": 429, "open_tree": 428, "ptrace": 101, "process_vm_readv": 310,
        "process_vm_writev": 311, "pidfd_getfd": 438, "bpf": 321, "perf_event_open": 298,
        "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "keyctl": 250, "add_key": 248, "request_key": 249, "init_module": 175, "finit_module": 313,
        "delete_module": 176, "kexec_load": 246, "kexec_file_load": 320, "reboot": 169, "swapon": 167,
        "swapoff": 168, "open_by_handle_at": 304, "name_to_handle_at": 303, "quotactl": 179, "acct": 163,
        "syslog": 103, "settimeofday": 164, "clock_settime": 227, "clock_adjtime": 305, "vhangup": 153,
        "lookup_dcookie": 212, "iopl": 172, "ioperm": 173, "sched_setscheduler": 144, "sched_setattr": 314,
        "clone": 56, "clone3": 435,
    },
)  # fmt: skip
AARCH64 = Arch(
    "aarch64",
    AUDIT_ARCH_AARCH64,
    {
        "unshare": 97, "setns": 268, "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51,
        "mount_setattr": 442, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "move_mount": 429, "open_tree": 428, "ptrace": 117, "process_vm_readv": 270,
        "process_vm_writev": 271, "pidfd_getfd": 438, "bpf": 280, "perf_event_open": 241,
        "userfaultfd": 282, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "keyctl": 219, "add_key": 217, "request_key": 218, "init_module": 105, "finit_module": 273,
        "delete_module": 106, "kexec_load": 104, "kexec_file_load": 294, "reboot": 142, "swapon": 224,
        "swapoff": 225, "open_by_handle_at": 265, "name_to_handle_at": 264, "quotactl": 60, "acct": 89,
        "syslog": 116, "settimeofday": 170, "clock_settime": 112, "clock_adjtime": 266, "vhangup": 58,
        "lookup_dcookie": 18, "sched_setscheduler": 119, "sched_setattr": 274, "clone": 220, "clone3": 435,
    },
)  # fmt: skip
ARCHES = (X86_64, AARCH64)


@dataclass(frozen=True)
class Instruction:
    """One `struct sock_filter`."""

    code: int
    jt: int
    jf: int
    k: int

    def pack(self) -> bytes:
        return struct.pack("=HBBI", self.code, self.jt, self.jf, self.k)


def unpack(program: bytes) -> list[Instruction]:
    return [Instruction(*fields) for fields in struct.iter_unpack("=HBBI", program)]


class _Assembler:
    """Instructions whose jumps name labels; `assemble` resolves them to the forward offsets BPF
    wants (a conditional jump reaches at most 255 instructions ahead)."""

    def __init__(self) -> None:
        self._code: list[tuple[int, str | int, str | int, int]] = []
        self._labels: dict[str, int] = {}

    def label(self, name: str) -> None:
        self._labels[name] = len(self._code)

    def load(self, offset: int) -> None:
        self._code.append((BPF_LD_W_ABS, 0, 0, offset))

    def jump(self, code: int, k: int, jt: str | int = 0, jf: str | int = 0) -> None:
        self._code.append((code, jt, jf, k))

    def ret(self, value: int) -> None:
        self._code.append((BPF_RET_K, 0, 0, value))

    def assemble(self) -> bytes:
        program = b""
        for index, (code, jt, jf, k) in enumerate(self._code):
            offsets = [
                self._labels[target] - index - 1 if isinstance(target, str) else target for target in (jt, jf)
            ]
            if not all(0 <= offset <= 255 for offset in offsets):
                raise ValueError(f"instruction {index}: a jump out of reach ({offsets})")
            program += Instruction(code, offsets[0], offsets[1], k).pack()
        return program


def build_filter() -> bytes:
    """The program (a sequence of `struct sock_filter`), as bwrap's --seccomp reads it."""
    asm = _Assembler()
    asm.load(OFFSET_ARCH)
    for arch in ARCHES:
        asm.jump(BPF_JMP_JEQ_K, arch.audit_arch, jt=arch.name)
    asm.ret(SECCOMP_RET_KILL_PROCESS)
    for arch in ARCHES:
        asm.label(arch.name)
        asm.load(OFFSET_NR)
        if arch is X86_64:
            asm.jump(BPF_JMP_JGE_K, X32_SYSCALL_BIT, jt="kill")
        for name in DENIED_SYSCALLS:
            if name in arch.syscalls:
                asm.jump(BPF_JMP_JEQ_K, arch.syscalls[name], jt="eperm")
        asm.jump(BPF_JMP_JEQ_K, arch.syscalls["clone"], jt="clone")
        asm.jump(BPF_JMP_JEQ_K, arch.syscalls["clone3"], jt="enosys")
        asm.ret(SECCOMP_RET_ALLOW)
    asm.label("clone")
    asm.load(OFFSET_ARG0_LOW)
    asm.jump(BPF_JMP_JSET_K, CLONE_NAMESPACE_FLAGS, jt="eperm")
    asm.ret(SECCOMP_RET_ALLOW)
    asm.label("eperm")
    asm.ret(SECCOMP_RET_ERRNO | errno.EPERM)
    asm.label("enosys")
    asm.ret(SECCOMP_RET_ERRNO | errno.ENOSYS)
    asm.label("kill")
    asm.ret(SECCOMP_RET_KILL_PROCESS)
    return asm.assemble()


SECCOMP_FILTER = build_filter()


# Sets the CPU policy (SCHED_OTHER or SCHED_BATCH, by number), installs the filter in the process itself
# and execs the rest of its argv, for a backend that cannot do either from outside (Docker: the engine
# installs its default profile; this one stacks on top, and the kernel applies both, the stricter
# answer winning). The policy comes first: the filter denies changing it. Needs no_new_privs already
# set (the container's no-new-privileges). -I -S: nothing but the standard library, and quickly.
#     python3 -I -S -c INSTALL_AND_EXEC FILTER_HEX POLICY COMMAND...
INSTALL_AND_EXEC = """
import ctypes, os, sys
os.sched_setscheduler(0, int(sys.argv[2]), os.sched_param(0))
program = bytes.fromhex(sys.argv[1])
buffer = ctypes.create_string_buffer(program, len(program))
class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
fprog = Fprog(len(program) // 8, ctypes.addressof(buffer))
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
if libc.prctl(22, 2, ctypes.addressof(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
    sys.exit("l4m: could not install the seccomp filter: " + os.strerror(ctypes.get_errno()))
os.execvp(sys.argv[3], sys.argv[3:])
"""


def install_and_exec_argv(policy: int, python: str = "python3") -> list[str]:
    """The argv prefix that runs what follows it under CPU policy `policy` and the filter (see
    INSTALL_AND_EXEC)."""
    return [python, "-I", "-S", "-c", INSTALL_AND_EXEC, SECCOMP_FILTER.hex(), str(policy)]


def filter_fd() -> int:
    """A fresh read end of a pipe holding the program, for one bwrap to read through end of file (each
    sandbox needs its own: reading consumes it). Inheritable; the caller closes it once bwrap started."""
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, SECCOMP_FILTER)  # a few hundred bytes: far below a pipe's buffer
    finally:
        os.close(write_fd)
    os.set_inheritable(read_fd, True)
    return read_fd
