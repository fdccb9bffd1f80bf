"""The `l4m` command. Subcommands live in `SUBCOMMANDS`: name -> (help, add_arguments, run); another
module adds one with `register(...)` (e.g. `up`, `demo`, service launchers).

  l4m run FILE [--spawner ADDR] [LIMITS] [-- ARGS...]   upload a controller, stream its output, exit with its
                                                        status (its own code, 3 when trapped, 1 other ends);
                                                        Ctrl-C ends the instance
  l4m run --detach FILE ...                             launch it to run on without a client; print its id
  l4m run --share-process FILE ...                      let it share a controller process with your other
                                                        running launches of FILE that set it (same model, limits)
  l4m attach ID                                         stream an instance's output, exit with its status
  l4m ps [--all]                                        your instances (an admin's: all), with their shared process
  l4m stop ID...                                        end instances (detached ones too)
  l4m store FILE [--tag NAME[:TAG]]                     store a controller without running it; print its sha256
  l4m keys add|list|remove                              the spawner's API keys (see l4m.keys)

Credentials: the API key comes from --api-key-file, env L4M_API_KEY (the key) or L4M_API_KEY_FILE, else
`<state dir>/admin.key` (written by `l4m up`); --tls-ca (env L4M_TLS_CA) talks TLS to the spawner.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from l4m.errors import L4MError

if TYPE_CHECKING:
    from l4m.v1 import spawner_pb2

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
MiB = 1024 * 1024


@dataclass(frozen=True)
class LimitFlag:
    """`l4m run --NAME VALUE`: one field of the launch's `spawner_pb2.Limits`, in friendlier units."""

    name: str  # the flag, after `--`
    field: str  # the Limits field
    scale: int  # field units per flag unit
    kind: type
    metavar: str
    help: str


LIMIT_FLAGS = (
    LimitFlag("wall-time-s", "wall_time_ms", 1000, float, "S", "seconds from launch to a forced end"),
    LimitFlag("cpu-time-s", "cpu_time_ms", 1000, float, "S", "CPU seconds of the controller's processes"),
    LimitFlag("memory-mib", "memory_bytes", MiB, int, "MIB", "memory of the controller's processes"),
    LimitFlag("max-output-mib", "max_output_bytes", MiB, int, "MIB", "messages and log lines together"),
    LimitFlag("token-budget", "max_tokens", 1, int, "N",
              "the instance's token budget: tokens it may feed through forward passes in all (Limits.max_tokens; "
              "a controller's own length flag, like text_completion.py's --max-tokens, goes after `--`)"),
    LimitFlag("max-children", "max_children", 1, int, "N", "child controllers the launch tree may spawn"),
)


def _positive(kind: type) -> Callable[[str], float | int]:
    def parse(text: str) -> float | int:
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not value > 0 or value == float("inf"):  # NaN fails `> 0`
            raise argparse.ArgumentTypeError(
                f"{text} must be a finite number > 0 (leave the flag out for the spawner's default)")
        return value

    return parse


class _AmbiguousMaxTokens(argparse.Action):
    """`l4m run --max-tokens` was the token budget, easily mistaken for a controller's length flag."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        parser.error("--max-tokens is not an `l4m run` flag: for the instance's token budget (all tokens it may "
                     "feed) use --token-budget N; for the controller's own --max-tokens (a length), put it after "
                     "`--`, e.g. `l4m run FILE -- --max-tokens 64 PROMPT`")


def _add_spawner_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spawner", default=os.environ.get("L4M_SPAWNER_ADDR", DEFAULT_SPAWNER_ADDR),
                        help="spawner address host:port (env L4M_SPAWNER_ADDR)")
    parser.add_argument("--api-key-file", default=None,
                        help="file holding the API key (else env L4M_API_KEY, env L4M_API_KEY_FILE, "
                             "or <state dir>/admin.key from `l4m up`)")
    parser.add_argument("--tls-ca", default=os.environ.get("L4M_TLS_CA") or None,
                        help="CA certificate (PEM) to talk TLS to the spawner (env L4M_TLS_CA)")
    parser.add_argument("--quiet-logs", action="store_true", help="do not show the controller's log lines")


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="controller program: a .py file or a zip with __main__.py")
    _add_spawner_arguments(parser)
    parser.add_argument("--detach", action="store_true",
                        help="launch it to run on without a client, print its id and exit (`l4m attach ID` "
                             "follows it later); otherwise Ctrl-C or a lost connection ends the instance")
    parser.add_argument("--model", default="", help="the model the controller's session serves, by name (`l4m up` "
                        "prints the served ones); default: the cluster's first model")
    parser.add_argument("--share-process", action="store_true",
                        help="let it run in one controller process with your other running launches of this program "
                             "that set it (same model and limits): no sandbox start of its own, and fewer wake-ups "
                             "per token; they share that process's limits and fate (a crash ends them all)")
    parser.add_argument("--max-tokens", nargs="?", action=_AmbiguousMaxTokens, help=argparse.SUPPRESS)
    limits = parser.add_argument_group("limits of this launch (left out: the spawner's default; above the "
                                       "spawner's maximum: refused)")
    for flag in LIMIT_FLAGS:
        limits.add_argument(f"--{flag.name}", dest=flag.field, type=_positive(flag.kind), metavar=flag.metavar,
                            help=flag.help)
    parser.add_argument("args", nargs="*", help="arguments for the controller (after --)")


def launch_limits(options: argparse.Namespace) -> spawner_pb2.Limits | None:
    """The limits asked for on the command line; None when none was (the spawner's defaults apply)."""
    from l4m.v1 import spawner_pb2

    fields = {flag.field: round(getattr(options, flag.field) * flag.scale) for flag in LIMIT_FLAGS
              if getattr(options, flag.field, None) is not None}
    return spawner_pb2.Limits(**fields) if fields else None


def api_key_of(options: argparse.Namespace) -> str | None:
    from l4m.client import find_api_key
    from l4m.keys import ADMIN_KEY_FILE_NAME
    from l4m.up import default_state_dir

    return find_api_key(options.api_key_file, default_file=default_state_dir() / ADMIN_KEY_FILE_NAME)


def _run(options: argparse.Namespace) -> int:
    from l4m import telemetry
    from l4m.client import launch_detached, run_program

    credentials = {"api_key": api_key_of(options), "tls_ca": options.tls_ca, "model": options.model,
                   "share_process": options.share_process}
    if options.detach:
        print(asyncio.run(launch_detached(options.spawner, options.file, options.args, launch_limits(options),
                                          **credentials)), flush=True)
        return 0

    def run() -> int:
        return asyncio.run(run_program(options.spawner, options.file, options.args,
                                       show_logs=not options.quiet_logs, limits=launch_limits(options),
                                       **credentials))

    if not telemetry.configure_tracing("l4m.cli"):
        return run()
    # Traced: the launch becomes a child of this `l4m.run` span (Launch carries its traceparent).
    from opentelemetry import trace

    try:
        with trace.get_tracer("l4m.cli").start_as_current_span("l4m.run", attributes={"l4m.program": options.file}) as span:
            status = run()
            span.set_attribute("l4m.exit_status", status)
            return status
    finally:
        telemetry.shutdown_tracing()


register("run", "upload a controller to a running cluster, stream its output, exit with its status",
         _add_run_arguments, _run)


# ---- l4m attach ----------------------------------------------------------------------------------
def _add_attach_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("instance_id", metavar="ID", help="the instance (as `l4m run --detach` printed it)")
    _add_spawner_arguments(parser)


def _attach(options: argparse.Namespace) -> int:
    from l4m.client import attach_program

    return asyncio.run(attach_program(options.spawner, options.instance_id, show_logs=not options.quiet_logs,
                                      api_key=api_key_of(options), tls_ca=options.tls_ca))


register("attach", "stream a running instance's output from its start and exit with its status (Ctrl-C "
         "leaves a detached instance running, and ends one launched without --detach)", _add_attach_arguments,
         _attach)


# ---- l4m ps / l4m stop ---------------------------------------------------------------------------
def _add_ps_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--all", action="store_true", help="ended instances too (the spawner keeps them a while)")
    _add_spawner_arguments(parser)


def format_instances(instances: Sequence[spawner_pb2.InstanceInfo], now_ms: int, show_exited: bool = False) -> str:
    """`l4m ps`'s table, oldest launch first: PROCESS is the shared controller process an instance runs in
    (`--share-process`; "-": a process of its own), STATUS how an ended one ended."""
    from l4m.v1 import spawner_pb2

    rows = [("ID", "USER", "STATUS", "AGE", "PROGRAM", "PROCESS", "PARENT", "ARGS")]
    for info in sorted(instances, key=lambda i: (i.launched_at_unix_ms, i.instance_id)):
        if info.state == spawner_pb2.INSTANCE_STATE_EXITED and not show_exited:
            continue
        if info.state == spawner_pb2.INSTANCE_STATE_EXITED:
            reason = spawner_pb2.ExitReason.Name(info.exit.reason).removeprefix("EXIT_REASON_").lower()
            status = f"{reason} ({info.exit.exit_code})" if info.exit.exit_code else reason
        else:
            status = spawner_pb2.InstanceState.Name(info.state).removeprefix("INSTANCE_STATE_").lower()
        args = " ".join(info.args)
        rows.append((info.instance_id, info.user or "-", status, _age(now_ms - info.launched_at_unix_ms),
                     info.program_sha256[:12], info.shared_process or "-", info.parent_instance_id or "-",
                     args if len(args) <= 40 else args[:39] + "…"))
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[-1]
                     for row in rows)


def _age(ms: int) -> str:
    seconds = max(ms, 0) // 1000
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h"


def _ps(options: argparse.Namespace) -> int:
    import time

    from l4m.client import Client

    async def listed() -> list[spawner_pb2.InstanceInfo]:
        async with Client(options.spawner, api_key=api_key_of(options), tls_ca=options.tls_ca) as client:
            return await client.list_instances()

    print(format_instances(asyncio.run(listed()), int(time.time() * 1000), options.all), flush=True)
    return 0


def _add_stop_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("instance_ids", metavar="ID", nargs="+", help="instances to end (as `l4m ps` lists them)")
    _add_spawner_arguments(parser)


def _stop(options: argparse.Namespace) -> int:
    from l4m.client import Client

    async def stop() -> int:
        failed = 0
        async with Client(options.spawner, api_key=api_key_of(options), tls_ca=options.tls_ca) as client:
            for instance_id in options.instance_ids:
                try:
                    await client.terminate(instance_id)
                except L4MError as error:
                    print(f"l4m stop: {instance_id}: {error}", file=sys.stderr)
                    failed += 1
        return failed

    return 1 if asyncio.run(stop()) else 0


register("ps", "list your instances (an admin's: everyone's): state, age, program, shared process, arguments",
         _add_ps_arguments, _ps)
register("stop", "end instances (a detached one too); it ends TERMINATED, as Ctrl-C on `l4m run` ends it",
         _add_stop_arguments, _stop)


# ---- l4m store -----------------------------------------------------------------------------------
def _add_store_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="controller program: a .py file or a zip with __main__.py")
    parser.add_argument("--tag", default="", help="name it NAME[:TAG] (TAG defaults to latest), e.g. for the "
                        "gateway's `\"model\": \"l4m/NAME\"` (docs/openai.md)")
    _add_spawner_arguments(parser)


def _store(options: argparse.Namespace) -> int:
    from l4m.client import Client

    if not Path(options.file).is_file():
        print(f"l4m store: {options.file}: no such file", file=sys.stderr)
        return 2

    async def store() -> str:
        async with Client(options.spawner, api_key=api_key_of(options), tls_ca=options.tls_ca) as client:
            return await client.upload_file(options.file, options.tag)

    print(asyncio.run(store()), flush=True)
    return 0


register("store", "upload a controller to the spawner (optionally tagged) without running it; print its sha256",
         _add_store_arguments, _store)


# ---- l4m keys ------------------------------------------------------------------------------------
def _add_keys_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keys-file", default=None,
                        help="the spawner's key store (default: <state dir>/api-keys.json, as `l4m up` uses)")
    actions = parser.add_subparsers(dest="keys_action", required=True, metavar="ACTION")
    add = actions.add_parser("add", help="make a key; it is printed once and stored only as a hash")
    add.add_argument("name", help="the user's name (instances and programs belong to it)")
    add.add_argument("--role", choices=("admin", "user"), default="user",
                     help="user: sees only its own instances and programs; admin: sees and may end all")
    add.add_argument("--max-instances", type=int, default=0,
                     help="instances alive at once (0: the spawner's --max-instances-per-user)")
    add.add_argument("--max-tokens-per-minute", type=int, default=0,
                     help="tokens per minute (0: the spawner's --max-tokens-per-minute-per-user)")
    actions.add_parser("list", help="names, roles and quotas (never the keys)")
    remove = actions.add_parser("remove", help="revoke a key (a running spawner notices at once)")
    remove.add_argument("name")


def _keys(options: argparse.Namespace) -> int:
    from pathlib import Path

    from l4m.keys import KEYS_FILE_NAME, KeyStore, KeyStoreError
    from l4m.up import default_state_dir

    path = Path(options.keys_file) if options.keys_file else default_state_dir() / KEYS_FILE_NAME
    try:
        store = KeyStore.load(path)
        if options.keys_action == "add":
            key = store.add(options.name, options.role, options.max_instances, options.max_tokens_per_minute)
            print(key)
            print(f"l4m: added key {options.name!r} ({options.role}) to {path}; it is shown only this once",
                  file=sys.stderr)
        elif options.keys_action == "remove":
            store.remove(options.name)
        else:
            print(f"{'NAME':<20} {'ROLE':<6} {'MAX INSTANCES':>13} {'MAX TOKENS/MIN':>14}")
            for entry in store.keys():  # noqa: SIM118 - a list, not a dict
                print(f"{entry.name:<20} {entry.role:<6} {entry.max_instances or 'default':>13} "
                      f"{entry.max_tokens_per_minute or 'default':>14}")
    except KeyStoreError as error:
        print(f"l4m: {error}", file=sys.stderr)
        return 2
    return 0


register("keys", "manage the spawner's API keys (add prints the new key once)", _add_keys_arguments, _keys)


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
