"""The `l4m` command. Subcommands live in `SUBCOMMANDS`: name -> (help, add_arguments, run); another
module adds one with `register(...)` (e.g. `up`, `demo`, service launchers).

  l4m run FILE [--spawner ADDR] [-- ARGS...]   upload a controller, stream its output, exit with its status
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from l4m.errors import L4MError

DEFAULT_SPAWNER_ADDR = "127.0.0.1:7410"  # where `l4m up` puts it


@dataclass(frozen=True)
class Subcommand:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


SUBCOMMANDS: dict[str, Subcommand] = {}


def register(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None],
             run: Callable[[argparse.Namespace], int]) -> None:
    SUBCOMMANDS[name] = Subcommand(help, add_arguments, run)


# ---- l4m run ---------------------------------------------------------------------------------------
def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="controller program: a .py file or a zip with __main__.py")
    parser.add_argument("--spawner", default=os.environ.get("L4M_SPAWNER_ADDR", DEFAULT_SPAWNER_ADDR),
                        help="spawner address host:port (env L4M_SPAWNER_ADDR)")
    parser.add_argument("--quiet-logs", action="store_true", help="do not show the controller's log lines")
    parser.add_argument("args", nargs="*", help="arguments for the controller (after --)")


def _run(options: argparse.Namespace) -> int:
    from l4m import telemetry
    from l4m.client import run_program

    if not telemetry.configure_tracing("l4m.cli"):
        return asyncio.run(run_program(options.spawner, options.file, options.args, show_logs=not options.quiet_logs))
    # Traced: the launch becomes a child of this `l4m.run` span (Launch carries its traceparent).
    from opentelemetry import trace

    try:
        with trace.get_tracer("l4m.cli").start_as_current_span("l4m.run", attributes={"l4m.program": options.file}) as span:
            status = asyncio.run(
                run_program(options.spawner, options.file, options.args, show_logs=not options.quiet_logs)
            )
            span.set_attribute("l4m.exit_status", status)
            return status
    finally:
        telemetry.shutdown_tracing()


register("run", "upload a controller to a running cluster, stream its output, exit with its status",
         _add_run_arguments, _run)


# ---- l4m up / l4m demo ------------------------------------------------------------------------------
def _add_up_arguments(parser: argparse.ArgumentParser) -> None:
    from l4m.up import add_cluster_arguments

    add_cluster_arguments(parser)


def _add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    from l4m.up import DEMO_PROMPT, add_cluster_arguments

    add_cluster_arguments(parser)
    parser.add_argument("--prompt", default=DEMO_PROMPT, help="what to ask the model")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")


def _up(options: argparse.Namespace) -> int:
    from l4m.up import run_up

    return run_up(options)


def _demo(options: argparse.Namespace) -> int:
    from l4m.up import run_demo

    return run_demo(options)


register("up", "start scheduler, executor(s) and spawner on this machine; Ctrl-C stops them", _add_up_arguments, _up)
register("demo", "start a cluster, run the text-completion controller, print its output, stop", _add_demo_arguments,
         _demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="l4m", description="l4m: a programmable LLM serving cluster")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, subcommand in SUBCOMMANDS.items():
        subcommand.add_arguments(commands.add_parser(name, help=subcommand.help, description=subcommand.help))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first `--` belongs to the controller, options included.
    passthrough = argv[argv.index("--") + 1:] if "--" in argv else []
    options = build_parser().parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if hasattr(options, "args"):
        options.args = list(options.args) + passthrough
    try:
        return SUBCOMMANDS[options.command].run(options)
    except L4MError as error:
        print(f"l4m: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
