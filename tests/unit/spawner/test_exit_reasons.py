"""How exits become exit reasons: spawner kills first, then kernel counters, then stderr symptoms."""

from __future__ import annotations

import signal

import pytest

from l4m.spawner.sandbox import ExitFacts, ExitReason, Limits, derive_exit_info, split_wait_status

LIMITS = Limits(cpu_time_s=2.0)


def facts(**kwargs: object) -> ExitFacts:
    return ExitFacts(limits=LIMITS, **kwargs)


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (0, (0, None)),
        (1, (1, None)),
        (128, (128, None)),
        (137, (None, 9)),
        (152, (None, 24)),
        (-9, (None, 9)),
    ],
)
def test_statuses_split_into_code_or_signal(status: int, expected: tuple[int | None, int | None]) -> None:
    assert split_wait_status(status) == expected


def test_a_clean_exit_is_exited() -> None:
    info = derive_exit_info(facts(exit_code=0, memory_oom_kills=0, pids_refused=0))
    assert (info.reason, info.exit_code, info.is_limit) == (ExitReason.EXITED, 0, False)


def test_a_non_zero_status_is_a_crash() -> None:
    info = derive_exit_info(facts(exit_code=3, stderr_tail=b"ValueError: nope\n"))
    assert info.reason is ExitReason.CRASHED
    assert info.message == "exited with status 3: ValueError: nope"  # the traceback's last line


def test_a_fatal_signal_is_a_crash_named_after_it() -> None:
    info = derive_exit_info(facts(signal=signal.SIGSEGV))
    assert info.reason is ExitReason.CRASHED
    assert "SIGSEGV" in info.message


def test_the_spawners_kill_reason_wins() -> None:
    info = derive_exit_info(
        facts(signal=9, kill_reason=ExitReason.OUTPUT_LIMIT, kill_message="too much", memory_oom_kills=1)
    )
    assert (info.reason, info.message, info.enforced_by) == (ExitReason.OUTPUT_LIMIT, "too much", "spawner")


def test_an_oom_kill_is_the_memory_limit() -> None:
    info = derive_exit_info(facts(signal=9, memory_oom_kills=1))
    assert (info.reason, info.enforced_by, info.is_limit) == (ExitReason.MEMORY_LIMIT, "cgroup memory", True)


def test_sigxcpu_is_the_cpu_limit() -> None:
    info = derive_exit_info(facts(signal=signal.SIGXCPU))
    assert (info.reason, info.enforced_by) == (ExitReason.CPU_TIME_LIMIT, "rlimit cpu")


def test_sigkill_after_the_cpu_limit_is_the_cpu_limit() -> None:
    assert derive_exit_info(facts(signal=9, cpu_time_s=3.0)).reason is ExitReason.CPU_TIME_LIMIT
    assert derive_exit_info(facts(signal=9, cpu_time_s=0.5)).reason is ExitReason.KILLED


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT])
def test_a_signal_from_outside_that_no_limit_explains_is_killed_not_crashed(sig: int) -> None:
    info = derive_exit_info(facts(signal=sig, cpu_time_s=0.1))
    assert (info.reason, info.signal) == (ExitReason.KILLED, sig)
    assert signal.Signals(sig).name in info.message and "outside the spawner" in info.message


@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL])
def test_a_fault_signal_stays_a_crash(sig: int) -> None:
    assert derive_exit_info(facts(signal=sig)).reason is ExitReason.CRASHED


def test_a_refused_fork_that_ends_the_program_is_the_process_limit() -> None:
    info = derive_exit_info(facts(exit_code=1, pids_refused=12))
    assert (info.reason, info.enforced_by) == (ExitReason.PROCESS_LIMIT, "cgroup pids")


def test_a_refused_fork_the_program_survived_is_still_a_clean_exit() -> None:
    assert derive_exit_info(facts(exit_code=0, pids_refused=12)).reason is ExitReason.EXITED


def test_without_counters_stderr_symptoms_name_the_limit() -> None:
    memory = derive_exit_info(
        facts(exit_code=1, stderr_tail=b"...\nMemoryError\n", memory_mechanism="rlimit as")
    )
    assert (memory.reason, memory.enforced_by) == (ExitReason.MEMORY_LIMIT, "rlimit as")
    fork = b"BlockingIOError: [Errno 11] Resource temporarily unavailable\n"
    processes = derive_exit_info(facts(exit_code=1, stderr_tail=fork, pids_mechanism="rlimit nproc"))
    assert (processes.reason, processes.enforced_by) == (ExitReason.PROCESS_LIMIT, "rlimit nproc")


def test_a_refused_thread_under_rlimits_alone_names_both_limits_that_could_refuse_it() -> None:
    """No cgroup counts: EAGAIN from a thread start is RLIMIT_NPROC's or RLIMIT_AS's (the stack's mapping),
    and the report says it cannot tell (a burst of launches without cgroups hit the second)."""
    abort = b"E1126 thd.cc:157] pthread_create failed: Resource temporarily unavailable\n"
    info = derive_exit_info(facts(signal=6, stderr_tail=abort, pids_mechanism="rlimit nproc",
                                  memory_mechanism="rlimit as"))
    assert (info.reason, info.enforced_by) == (ExitReason.PROCESS_LIMIT, "rlimit nproc or rlimit as")
    assert f"limit of {LIMITS.max_processes} processes" in info.message
    assert f"memory limit of {LIMITS.memory_bytes} bytes" in info.message
    counted = derive_exit_info(facts(signal=6, stderr_tail=abort, pids_mechanism="rlimit nproc"))
    assert counted.enforced_by == "rlimit nproc"  # a memory cgroup: RLIMIT_AS is not set, so it was the count


def test_sandboxes_keep_glibcs_malloc_arenas_few() -> None:
    """Each arena reserves 64 MiB of address space, which RLIMIT_AS counts; and glibc reads the variable at
    start, so a launch that sets it cannot take a warm sandbox."""
    from l4m.spawner.process_command import base_sandbox_env

    assert base_sandbox_env()["MALLOC_ARENA_MAX"] == "2"


def test_symptoms_in_stderr_of_a_clean_exit_are_ignored() -> None:
    assert derive_exit_info(facts(exit_code=0, stderr_tail=b"MemoryError\n")).reason is ExitReason.EXITED


def test_every_exit_reason_has_its_own_value_on_the_wire() -> None:
    from l4m.spawner.server import _EXIT_REASON_TO_PB

    values = [_EXIT_REASON_TO_PB[reason] for reason in ExitReason]
    assert 0 not in values and len(set(values)) == len(values), _EXIT_REASON_TO_PB
