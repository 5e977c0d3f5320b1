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
``INSTANCE`` column. An instance that does not answer is named on stderr,
the others are shown, and the exit code is 1: a partial listing never
passes for a whole one.

JSON has one shape per command whatever the node: ``status`` is always
``{"instances": [...]}`` (one record each, ``error`` null where it
answered), every record of a listing names its ``instance``, and a figure
that does not exist (a host instance's GPU index, an unanswered reclaim) is
``null``, never ``-1``; csv leaves that cell empty.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import signal
import sys
import time
from typing import Any, Callable

from hbmd.proto import StatusReply
from hbmd.proto.errors import DaemonUnavailable, HbmdError, NotFound
from hbmd.proto.instance import (
    DEFAULT_RUN_DIR,
    InstancePaths,
    access_denied,
    resolve_run_dir,
    run_dir_origin,
    scan_instances,
)
from hbmd.proto.text import shown
from hbmd.proto.units import format_bytes, parse_size

from . import __version__
from .budget import budget_left
from .session import Client

EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE, EXIT_REFUSED, EXIT_UNANSWERED = 0, 1, 2, 3, 4


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def _shown_cell(value: Any) -> Any:
    # Names come from peers, and a daemon older than the hello's check passes any on.
    return shown(value) if isinstance(value, str) else value


def render_table(headers: list[str], rows: list[list[Any]], with_headers: bool = True) -> str:
    """Columns padded to their widest cell; numbers right-aligned, text left-aligned."""
    cells = [[shown(str(c)) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [all(isinstance(row[i], (int, float)) or _looks_numeric(str(row[i])) for row in rows) for i in range(len(headers))]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    return "\n".join(([line(headers)] if with_headers else []) + [line(r) for r in cells])


def _looks_numeric(text: str) -> bool:
    return bool(text) and (text[0].isdigit() or text == "-")


def _as_dict(obj: Any) -> dict[str, Any]:
    return dataclasses.asdict(obj)


class UsageError(Exception):
    """The command line is ambiguous or contradictory; hbmctl exits 2."""


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of a listing: its header, its cell for people, its cell for csv, and whether only ``-o wide`` shows it."""

    header: str
    human: Callable[[Any], Any]
    raw: Callable[[Any], Any]
    wide: bool = False


@dataclasses.dataclass
class Output:
    """What a command found: ``data`` for JSON; ``text``, or rows of ``items`` under ``columns``, for people and csv."""

    data: dict[str, Any]
    text: str = ""
    columns: list[Column] = dataclasses.field(default_factory=list)
    items: list[Any] = dataclasses.field(default_factory=list)
    empty: str = ""
    """What the table says when there are no rows."""
    complaint: str = ""
    """Said on stderr after the output, where ``exit_code`` is not 0."""
    exit_code: int = EXIT_OK


def render(output: Output, fmt: str, with_headers: bool) -> str:
    """``output`` as ``fmt`` (table, wide, json or csv) says."""
    if fmt == "json":
        return json.dumps(output.data, indent=2, sort_keys=True)
    columns = output.columns or [Column(key, lambda d, k=key: d[k], lambda d, k=key: d[k]) for key in output.data]
    items = output.items if output.columns else [output.data]
    if fmt == "csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        if with_headers:
            writer.writerow([c.header.lower() for c in columns])
        writer.writerows([[_shown_cell(c.raw(item)) for c in columns] for item in items])
        return buffer.getvalue().rstrip("\n")
    if output.columns and (fmt == "wide" or not output.text):
        listed = [c for c in columns if fmt == "wide" or not c.wide]
        if not items:
            return output.empty
        return render_table([c.header for c in listed], [[c.human(item) for c in listed] for item in items], with_headers)
    return "\n".join(shown(line) for line in output.text.split("\n"))


def _bytes_column(header: str, key: str, wide: bool = False) -> Column:
    """Bytes as ``1.5 GiB`` for people and as a plain integer for csv; "-" where the figure is missing."""
    return Column(
        header,
        lambda r: "-" if r.get(key) is None else format_bytes(r[key]),
        lambda r: "" if r.get(key) is None else r[key],
        wide,
    )


def _plain_column(header: str, key: str, wide: bool = False, human: Callable[[Any], Any] | None = None) -> Column:
    return Column(
        header,
        lambda r: "-" if r.get(key) in (None, "") else (human or str)(r[key]),
        lambda r: "" if r.get(key) is None else r[key],
        wide,
    )


# commands: each is one client call plus formatting


def _none_for_negative(record: dict[str, Any], *keys: str) -> dict[str, Any]:
    """``record`` with each of ``keys`` whose wire value is -1 ("none" or "unknown") set to None: JSON's null."""
    for key in keys:
        if record[key] is not None and record[key] < 0:
            record[key] = None
    return record


def status_record(client: Client) -> dict[str, Any]:
    """An instance's status as JSON, in the words the table uses: budget left (what the daemon would admit), device free."""
    s = client.status()
    record = _none_for_negative(
        _as_dict(s), "device_index", "device_free_bytes", "admissible_bytes", "held_for_guarantees_bytes", "credit_bytes"
    )
    record["budget_left_bytes"] = budget_left(s)
    record["error"] = None
    for tenant in record["tenants"]:
        _none_for_negative(tenant, "max_bytes")
    return record


UNREACHABLE = dict.fromkeys([f.name for f in dataclasses.fields(StatusReply)] + ["budget_left_bytes"])
"""The record of an instance that did not answer: every figure null, beside its name and the error."""


def _device(r: dict[str, Any]) -> str:
    if r["error"] is not None:
        return "-"
    return "host memory" if r["device_index"] is None else f"gpu {r['device_index']}"


INSTANCE_COLUMN = _plain_column("INSTANCE", "instance")

STATUS_COLUMNS = [
    INSTANCE_COLUMN,
    Column("BACKEND", lambda r: r["backend"] or "unreachable", lambda r: r["backend"] or "unreachable"),
    Column("DEVICE", _device, lambda r: r["device_index"]),
    _bytes_column("BUDGET", "budget_bytes"),
    _bytes_column("COMMITTED", "committed_bytes"),
    _bytes_column("LEASED", "leased_bytes"),
    _bytes_column("CREDIT", "credit_bytes", wide=True),
    # Beside LEASED, what keeps BUDGET-LEFT below BUDGET - COMMITTED (the asker's tenant maximum aside).
    _bytes_column("HELD-FOR-GUARANTEES", "held_for_guarantees_bytes"),
    _bytes_column("BUDGET-LEFT", "budget_left_bytes"),
    _bytes_column("HOST-TIER", "host_bytes", wide=True),
    _bytes_column("DEVICE-FREE", "device_free_bytes"),
    _plain_column("SESSIONS", "num_sessions"),
    _bytes_column("RESERVED", "reserved_bytes", wide=True),
    _plain_column("BUFFERS", "num_buffers", wide=True),
    _plain_column("CHUNKS", "num_chunks", wide=True),
    _plain_column("PID", "pid", wide=True),
    Column("UP", lambda r: "-" if r["uptime_s"] is None else _duration(r["uptime_s"]), lambda r: r["uptime_s"], True),
    _plain_column("VERSION", "daemon_version", wide=True),
    _plain_column("UUID", "device_uuid", wide=True),
]


def cmd_status(client: Client, args: argparse.Namespace) -> Output:
    r = status_record(client)
    device = "host memory" if r["device_index"] is None else f"GPU {r['device_index']} ({r['device_uuid']})"
    share = 100 * r["committed_bytes"] / r["budget_bytes"] if r["budget_bytes"] else 0.0
    device_free = "unknown" if r["device_free_bytes"] is None else format_bytes(r["device_free_bytes"])
    text = "\n".join(
        [
            f"● hbmd instance {r['instance']} — {r['backend']} backend, pid {r['pid']}, up {_duration(r['uptime_s'])}",
            f"    device:      {device}",
            f"    granule:     {format_bytes(r['granularity'])}",
            f"    budget:      {format_bytes(r['budget_bytes'])} of {format_bytes(r['total_bytes'])}",
            f"    committed:   {format_bytes(r['committed_bytes'])} ({share:.1f}% of budget)",
            f"    leased:      {_leased(r)}",
            f"    budget left: {_budget_left(r)}",
            f"    device free: {device_free} (all processes, as the driver reports it)",
            f"    reserved:    {format_bytes(r['reserved_bytes'])} of address space",
            f"    sessions:    {r['num_sessions']}   buffers: {r['num_buffers']}   chunks: {r['num_chunks']}",
        ]
        + (
            [f"    held back:   {format_bytes(r['held_back_bytes'])} by the daemon (export sentinel, warm chunks), "
             "outside the budget"]
            if r["held_back_bytes"]
            else []
        )
        + (
            [f"    host tier:   {format_bytes(r['host_bytes'])} demoted of {format_bytes(r['host_budget_bytes'])}, "
             f"{format_bytes(r['host_pool_bytes'])} made ahead"]
            if r["host_budget_bytes"]
            else []
        )
        + ([f"    config:      {_config_line(r)}"] if r["config_path"] else [])
    )
    tenants = [
        t for t in r["tenants"]
        if t["num_sessions"] or t["used_bytes"] or t["host_bytes"] or t["guaranteed_bytes"] or t["max_bytes"] is not None
    ]
    limited = any(t["guaranteed_bytes"] or t["max_bytes"] is not None for t in tenants)
    if len(tenants) > 1 or limited or r["host_bytes"]:
        rows = [
            [t["name"], t["num_sessions"], format_bytes(t["used_bytes"]), format_bytes(t["host_bytes"]),
             format_bytes(t["guaranteed_bytes"]) if t["guaranteed_bytes"] else "-",
             format_bytes(t["max_bytes"]) if t["max_bytes"] is not None else "-"]
            for t in tenants
        ]
        text += "\n\n" + render_table(["TENANT", "SESSIONS", "USED", "HOST-TIER", "GUARANTEED", "MAX"], rows)
    if r.get("tenants_left_out"):
        text += f"\n... and {r['tenants_left_out']} more tenants"
    return Output({"instances": [r]}, text, STATUS_COLUMNS, [r])


def _leased(r: dict[str, Any]) -> str:
    """The leased bytes, granules and credit apart where the daemon says so (protocol 1.9)."""
    leased, credit = r["leased_bytes"], r["credit_bytes"]
    if not leased or credit is None:
        return f"{format_bytes(leased)} (granules and credit: commits without a round trip)"
    return (f"{format_bytes(leased)} ({format_bytes(leased - credit)} granules, {format_bytes(credit)} credit: "
            "commits without a round trip, asked back when a commit needs the room)")


def _budget_left(r: dict[str, Any]) -> str:
    """Budget left and, where it is below the uncommitted budget, what takes the difference.

    The daemon's admission (``Tenants.admissible``) counts the budget less
    what is committed, leased and held for other tenants' guaranteed
    minimums, capped by the asker's own tenant maximum: what the figures do
    not explain is that cap.
    """
    left, uncommitted = r["budget_left_bytes"], max(0, r["budget_bytes"] - r["committed_bytes"])
    if left >= uncommitted:
        return format_bytes(left)
    held = r["held_for_guarantees_bytes"]
    less = [f"{format_bytes(r['leased_bytes'])} leased"] if r["leased_bytes"] else []
    if held:
        less.append(f"{format_bytes(held)} held for other tenants' guaranteed minimums")
    beyond = uncommitted - r["leased_bytes"] - (held or 0) - left
    if beyond > 0 and held is None:
        less.append(f"{format_bytes(beyond)} held for others' guarantees or beyond your tenant's maximum "
                    "(a daemon older than protocol 1.9 does not say which)")
    elif beyond > 0:
        less.append(f"{format_bytes(beyond)} beyond your tenant's maximum")
    return f"{format_bytes(left)} ({format_bytes(uncommitted)} uncommitted, less {', '.join(less)})"


def _config_line(r: dict[str, Any]) -> str:
    """The config file, when the one in force was loaded, and a refused reload since, if any."""
    loaded = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["config_loaded_at"]))
    line = f"{r['config_path']}, loaded {loaded}"
    if r["config_reload_failed_at"]:
        refused = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["config_reload_failed_at"]))
        line += f"; the reload at {refused} was refused, the config loaded before serves on: {r['config_reload_error']}"
    return line


SESSION_COLUMNS = [
    _plain_column("SESSION", "session_id"),
    _plain_column("PID", "pid"),
    _plain_column("UID", "uid"),
    _plain_column("GID", "gid", wide=True),
    _plain_column("NAME", "client_name"),
    _plain_column("TENANT", "tenant"),
    _plain_column("BUFFERS", "num_buffers"),
    _plain_column("CHUNKS", "num_chunks"),
    _bytes_column("COMMITTED", "committed_bytes"),
    _bytes_column("LEASED", "leased_bytes"),
    _bytes_column("RESERVED", "reserved_bytes"),
    Column("AGE", lambda r: _duration(r["connected_s"]), lambda r: r["connected_s"]),
    Column("STATE", lambda r: _session_state(r), lambda r: _session_state(r)),
    Column("RECLAIM", lambda r: _reclaim(r), lambda r: r["reclaim_state"]),
]


def cmd_sessions(client: Client, args: argparse.Namespace) -> Output:
    sessions = [_none_for_negative(_as_dict(s), "reclaim_released_bytes") for s in client.sessions()]
    return Output({"sessions": sessions}, "", SESSION_COLUMNS, sessions, "no sessions")


def _session_state(session: dict[str, Any]) -> str:
    """``resuming`` for a session restored after a daemon restart whose client is not back yet (a daemon of protocol
    1.3 or older never says so)."""
    return "resuming" if session.get("resuming") else "connected"


def _reclaim(session: dict[str, Any]) -> str:
    """The last reclaim request of a session, as a table cell."""
    if not session["reclaim_state"]:
        return "-"
    asked = format_bytes(session["reclaim_requested_bytes"])
    if session["reclaim_state"] == "answered":
        return f"asked {asked}, released {format_bytes(session['reclaim_released_bytes'])}"
    return f"asked {asked}, {session['reclaim_state']}"


def _committed(buffer: dict[str, Any]) -> int:
    return buffer["physical_bytes"] + buffer["pending_bytes"]


BUFFER_COLUMNS = [
    _plain_column("BUFFER", "buffer_id"),
    Column("SESSION", lambda r: r["session_id"] or "orphan", lambda r: r["session_id"] or ""),
    _plain_column("NAME", "name"),
    Column("PERSISTENT", lambda r: "yes" if r["persistent"] else "no", lambda r: int(r["persistent"])),
    _plain_column("OWNER", "owner_uid", wide=True),
    _plain_column("SEGMENTS", "num_segments"),
    _bytes_column("PER-SEGMENT", "bytes_per_segment"),
    _bytes_column("SEG-CAPACITY", "segment_capacity_bytes"),
    # Mid-defragment a buffer holds its new chunks beside the old, and status counts both: so does COMMITTED,
    # so that the column adds up to status; PENDING says how much of it is the new chunks.
    Column("COMMITTED", lambda r: format_bytes(_committed(r)), _committed),
    _bytes_column("PENDING", "pending_bytes", wide=True),
    _bytes_column("RESERVED", "reserved_bytes", wide=True),
    _plain_column("CHUNKS", "num_chunks"),
    _plain_column("TIER", "tier", wide=True),
    Column("SEALED", lambda r: "yes" if r.get("sealed") else "no", lambda r: int(bool(r.get("sealed")))),
    _plain_column("READERS", "readers"),
    # Declared again by the processes that map it after a restart with no keeper: counted, not attachable elsewhere.
    Column("KEPT-BY", lambda r: "mappers" if r.get("held_elsewhere") else "hbmd",
           lambda r: int(bool(r.get("held_elsewhere"))), wide=True),
]


def cmd_buffers(client: Client, args: argparse.Namespace) -> Output:
    buffers = [_as_dict(b) for b in client.buffers(args.session)]
    return Output({"buffers": buffers}, "", BUFFER_COLUMNS, buffers, "no buffers")


WEIGHTS_COLUMNS = [
    _plain_column("NAME", "name"),
    Column("SIZE", lambda r: format_bytes(r["physical_bytes"]), lambda r: r["physical_bytes"]),
    _plain_column("READERS", "readers"),
    Column("HELD-BY", lambda r: f"session {r['session_id']}" if r["session_id"] else "nobody (orphan)",
           lambda r: r["session_id"]),
    _plain_column("BUFFER", "buffer_id"),
    _plain_column("OWNER", "owner_uid", wide=True),
]


def cmd_weights(client: Client, args: argparse.Namespace) -> Output:
    """Sealed buffers: the models resident on the device, each read by its engines from one copy."""
    weights = [_as_dict(b) for b in client.buffers() if b.sealed]
    return Output({"weights": weights}, "", WEIGHTS_COLUMNS, weights, "no sealed weights")


def cmd_delete(client: Client, args: argparse.Namespace) -> Output:
    freed = client.delete(args.name, args.uid)
    owner = f" of uid {args.uid}" if args.uid != -1 else ""
    return Output(
        {"name": args.name, "buffer_id": freed.buffer_id, "freed_bytes": freed.freed_bytes},
        f"deleted persistent buffer {args.name!r}{owner} (buffer {freed.buffer_id}), "
        f"freed {format_bytes(freed.freed_bytes)}",
    )


def reclaim_target(client: Client, args: argparse.Namespace) -> int:
    """The session named by ``--session``, or the one session with ``--pid`` or client ``--name``."""
    if args.session is not None:
        return args.session
    if args.pid is not None:
        what, matches = f"pid {args.pid}", [s for s in client.sessions() if s.pid == args.pid]
    else:
        what, matches = f"client name {args.name!r}", [s for s in client.sessions() if s.client_name == args.name]
    if not matches:
        raise NotFound(f"no session with {what}")
    if len(matches) > 1:
        ids = ", ".join(str(s.session_id) for s in matches)
        raise UsageError(f"{what} matches sessions {ids}: choose one with --session")
    return matches[0].session_id


UNANSWERED = {"pending", "ignored"}
"""Reclaim states of a session that has not answered: asked lately, or longer ago than the daemon's patience."""


def cmd_reclaim(client: Client, args: argparse.Namespace) -> Output:
    """Ask a session for memory; with ``--wait``, wait for its answer, and exit 4 where none came."""
    size = args.bytes
    sent = client.reclaim(reclaim_target(client, args), size)
    data = {"reclaim_id": sent.reclaim_id, "session_id": sent.session_id, "pid": sent.pid, "requested_bytes": size}
    text = f"asked session {sent.session_id} (pid {sent.pid}) to release {format_bytes(size)}"
    if args.wait == 0:
        return Output(data, text)
    deadline = time.monotonic() + args.wait
    while True:
        session = next((s for s in client.sessions() if s.session_id == sent.session_id), None)
        state = session.reclaim_state if session else "ended"
        if state != "pending" or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    released = session.reclaim_released_bytes if session and state == "answered" else -1
    data |= {"state": state, "released_bytes": released if released >= 0 else None}
    text += f"; {state}" + (f": released {format_bytes(released)}" if released >= 0 else "")
    if state not in UNANSWERED:
        return Output(data, text)
    complaint = (f"session {sent.session_id} (pid {sent.pid}) has not answered the reclaim after {args.wait:g}s: "
                 "nothing released yet; it may still answer (hbmctl sessions shows its RECLAIM)")
    return Output(data, text, complaint=complaint, exit_code=EXIT_UNANSWERED)


def ask(client: Client, instance: str, commands: list[str], args: argparse.Namespace) -> dict[str, Output]:
    """Each of ``commands`` asked of one instance, every record of their listings naming ``instance``."""
    outputs = {command: COMMANDS[command][0](client, args) for command in commands}
    for output in outputs.values():
        for item in output.items:
            item.setdefault("instance", instance)  # a status record names its own
    return outputs


def ask_every_instance(
    args: argparse.Namespace, names: list[str], commands: list[str]
) -> tuple[dict[str, Output | None], list[str]]:
    """Each of ``commands`` asked of every instance in ``names``, over one connection each: what each command shows
    for them all (None where none answered), and a complaint for each instance that did not answer.

    One instance's output is its own, and its error is raised. Of several,
    status shows one row each, those that did not answer marked so, and a
    listing the rows of those that answered, after an INSTANCE column.
    """
    answers: dict[str, list[Output]] = {command: [] for command in commands}
    failures = []
    for name in names:
        try:
            with open_client(args, name) as client:
                outputs = ask(client, name, commands, args)
        except HbmdError as exc:
            if len(names) == 1:
                raise
            failures.append(f"{name}: {exc.message}")
            outputs = {}
            if "status" in commands:
                record = UNREACHABLE | {"instance": name, "error": exc.message}
                outputs["status"] = Output({"instances": [record]}, "", STATUS_COLUMNS, [record])
        for command, output in outputs.items():
            answers[command].append(output)
    if len(names) == 1:
        return {command: listed[0] for command, listed in answers.items()}, failures
    return {command: _side_by_side(listed) for command, listed in answers.items()}, failures


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


def watch(args: argparse.Namespace, names: list[str]) -> int:
    """Show status, sessions and buffers every ``--interval`` seconds until Ctrl-C.

    On a terminal each frame replaces the last; elsewhere frames follow one
    another. Several instances show side by side, as the commands show them,
    those that do not answer marked so in status, and watching goes on.
    ``--json`` writes one JSON object per frame and line: ``{"time": ...,
    "instances": [...], "sessions": [...], "buffers": [...]}``, each session
    and buffer naming its instance. ``-o csv`` writes the status columns,
    after a ``time`` column (Unix seconds), one row per instance and frame: a
    time series, its header once.
    """
    fmt = "json" if args.json else args.output
    redraw = sys.stdout.isatty() and fmt not in ("json", "csv")
    # One instance: one connection for the whole watch, and its loss ends it; several are asked afresh each frame.
    client = open_client(args, names[0]) if len(names) == 1 else None
    headers = not args.no_headers
    try:
        while True:
            failures: list[str] = []
            if client is not None:
                outputs: dict[str, Output | None] = dict(ask(client, names[0], WATCHED, args))
            else:
                outputs, failures = ask_every_instance(args, names, WATCHED)
            now, stamp = time.time(), time.strftime("%H:%M:%S")
            if fmt == "json":
                record: dict[str, Any] = {"time": now, "sessions": [], "buffers": []}
                for output in outputs.values():
                    if output is not None:
                        record |= output.data
                frame = json.dumps(record, sort_keys=True)
            elif fmt == "csv":
                now_s = round(now, 3)
                at = Column("TIME", lambda r, t=now_s: t, lambda r, t=now_s: t)
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
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        if client is not None:
            client.close()


COMMANDS: dict[str, tuple[Callable[[Client, argparse.Namespace], Output] | None, str, str]] = {
    "status": (cmd_status, "budget, committed, budget left and device free bytes; one row per instance when there are several",
               "hbmctl status"),
    "sessions": (cmd_sessions, "connected worker sessions and what each holds", "hbmctl sessions --json"),
    "buffers": (cmd_buffers, "buffers with their segments, committed bytes and chunk counts", "hbmctl buffers --session 3"),
    "weights": (cmd_weights, "sealed weights resident on the device: size, readers and key (vLLM's in the name)",
                "hbmctl weights"),
    "delete": (cmd_delete, "delete an orphaned persistent buffer by name (yours; an admin names another user's with --uid)",
               "hbmctl delete --uid 1000 kv-cache-layer0"),
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
            p.add_argument("name", metavar="NAME", help="the persistent buffer's name")
            p.add_argument("--uid", type=whole_number, default=-1, metavar="N",
                           help="the buffer's owner, for admins (root, the daemon's user); default: you")
        if name == "reclaim":
            which = p.add_mutually_exclusive_group(required=True)
            which.add_argument("--session", type=whole_number, metavar="ID", help="the session to ask")
            which.add_argument("--pid", type=whole_number, metavar="PID", help="the session of this process")
            which.add_argument("--name", metavar="CLIENT", help="the session with this client name")
            p.add_argument("--bytes", type=size_argument, required=True, metavar="SIZE", help="how much to ask for: 512MiB, 8GiB, ...")
            p.add_argument("--wait", type=seconds(zero_ok=True), default=0.0, metavar="S",
                           help="wait up to S seconds for the answer, and exit 4 if none came (default: do not wait)")
        if name == "watch":
            p.add_argument("--interval", type=seconds(zero_ok=False), default=1.0, metavar="S", help="seconds between refreshes (default: 1)")
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
            answers, failures = ask_every_instance(args, names, [args.command])
            output = answers[args.command]
        else:
            with open_client(args, names[0]) as client:
                output = COMMANDS[args.command][0](client, args)
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
