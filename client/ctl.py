"""``hbmctl``: inspect an hbmd instance. A thin client of :mod:`hbmd.client`.

Exit codes: 0 ok, 1 daemon unreachable or timed out, 2 usage error, 3 the
daemon refused the request.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any, Callable

from hbmd.proto.errors import DaemonUnavailable, HbmdError
from hbmd.proto.instance import DEFAULT_RUN_DIR, InstancePaths
from hbmd.proto.units import format_bytes, parse_size

from .session import Client, only_instance

EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE, EXIT_REFUSED = 0, 1, 2, 3


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def render_table(headers: list[str], rows: list[list[Any]]) -> str:
    """Columns padded to their widest cell; numbers right-aligned, text left-aligned."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [all(isinstance(row[i], (int, float)) or _looks_numeric(str(row[i])) for row in rows) for i in range(len(headers))]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in cells])


def _looks_numeric(text: str) -> bool:
    return bool(text) and (text[0].isdigit() or text == "-")


def _as_dict(obj: Any) -> dict[str, Any]:
    return dataclasses.asdict(obj)


# commands: each is one client call plus formatting


def cmd_status(client: Client, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    s = client.status()
    free = max(0, s.budget_bytes - s.committed_bytes)
    data = _as_dict(s) | {"free_bytes": free}
    device = f"GPU {s.device_index} ({s.device_uuid})" if s.device_index >= 0 else "host memory"
    share = 100 * s.committed_bytes / s.budget_bytes if s.budget_bytes else 0.0
    text = "\n".join(
        [
            f"● hbmd instance {s.instance} — {s.backend} backend, pid {s.pid}, up {_duration(s.uptime_s)}",
            f"    device:    {device}",
            f"    granule:   {format_bytes(s.granularity)}",
            f"    budget:    {format_bytes(s.budget_bytes)} of {format_bytes(s.total_bytes)}",
            f"    committed: {format_bytes(s.committed_bytes)} ({share:.1f}% of budget)",
            f"    free:      {format_bytes(free)}",
            f"    reserved:  {format_bytes(s.reserved_bytes)} of address space",
            f"    sessions:  {s.num_sessions}   buffers: {s.num_buffers}   chunks: {s.num_chunks}",
        ]
    )
    tenants = [t for t in s.tenants if t.num_sessions or t.used_bytes or t.guaranteed_bytes or t.max_bytes >= 0]
    if len(tenants) > 1 or any(t.guaranteed_bytes or t.max_bytes >= 0 for t in tenants):
        rows = [
            [t.name, t.num_sessions, format_bytes(t.used_bytes), format_bytes(t.guaranteed_bytes) if t.guaranteed_bytes else "-",
             format_bytes(t.max_bytes) if t.max_bytes >= 0 else "-"]
            for t in tenants
        ]
        text += "\n\n" + render_table(["TENANT", "SESSIONS", "USED", "GUARANTEED", "MAX"], rows)
    if s.tenants_left_out:
        text += f"\n... and {s.tenants_left_out} more tenants"
    return data, text


def cmd_sessions(client: Client, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    sessions = client.sessions()
    rows = [
        [s.session_id, s.pid, s.uid, s.client_name or "-", s.tenant or "-", s.num_buffers, s.num_chunks,
         format_bytes(s.committed_bytes), format_bytes(s.reserved_bytes), _duration(s.connected_s), _reclaim(s)]
        for s in sessions
    ]
    headers = ["SESSION", "PID", "UID", "NAME", "TENANT", "BUFFERS", "CHUNKS", "COMMITTED", "RESERVED", "AGE", "RECLAIM"]
    text = render_table(headers, rows) if rows else "no sessions"
    return {"sessions": [_as_dict(s) for s in sessions]}, text


def _reclaim(session: Any) -> str:
    """The last reclaim request of a session, as a table cell."""
    if not session.reclaim_state:
        return "-"
    asked = format_bytes(session.reclaim_requested_bytes)
    if session.reclaim_state == "answered":
        return f"asked {asked}, released {format_bytes(session.reclaim_released_bytes)}"
    return f"asked {asked}, {session.reclaim_state}"


def cmd_buffers(client: Client, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    buffers = client.buffers(args.session)
    rows = [
        [b.buffer_id, b.session_id or "-", b.name or "-", "yes" if b.persistent else "no", b.num_segments,
         format_bytes(b.bytes_per_segment), format_bytes(b.segment_capacity_bytes),
         format_bytes(b.physical_bytes), b.num_chunks]
        for b in buffers
    ]
    headers = ["BUFFER", "SESSION", "NAME", "PERSISTENT", "SEGMENTS", "PER-SEGMENT", "SEG-CAPACITY", "COMMITTED", "CHUNKS"]
    text = render_table(headers, rows) if rows else "no buffers"
    return {"buffers": [_as_dict(b) for b in buffers]}, text


def cmd_delete(client: Client, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    freed = client.delete(args.name, args.uid)
    owner = f" of uid {args.uid}" if args.uid != -1 else ""
    return (
        {"name": args.name, "buffer_id": freed.buffer_id, "freed_bytes": freed.freed_bytes},
        f"deleted persistent buffer {args.name!r}{owner} (buffer {freed.buffer_id}), "
        f"freed {format_bytes(freed.freed_bytes)}",
    )


def cmd_reclaim(client: Client, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    size = parse_size(args.bytes)
    sent = client.reclaim(args.session, size)
    data = {"reclaim_id": sent.reclaim_id, "session_id": sent.session_id, "pid": sent.pid, "requested_bytes": size}
    text = f"asked session {sent.session_id} (pid {sent.pid}) to release {format_bytes(size)}"
    if args.wait > 0:
        deadline = time.monotonic() + args.wait
        while True:
            session = next((s for s in client.sessions() if s.session_id == sent.session_id), None)
            state = session.reclaim_state if session else "ended"
            if state != "pending" or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        released = session.reclaim_released_bytes if session and state == "answered" else -1
        data |= {"state": state, "released_bytes": released}
        text += f"; {state}" + (f": released {format_bytes(released)}" if released >= 0 else "")
    return data, text


def cmd_watch(client: Client, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Redraw status, sessions and buffers every ``--interval`` seconds until Ctrl-C."""
    try:
        while True:
            frame = "\n\n".join(render(client, args)[1] for render in (cmd_status, cmd_sessions, cmd_buffers))
            sys.stdout.write("\x1b[H\x1b[2J" + time.strftime("%H:%M:%S") + f"  every {args.interval}s, Ctrl-C to leave\n\n" + frame + "\n")
            sys.stdout.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return {}, ""


COMMANDS: dict[str, tuple[Callable[[Client, argparse.Namespace], tuple[dict[str, Any], str]], str, str]] = {
    "status": (cmd_status, "budget, committed, free and reserved bytes of the instance", "hbmctl status"),
    "sessions": (cmd_sessions, "connected worker sessions and what each holds", "hbmctl sessions --json"),
    "buffers": (cmd_buffers, "buffers with their segments, committed bytes and chunk counts", "hbmctl buffers --session 3"),
    "delete": (cmd_delete, "delete an orphaned persistent buffer by name (yours; an admin names another user's with --uid)",
               "hbmctl delete --uid 1000 kv-cache-layer0"),
    "reclaim": (cmd_reclaim, "ask a session to give memory back; its engine decides what to release",
                "hbmctl reclaim --session 3 --bytes 8GiB --wait 10"),
    "watch": (cmd_watch, "live view of status, sessions and buffers (Ctrl-C to leave)", "hbmctl watch --interval 2"),
}


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
                        help="instance to ask: gpu0, gpu1, ..., host (default: the only one)")
    parser.add_argument("--json", action="store_true", default=default(False), help="machine-readable output")
    parser.add_argument("--timeout", type=float, default=default(5.0), metavar="S",
                        help="seconds to wait for the daemon (default: 5)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hbmctl",
        description="Inspect an hbmd memory daemon instance.",
        epilog="exit codes: 0 ok, 1 daemon unreachable or timed out, 2 usage error, 3 request refused",
    )
    _add_common(parser, defaults=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, summary, example) in COMMANDS.items():
        p = sub.add_parser(name, help=summary, description=summary, epilog=f"example: {example}")
        _add_common(p, defaults=False)
        if name in ("buffers", "watch"):
            p.add_argument("--session", type=int, default=-1, metavar="ID", help="only this session's buffers")
        if name == "delete":
            p.add_argument("name", metavar="NAME", help="the persistent buffer's name")
            p.add_argument("--uid", type=int, default=-1, metavar="N",
                           help="the buffer's owner, for admins (root, the daemon's user); default: you")
        if name == "reclaim":
            p.add_argument("--session", type=int, required=True, metavar="ID", help="the session to ask")
            p.add_argument("--bytes", required=True, metavar="SIZE", help="how much to ask for: 512MiB, 8GiB, ...")
            p.add_argument("--wait", type=float, default=0.0, metavar="S",
                           help="wait up to S seconds for the answer (default: do not wait)")
        if name == "watch":
            p.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between refreshes (default: 1)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = COMMANDS[args.command][0]
    if args.command == "reclaim":
        try:
            parse_size(args.bytes)
        except ValueError as exc:
            parser.error(f"--bytes: {exc}")
    try:
        instance = args.instance or only_instance(args.run_dir)
        with Client(
            InstancePaths.of(args.run_dir, instance), timeout=args.timeout, client_name="hbmctl", observer=True
        ) as client:
            data, text = handler(client, args)
    except DaemonUnavailable as exc:
        print(f"hbmctl: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except HbmdError as exc:
        print(f"hbmctl: refused: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    if args.json:
        json.dump(data, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    elif text:
        print(text)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
