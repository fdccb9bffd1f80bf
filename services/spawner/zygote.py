"""What a warm sandbox runs: import the SDK ahead of demand, then become exactly one launch.

The process backend starts this file in a sandbox (bubblewrap, the pool's uid, cgroups and rlimits at
the pool's ceilings, idle CPU priority until the launch), bound read-only at /opt/l4m/zygote/zygote.py,
and keeps it in its warm pool:

    python /opt/l4m/zygote/zygote.py MODULE...

1. Imports each MODULE (the runner and the SDK: grpc, protobuf, numpy...), the part of a launch that
   costs time. A module that is not installed is skipped: the program meets the same ImportError as
   it would on a cold start.
2. Writes `READY_LINE` on stdout and blocks on stdin.
3. Reads one launch until end of file: a JSON object (see `Launch`). By then the spawner has set the
   launch's cgroup limits and placed the program in /opt/l4m/program (a read-only bind of a directory
   only this sandbox has).
4. Lowers its rlimits to the launch's (only lowering is possible: the sandbox holds no capability),
   with RLIMIT_CPU counted from the CPU time the imports already used; takes the launch's environment;
   points stdin at /dev/null; sets sys.argv and sys.path[0] as `python [-m RUNNER] PROGRAM ARGS` would.
5. Writes `GO_LINE` on stdout, then runs the program in this process. It never waits again: when the
   program ends, the sandbox ends.

Anything wrong before GO exits with `EXIT_BAD_LAUNCH` and a line on stderr; the spawner then destroys
this sandbox and starts the launch cold. Standard library only: it runs before anything else is known
to import cleanly.
"""

import importlib
import json
import math
import os
import resource
import runpy
import sys

READY_LINE = b"l4m-zygote: ready\n"
GO_LINE = b"l4m-zygote: go\n"
EXIT_BAD_LAUNCH = 125
MAX_LAUNCH_BYTES = 4 * 1024 * 1024
_LOWERED_RLIMITS = ("RLIMIT_NOFILE", "RLIMIT_NPROC", "RLIMIT_FSIZE", "RLIMIT_CORE", "RLIMIT_AS")


def warm_up(modules: list[str]) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            continue


def read_launch(fd: int = 0) -> dict:
    """The launch the spawner wrote on `fd`, through end of file."""
    chunks = []
    size = 0
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_LAUNCH_BYTES:
            raise ValueError(f"the launch is larger than {MAX_LAUNCH_BYTES} bytes")
    if not chunks:
        raise EOFError("the spawner closed the pool before handing over a launch")
    launch = json.loads(b"".join(chunks))
    for key, kind in (("program", str), ("args", list), ("env", dict), ("runner", str),
                      ("cpu_time_s", int), ("rlimits", dict)):  # fmt: skip
        if not isinstance(launch.get(key), kind):
            raise ValueError(f"the launch's {key!r} is missing or not a {kind.__name__}")
    return launch


def lower_rlimits(cpu_time_s: int, rlimits: dict) -> None:
    """RLIMIT_CPU counts this process's CPU time since it started: the launch gets `cpu_time_s` more
    than the imports used, as a cold start gets `cpu_time_s` from zero (soft: SIGXCPU, hard one later:
    SIGKILL)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used_s = math.ceil(usage.ru_utime + usage.ru_stime)
    resource.setrlimit(resource.RLIMIT_CPU, (used_s + cpu_time_s, used_s + cpu_time_s + 1))
    for name, (soft, hard) in rlimits.items():
        if name not in _LOWERED_RLIMITS:
            raise ValueError(f"unexpected rlimit {name!r}")
        resource.setrlimit(getattr(resource, name), (soft, hard))


def become(launch: dict) -> None:
    """Everything but running: after this, the process is what a cold start would have exec'd."""
    program = launch["program"]
    if not os.path.isfile(program):
        raise FileNotFoundError(f"the program {program} is not in the sandbox")
    os.environ.update(launch["env"])
    lower_rlimits(launch["cpu_time_s"], launch["rlimits"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    # `python -m RUNNER PROGRAM ARGS` gives RUNNER argv [its own file, PROGRAM, ARGS] (runpy sets the
    # first) and the working directory first on sys.path; `python PROGRAM ARGS` gives [PROGRAM, ARGS]
    # and the program's directory (a zip is put there by runpy itself).
    runner = launch["runner"]
    sys.argv = [runner, program, *launch["args"]] if runner else [program, *launch["args"]]
    sys.path[0] = os.getcwd() if runner else os.path.dirname(program)


def run(launch: dict) -> None:
    if launch["runner"]:
        # The warm-up imported the runner only for its dependencies. A cold `python -m RUNNER` runs it as
        # __main__ without it being in sys.modules; forgetting it here gives the same (and spares the
        # program's stderr runpy's "found in sys.modules" warning).
        sys.modules.pop(launch["runner"], None)
        runpy.run_module(launch["runner"], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(launch["program"], run_name="__main__")


def main() -> None:
    warm_up(sys.argv[1:])
    os.write(1, READY_LINE)
    try:
        launch = read_launch()
        become(launch)
    except EOFError:
        sys.exit(0)
    except Exception as error:  # noqa: BLE001 - any failure before GO is a bad launch, said on stderr
        os.write(2, f"l4m-zygote: bad launch: {type(error).__name__}: {error}\n".encode())
        sys.exit(EXIT_BAD_LAUNCH)
    os.write(1, GO_LINE)
    run(launch)


if __name__ == "__main__":
    main()
