"""``hbmctl``: inspect hbmd instances. A thin client of :mod:`hbmd.client`.

Exit codes: 0 ok, 1 daemon unreachable or timed out (any of several asked
included), 2 usage error (an ambiguous instance included), 3 the daemon
refused the request, 4 ``reclaim --wait`` ended before the session answered.

Output: a table for people (``-o wide`` adds columns), ``--json`` (or
``-o json``) and ``-o csv`` for scripts; csv cells are plain numbers of
bytes and seconds. With several instances under the run directory and no
``--instance``, ``status``, ``sessions``, ``buffers``, ``weights`` and
``watch`` show every instance, as ``nvidia-smi`` shows every GPU: ``status``
one row per instance, the listings each instance's rows after an
``INSTANCE`` column. An instance that does not answer is named on stderr
and marked so in status, however many there are; the others are shown,
and the exit code is 1: a partial listing never passes for a whole one.
An instance nothing serves (its daemon killed) is no failure of the node,
unless nothing serves any.

JSON has one shape per command whatever the node: ``status`` is always
``{"instances": [...]}`` (one record each, ``error`` null where it
answered), every record of a listing names its ``instance``, and a figure
that does not exist (a host instance's GPU index, an unanswered reclaim) is
``null``, never ``-1``; csv leaves that cell empty.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from hbmd.proto.errors import DaemonUnavailable, HbmdError
from hbmd.proto.instance import (
    DEFAULT_RUN_DIR,
    InstancePaths,
    access_denied,
    resolve_run_dir,
    run_dir_origin,
    scan_instances,
)
from hbmd.proto.text import shown
from hbmd.proto.units import parse_size

from . import __version__
from .ctl_commands import (
    INSTANCE_COLUMN,
    NOT_RUNNING,
    STATUS_COLUMNS,
    UNREACHABLE,
    UNREACHABLE_STATE,
    cmd_buffers,
    cmd_delete,
    cmd_reclaim,
    cmd_sessions,
    cmd_status,
    cmd_weights,
)
from .ctl_output import (
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    Column,
    Output,
    UsageError,
    constant,
    render,
)
from .session import Client


def ask(client: Client, instance: str, commands: list[str], args: argparse.Namespace) -> dict[str, Output]:
    """Each of ``commands`` asked of one instance, every record of their listings naming ``instance``."""
    outputs = {command: command_call(command)(client, args) for command in commands}
    for output in outputs.values():
        for item in output.items:
            item.setdefault("instance", instance)  # a status record names its own
    return outputs


def ask_every_instance(
    args: argparse.Namespace, names: list[str], commands: list[str]
) -> tuple[dict[str, Output | None], list[str], list[str]]:
    """Each of ``commands`` asked of every instance in ``names``, over one connection each: what each command shows
    for them all (None where none answered), a complaint for each instance that did not answer, and a note for each
    that nothing serves.

    One instance's output is its own, and an error other than its daemon
    being unavailable is raised. Of several, status shows one row each, and a
    listing the rows of those that answered, after an INSTANCE column. An
    instance that did not answer is reported alike whatever their number: a
    status row that says so (``unreachable``, or ``not running`` where
    nothing serves it: a daemon killed leaves its directory, until the next
    one of the instance clears it), and a line on stderr. One nothing serves
    is no failure of the node, unless nothing serves any of them.
    """
    answers: dict[str, list[Output]] = {command: [] for command in commands}
    failures: list[str] = []
    notes: list[str] = []
    for name in names:
        try:
            with open_client(args, name) as client:
                outputs = ask(client, name, commands, args)
        except HbmdError as exc:
            if len(names) == 1 and not isinstance(exc, DaemonUnavailable):
                raise
            gone = bool(exc.details.get("not_running"))
            state = NOT_RUNNING if gone else UNREACHABLE_STATE
            (notes if gone else failures).append(f"{name}: {state}: {exc.message}")
            outputs = {}
            if "status" in commands:
                record = UNREACHABLE | {"instance": name, "error": exc.message, "state": state}
                outputs["status"] = Output({"instances": [record]}, "", STATUS_COLUMNS, [record])
        for command, output in outputs.items():
            answers[command].append(output)
    if len(notes) == len(names):
        failures, notes = notes, []
    if len(names) == 1:
        return {command: listed[0] if listed else None for command, listed in answers.items()}, failures, notes
    return {command: _side_by_side(listed) for command, listed in answers.items()}, failures, notes


def _side_by_side(outputs: list[Output]) -> Output | None:
    """The outputs of one command from several instances as one table, each row after its instance's name."""
    if not outputs:
        return None
    first = outputs[0]
    [key] = first.data
    items = [item for output in outputs for item in output.items]
    columns = first.columns if INSTANCE_COLUMN in first.columns else [INSTANCE_COLUMN, *first.columns]
    return Output({key: items}, "", columns, items, first.empty)


WATCHED = ["status", "sessions", "buffers"]


def _leave(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def watch(args: argparse.Namespace, names: list[str]) -> int:
    """Show status, sessions and buffers every ``--interval`` seconds until Ctrl-C or SIGTERM.

    On a terminal each frame replaces the last; elsewhere frames follow one
    another. Several instances show side by side, as the commands show them,
    those that do not answer marked so in status, and watching goes on. One
    instance whose daemon goes away (stopped, restarted, taken over) is
    waited for, saying so on stderr, and followed once one serves it again.
    ``--json`` writes one JSON object per frame and line: ``{"time": ...,
    "instances": [...], "sessions": [...], "buffers": [...]}``, each session
    and buffer naming its instance. ``-o csv`` writes the status columns,
    after a ``time`` column (Unix seconds), one row per instance and frame: a
    time series, its header once. Either signal ends it with status 0, even
    where it was inherited ignored (a job started with ``&`` in a script,
    ``nohup``, a CI runner), which would otherwise leave it running.
    """
    inherited = {signum: signal.signal(signum, _leave) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _watch(args, names)
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        for signum, handler in inherited.items():
            signal.signal(signum, handler)


def _watch(args: argparse.Namespace, names: list[str]) -> int:
    fmt = "json" if args.json else args.output
    redraw = sys.stdout.isatty() and fmt not in ("json", "csv")
    # One instance: one connection while its daemon serves, opened again when it has gone (a restart, a successor),
    # as journalctl -f follows a rotated journal; several are asked afresh each frame.
    client = open_client(args, names[0]) if len(names) == 1 else None
    away = False
    headers = not args.no_headers
    try:
        while True:
            failures: list[str] = []
            if len(names) == 1:
                try:
                    client = client or open_client(args, names[0])
                    outputs: dict[str, Output | None] = dict(ask(client, names[0], WATCHED, args))
                except DaemonUnavailable as exc:
                    if client is not None:
                        client.close()
                        client = None
                    if not away:
                        print(f"hbmctl: {shown(exc.message)}; waiting for hbmd to serve {names[0]} again",
                              file=sys.stderr, flush=True)
                        away = True
                    time.sleep(args.interval)
                    continue
                if away:
                    print(f"hbmctl: hbmd serves {names[0]} again", file=sys.stderr, flush=True)
                    away = False
            else:
                outputs, failures, notes = ask_every_instance(args, names, WATCHED)
                failures += notes
            now, stamp = time.time(), time.strftime("%H:%M:%S")
            if fmt == "json":
                record: dict[str, Any] = {"time": now, "sessions": [], "buffers": []}
                for output in outputs.values():
                    if output is not None:
                        record |= output.data
                frame = json.dumps(record, sort_keys=True)
            elif fmt == "csv":
                now_s = round(now, 3)
                at = Column("TIME", constant(now_s), constant(now_s))
                status = outputs["status"]
                assert status is not None  # every instance has a status row, answered or not
                frame = render(Output({}, columns=[at, *STATUS_COLUMNS], items=status.items), "csv", headers)
                headers = False
            else:
                header = f"{stamp}  every {args.interval}s, Ctrl-C to leave"
                body = "\n\n".join(render(o, fmt, not args.no_headers) for o in outputs.values() if o is not None)
                frame = ("\x1b[H\x1b[2J" if redraw else "") + "\n".join([header, "", body, *map(shown, failures)])
            sys.stdout.write(frame + "\n")
            sys.stdout.flush()
            time.sleep(args.interval)
    finally:
        if client is not None:
            client.close()


COMMANDS: dict[str, tuple[Callable[[Client, argparse.Namespace], Output] | None, str, str]] = {
    "status": (cmd_status,
               "budget, committed, budget left and device free bytes; one row per instance when there are several",
               "hbmctl status"),
    "sessions": (cmd_sessions, "connected worker sessions and what each holds", "hbmctl sessions --json"),
    "buffers": (cmd_buffers, "buffers with their segments, committed bytes and chunk counts",
                "hbmctl buffers --session 3"),
    "weights": (cmd_weights, "sealed weights resident on the device: size, readers and key (vLLM's in the name)",
                "hbmctl weights"),
    "delete": (cmd_delete,
               "delete an orphaned persistent buffer by name (yours; an admin names another user's with --uid), or "
               "with --engine every KV buffer a vLLM engine keeps for its successor",
               "hbmctl delete --uid 1000 kv-cache-layer0; hbmctl delete --engine llama-a"),
    "reclaim": (cmd_reclaim, "ask a session to give memory back; its engine decides what to release",
                "hbmctl reclaim --pid 4242 --bytes 8GiB --wait 10"),
    "watch": (None, "live view of status, sessions and buffers (Ctrl-C to leave); -o csv: status as a time series",
              "hbmctl watch --interval 2"),
}
MULTI_INSTANCE = {"status", "sessions", "buffers", "weights", "watch"}
"""Commands that show every instance when none is chosen; the others act on one and need exactly one."""
EVERY_INSTANCE = ("Without --instance, every instance under the run directory: one that does not answer is named on "
                  "stderr, the others are shown, and the exit code is 1.")
EXIT_CODES = ("exit codes: 0 ok, 1 daemon unreachable or timed out (of several instances, any one), 2 usage error, "
              "3 request refused, 4 reclaim --wait ended before the session answered")


def command_call(command: str) -> Callable[[Client, argparse.Namespace], Output]:
    """The one client call behind ``command``; watch has none (:func:`watch` runs it)."""
    call = COMMANDS[command][0]
    assert call is not None, f"{command} is not one client call"
    return call


WIRE_INT_MAX = (1 << 63) - 1
"""The largest integer a message carries (msgpack's signed 64 bits)."""
MAX_SECONDS = 86400.0
"""The longest wait hbmctl takes: a day, far below where sleep and poll overflow."""


def whole_number(text: str) -> int:
    """argparse's type for a session id, pid or uid: a number a message can carry, else a usage error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 <= value <= WIRE_INT_MAX:
        raise argparse.ArgumentTypeError(f"{text} is out of range [0, 2**63 - 1]")
    return value


def size_argument(text: str) -> int:
    """argparse's type for a size (``512MiB``): parsed here, so that a bad one is a usage error, not a refusal."""
    too_big = argparse.ArgumentTypeError(f"{text} is more than 2**63 - 1 bytes")
    try:
        size = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if size > WIRE_INT_MAX:
        raise too_big
    return size


def seconds(zero_ok: bool) -> Callable[[str], float]:
    """argparse's type for a duration: finite, at most :data:`MAX_SECONDS`, and above zero unless ``zero_ok``."""

    def duration(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
        low_ok = value >= 0 if zero_ok else value > 0
        if not (low_ok and value <= MAX_SECONDS):  # also false for nan
            least = "at least 0" if zero_ok else "more than 0"
            raise argparse.ArgumentTypeError(f"{text} seconds: expected {least} and at most {MAX_SECONDS:g}")
        return value

    return duration


def _add_common(parser: argparse.ArgumentParser, defaults: bool) -> None:
    """The options every command takes, before or after its name.

    A subcommand's copy defaults to SUPPRESS so it does not overwrite a value
    given before the command name.
    """

    def default(value: Any) -> Any:
        return value if defaults else argparse.SUPPRESS

    parser.add_argument("--run-dir", metavar="DIR", default=default(None),
                        help=f"daemon run directory (default: $HBMD_RUN_DIR, else {DEFAULT_RUN_DIR})")
    parser.add_argument("--instance", metavar="NAME", default=default(None),
                        help="instance to ask: gpu0, gpu1, ..., host (default: the only one; status, sessions, "
                             "buffers, weights and watch: every one)")
    parser.add_argument("--json", action="store_true", default=default(False), help="machine-readable output (-o json)")
    parser.add_argument("-o", "--output", choices=("table", "wide", "json", "csv"), default=default("table"),
                        help="table (default), wide (more columns), json, or csv (plain numbers of bytes and seconds)")
    parser.add_argument("--no-headers", action="store_true", default=default(False),
                        help="leave out the header row of tables and csv")
    parser.add_argument("--timeout", type=seconds(zero_ok=False), default=default(5.0), metavar="S",
                        help="seconds to wait for the daemon (default: 5)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hbmctl",
        description="Inspect hbmd memory daemon instances.",
        epilog=EXIT_CODES,
    )
    parser.add_argument("--version", action="version", version=f"hbmctl {__version__}")
    _add_common(parser, defaults=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, summary, example) in COMMANDS.items():
        epilog = f"example: {example}" + (f". {EVERY_INSTANCE}" if name in MULTI_INSTANCE else "")
        if name == "reclaim":
            epilog += ". With --wait, exit 4 where the wait ended before the session answered."
        p = sub.add_parser(name, help=summary, description=summary, epilog=epilog)
        _add_common(p, defaults=False)
        if name in ("buffers", "watch"):
            p.add_argument("--session", type=whole_number, default=-1, metavar="ID", help="only this session's buffers")
        if name == "delete":
            which = p.add_mutually_exclusive_group(required=True)
            which.add_argument("name", nargs="?", metavar="NAME", help="the persistent buffer's name")
            which.add_argument("--engine", metavar="ENGINE",
                               help="every kept KV buffer of the vLLM engine of this HBMD_VLLM_ENGINE (all ranks, "
                               "replicas and generations) that no running engine holds; its index needs no cleaning: "
                               "its next start finds the buffers gone and starts cold")
            p.add_argument("--uid", type=whole_number, default=-1, metavar="N",
                           help="the buffer's owner, for admins (root, the daemon's user); default: you")
        if name == "reclaim":
            which = p.add_mutually_exclusive_group(required=True)
            which.add_argument("--session", type=whole_number, metavar="ID", help="the session to ask")
            which.add_argument("--pid", type=whole_number, metavar="PID", help="the session of this process")
            which.add_argument("--name", metavar="CLIENT", help="the session with this client name")
            p.add_argument("--bytes", type=size_argument, required=True, metavar="SIZE",
                           help="how much to ask for: 512MiB, 8GiB, ...")
            p.add_argument("--wait", type=seconds(zero_ok=True), default=0.0, metavar="S",
                           help="wait up to S seconds for the answer, and exit 4 if none came (default: do not wait)")
        if name == "watch":
            p.add_argument("--interval", type=seconds(zero_ok=False), default=1.0, metavar="S",
                           help="seconds between refreshes (default: 1)")
    return parser


def open_client(args: argparse.Namespace, instance: str) -> Client:
    # No tenant of its own, whatever HBMD_TENANT says: an operator's shell may hold an engine's.
    return Client(
        InstancePaths.of(args.run_dir, instance), timeout=args.timeout, client_name="hbmctl", tenant="", observer=True
    )


def choose_instances(args: argparse.Namespace) -> list[str]:
    """The instances to ask: the one chosen, else every one under the run directory, which only the commands that
    show every instance take."""
    if args.instance:
        return [args.instance]
    names, denied = scan_instances(args.run_dir)
    root = resolve_run_dir(args.run_dir)
    if not names and denied:
        more = f" (and {len(denied) - 1} more like it)" if len(denied) > 1 else ""
        raise DaemonUnavailable(f"{access_denied(denied[0])}{more}", path=str(root))
    if not names:
        raise DaemonUnavailable(f"no hbmd instance under {run_dir_origin(args.run_dir)}", path=str(root))
    several = f"several hbmd instances under {root} ({', '.join(names)})"
    if len(names) > 1 and args.command not in MULTI_INSTANCE:
        raise UsageError(f"{several}: choose one with --instance")
    if len(names) > 1 and args.command in ("buffers", "watch") and args.session != -1:
        raise UsageError(f"{several}, each numbering its own sessions: choose one with --instance")
    return names


def main(argv: list[str] | None = None) -> int:
    # Die quietly like any Unix filter when the reader goes away (hbmctl sessions | head).
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    parser = build_parser()
    args = parser.parse_args(argv)
    fmt = "json" if args.json else args.output
    failures: list[str] = []
    try:
        names = choose_instances(args)
        if args.command == "watch":
            return watch(args, names)
        if args.command in MULTI_INSTANCE:
            answers, failures, notes = ask_every_instance(args, names, [args.command])
            output = answers[args.command]
            for note in notes:
                print(f"hbmctl: {shown(note)}", file=sys.stderr)
        else:
            with open_client(args, names[0]) as client:
                output = command_call(args.command)(client, args)
    except UsageError as exc:
        print(f"hbmctl: {shown(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except DaemonUnavailable as exc:
        print(f"hbmctl: {shown(str(exc))}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except HbmdError as exc:
        print(f"hbmctl: refused: {shown(str(exc))}", file=sys.stderr)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    if output is not None:  # None: of several instances, none answered (the failures say why)
        text = render(output, fmt, not args.no_headers)
        if text:
            print(text)
        if output.complaint:
            failures.append(output.complaint)
    for failure in failures:
        print(f"hbmctl: {shown(failure)}", file=sys.stderr)
    if output is not None and output.exit_code != EXIT_OK:
        return output.exit_code
    return EXIT_UNREACHABLE if failures else EXIT_OK

if __name__ == "__main__":
    sys.exit(main())
