"""Run a controller program: `python -m l4m.controller PROGRAM [--] [ARGS...]`.

PROGRAM is a `.py` file or a zip with `__main__.py` defining `async def main(ctx)`. The environment
(set by the spawner) says where to connect:

  L4M_SCHEDULER_ADDR   the scheduler (`unix:///run/l4m/scheduler.sock` or `host:port`), required
  L4M_RUNTIME_ADDR     the spawner's RuntimeService; unset = local development (stdout/stdin)
  L4M_RUNTIME_FRAMED_ADDR  where the runtime calls go as frames (`framed:///run/l4m/...`), all but
                       `ctx.vars.watch`; unset: over RuntimeService on gRPC
  L4M_INSTANCE_TOKEN   the instance's token (absent with an anonymous scheduler)
  L4M_INSTANCE_ID      the instance's id
  L4M_MODEL            the model its session serves, by name (`l4m run --model`); unset = the default
  L4M_SHARED_PROCESS_TOKEN  set instead of L4M_INSTANCE_TOKEN and L4M_INSTANCE_ID: this process runs the
                       instances the spawner sends it (`l4m.shared_process`; LaunchRequest.share_process)
  TRACEPARENT          W3C trace context of the launch: the parent of this run's `controller.run` span
  OTEL_*               the standard OpenTelemetry variables; unset = no tracing, at no cost

With tracing on, the whole run is one `controller.run` span (child of TRACEPARENT) and every call to
the scheduler and the runtime carries that span's context, so the scheduler's command spans hang under
it; spans are flushed before the process exits, whatever the exit.

Exit status: 0 success (or the int `main` returned), 1 the program raised, 2 the program could not be
loaded, 3 the scheduler trapped the instance, 4 the scheduler could not be reached or the session broke.

The process then ends without the interpreter's finalization (`exit_now`): the atexit handlers run and
stdout and stderr are flushed, but the modules are not torn down one by one, which cost ~20-27 ms of CPU
per controller with the SDK loaded. A program that leaves a non-daemon thread running gets the normal
exit, which waits for it.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import os
import runpy
import signal
import sys
import threading
import traceback
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from l4m import eventloop
from l4m.errors import ProgramError, SessionClosed, Trapped
from l4m.instance import Instance
from l4m.memory import release_free_memory
from l4m.model import Model
from l4m.runtime import ChildExit, LocalRuntime, Runtime, RuntimeClient
from l4m.session import Session
from l4m.telemetry import configure_tracing, shutdown_tracing
from l4m.wire.tracecontext import context_from_traceparent, traceparent_of

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

EXIT_OK = 0
EXIT_PROGRAM_ERROR = 1
EXIT_LOAD_ERROR = 2
EXIT_TRAPPED = 3
EXIT_SESSION_ERROR = 4
EXIT_TERMINATED = 143  # 128 + SIGTERM

Main = Callable[[Instance], Awaitable[Any]]


@dataclass(frozen=True)
class ControllerConfig:
    """Where a controller connects, from the environment the spawner sets."""

    scheduler_address: str
    runtime_address: str | None
    instance_token: str | None
    instance_id: str
    traceparent: str | None
    runtime_framed_address: str | None = None  # runtime calls as frames (L4M_RUNTIME_FRAMED_ADDR)
    model: str = ""  # the model the session serves (L4M_MODEL); "" = the scheduler's default

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> ControllerConfig:
        address = environ.get("L4M_SCHEDULER_ADDR")
        if not address:
            raise ProgramError("L4M_SCHEDULER_ADDR is not set: point it at the scheduler, e.g. 127.0.0.1:50051")
        return cls(address, environ.get("L4M_RUNTIME_ADDR") or None, environ.get("L4M_INSTANCE_TOKEN") or None,
                   environ.get("L4M_INSTANCE_ID", "local"), environ.get("TRACEPARENT") or None,
                   environ.get("L4M_RUNTIME_FRAMED_ADDR") or None, environ.get("L4M_MODEL", ""))


def load_program(path: str | Path) -> Main:
    """`main` of a `.py` file or of a zip's `__main__.py`."""
    path = Path(path)
    if not path.exists():
        raise ProgramError(f"no program at {path}")
    try:
        namespace = runpy.run_path(str(path), run_name="l4m_program")
    except Exception as error:
        raise ProgramError(f"{path} failed while loading: {type(error).__name__}: {error}") from error
    main = namespace.get("main")
    if main is None or not asyncio.iscoroutinefunction(main):
        raise ProgramError(f"{path} must define `async def main(ctx)`")
    return main


async def run_main(main: Main, args: Sequence[str], session: Session, runtime: Runtime, instance_id: str) -> Any:
    """Connect the model, call `main(ctx)`, close the session (freeing everything the instance held)."""
    instance = None
    try:
        model = await Model.load(session)
        instance = Instance(args, model, runtime, instance_id)
        release_free_memory()
        return await main(instance)
    finally:
        if instance is not None:
            await instance.close_other_models()
        failure = session.failure
        await session.close()
        if isinstance(failure, Trapped):
            raise failure


async def run_program(program: str, args: Sequence[str], config: ControllerConfig) -> Any:
    return await run_loaded(load_program(program), program, args, config)


async def run_loaded(main: Main, program: str, args: Sequence[str], config: ControllerConfig) -> Any:
    """`run_main` with the session and runtime `config` names (`program`: what a local child runs)."""
    if config.runtime_address:
        runtime: Runtime = RuntimeClient(config.runtime_address, config.instance_token, config.traceparent,
                                         framed_address=config.runtime_framed_address)
    else:
        runtime = LocalRuntime(launch_child=_local_child_launcher(program, config))
    session = await Session.connect(config.scheduler_address, config.instance_token, config.traceparent,
                                           model=config.model)
    try:
        return await run_main(main, args, session, runtime, config.instance_id)
    finally:
        await runtime.close()


def _local_child_launcher(parent_program: str, config: ControllerConfig) -> Callable[..., Awaitable[ChildExit]]:
    """Development: a child runs in this process, with its own session to the same scheduler."""

    async def launch(program: str, args: Sequence[str], runtime: LocalRuntime) -> ChildExit:
        try:
            main = load_program(program or parent_program)
            session = await Session.connect(config.scheduler_address, config.instance_token, config.traceparent,
                                           model=config.model)
            result = await run_main(main, args, session, runtime, runtime.instance_id)
        except Trapped as trap:
            return ChildExit("EXIT_REASON_TRAPPED", EXIT_TRAPPED, str(trap))
        except Exception as error:  # a child's failure is its parent's information, not its crash
            traceback.print_exc()
            return ChildExit("EXIT_REASON_EXITED", EXIT_PROGRAM_ERROR, f"{type(error).__name__}: {error}")
        return ChildExit("EXIT_REASON_EXITED", result if isinstance(result, int) else EXIT_OK, "")

    return launch


@contextlib.contextmanager
def run_span(config: ControllerConfig, program: str, tracer: Tracer | None = None) -> Iterator[ControllerConfig]:
    """The `controller.run` span around the whole run; yields `config` with the span as its traceparent.

    An exception leaving the block marks the span as failed; without a tracer provider the span is the
    API's no-op one and `config` comes back unchanged."""
    from opentelemetry import trace  # lazily: a run without tracing never imports OpenTelemetry

    tracer = tracer or trace.get_tracer("l4m.controller")
    attributes = {"l4m.instance_id": config.instance_id, "l4m.program": Path(program).name}
    parent = context_from_traceparent(config.traceparent or "")
    with tracer.start_as_current_span("controller.run", context=parent, attributes=attributes):
        traceparent, _ = traceparent_of()
        yield dataclasses.replace(config, traceparent=traceparent or config.traceparent)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # SystemExit unwinds through the run span and the flush below; the default action would lose both.
    raise SystemExit(EXIT_TERMINATED)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__, file=sys.stderr)
        return EXIT_LOAD_ERROR
    program, args = argv[0], argv[1:]
    if args[:1] == ["--"]:
        args = args[1:]
    environ = os.environ if environ is None else environ
    process_token = environ.get("L4M_SHARED_PROCESS_TOKEN")
    if process_token:
        return _serve_shared(program, environ, process_token)
    is_tracing = configure_tracing("l4m.controller", environ)
    if is_tracing:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return _run(program, args, environ, is_tracing)
    finally:
        if is_tracing:
            shutdown_tracing()


def _config_of(environ: Mapping[str, str]) -> ControllerConfig:
    """The environment's settings, its event loop's name checked; ProgramError says what is wrong."""
    config = ControllerConfig.from_env(environ)
    try:
        eventloop.loop_name(environ)
    except ValueError as error:
        raise ProgramError(str(error)) from None
    return config


def _run(program: str, args: Sequence[str], environ: Mapping[str, str], is_tracing: bool = True) -> int:
    try:
        config = _config_of(environ)
        # Untraced, the span would be the no-op one and leave `config` as it is: skip it, and its import.
        span = run_span(config, program) if is_tracing else contextlib.nullcontext(config)
        with span as traced_config:
            result = eventloop.run(run_program(program, args, traced_config), environ)
    except KeyboardInterrupt:
        return 130
    except Exception as error:
        return failure_status(error)
    return result_status(result)


def _serve_shared(program: str, environ: Mapping[str, str], process_token: str) -> int:
    """A shared process (`l4m.shared_process`): the program loaded once, its instances sent by the spawner."""
    from l4m import shared_process

    try:
        config = shared_process.process_config(_config_of(environ))
        main = load_program(program)
    except ProgramError as error:
        print(f"l4m.controller: {error}", file=sys.stderr)
        return EXIT_LOAD_ERROR
    is_tracing = configure_tracing("l4m.controller", environ)  # each instance's run is its own span
    try:
        return eventloop.run(shared_process.serve(main, program, config, process_token, is_tracing), environ)
    finally:
        if is_tracing:
            shutdown_tracing()


def failure_status(error: Exception) -> int:
    """The exit status of a run that `error` ended, after saying why on stderr (a trap or a session that
    broke in one line, which the spawner reads back; another exception with its traceback)."""
    if isinstance(error, ProgramError):
        print(f"l4m.controller: {error}", file=sys.stderr)
        return EXIT_LOAD_ERROR
    if isinstance(error, Trapped):
        print(f"l4m.controller: trapped: {error}", file=sys.stderr)
        return EXIT_TRAPPED
    if isinstance(error, SessionClosed):
        print(f"l4m.controller: {error}", file=sys.stderr)
        return EXIT_SESSION_ERROR
    traceback.print_exception(error)
    return EXIT_PROGRAM_ERROR


def result_status(result: Any) -> int:
    """The exit status of a run whose `main` returned `result`: an int is the status, anything else 0."""
    return result if isinstance(result, int) and not isinstance(result, bool) else EXIT_OK


def exit_now(code: int) -> NoReturn:
    """Ends the process with `code`, skipping the interpreter's finalization. What of a normal exit
    matters to a controller, whose sandbox is destroyed after it, is done first: the atexit handlers
    (the program's, logging's), then stdout and stderr flushed. With a non-daemon thread still running
    this is a normal exit, which waits for the thread."""
    main_thread = threading.main_thread()
    if any(t is not main_thread and not t.daemon and t.is_alive() for t in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
