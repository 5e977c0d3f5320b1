"""``hbmctl``'s commands: each is one client call plus formatting (see :mod:`hbmd.client.ctl`)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import Any

from hbmd.proto import SessionInfo, StatusReply
from hbmd.proto.errors import NotFound
from hbmd.proto.units import format_bytes

from .budget import budget_left
from .ctl_output import (
    EXIT_REFUSED,
    EXIT_UNANSWERED,
    Column,
    Output,
    UsageError,
    as_dict,
    bytes_column,
    duration,
    none_for_empty,
    none_for_negative,
    plain_column,
    render_table,
)
from .kept_names import is_kept
from .session import Client


def status_record(client: Client) -> dict[str, Any]:
    """An instance's status as JSON, in the words the table uses: budget left, device free.

    Budget left is what the daemon would admit.
    """
    s = client.status()
    record = none_for_negative(
        as_dict(s), "device_index", "device_free_bytes", "admissible_bytes", "held_for_guarantees_bytes", "credit_bytes"
    )
    # What does not exist is null, not an empty string or a zero time: no GPU's UUID on the host backend, no config.
    none_for_empty(record, "device_uuid", "config_path", "config_loaded_at", "config_reload_error",
                   "config_reload_failed_at")
    record["budget_left_bytes"] = budget_left(s)
    record["state"] = SERVING
    record["error"] = None
    for tenant in record["tenants"]:
        none_for_negative(tenant, "max_bytes")
    return record


SERVING, UNREACHABLE_STATE, NOT_RUNNING = "serving", "unreachable", "not running"
"""An instance's ``state`` in status: it answered; it did not (hung, or too slow for ``--timeout``); nothing serves
it (its daemon is gone and left its directory, which the next daemon of the instance clears)."""
UNREACHABLE = dict.fromkeys([f.name for f in dataclasses.fields(StatusReply)] + ["budget_left_bytes", "state"])
"""The record of an instance that did not answer: every figure null, beside its name, its state and the error."""


def _device(r: dict[str, Any]) -> str:
    if r["error"] is not None:
        return "-"
    return "host memory" if r["device_index"] is None else f"gpu {r['device_index']}"


INSTANCE_COLUMN = plain_column("INSTANCE", "instance")

STATUS_COLUMNS = [
    INSTANCE_COLUMN,
    Column("BACKEND", lambda r: r["backend"] or r["state"], lambda r: r["backend"] or r["state"]),
    Column("DEVICE", _device, lambda r: r["device_index"]),
    bytes_column("BUDGET", "budget_bytes"),
    bytes_column("COMMITTED", "committed_bytes"),
    bytes_column("LEASED", "leased_bytes"),
    bytes_column("CREDIT", "credit_bytes", wide=True),
    # Beside LEASED, what keeps BUDGET-LEFT below BUDGET - COMMITTED (the asker's tenant maximum aside).
    bytes_column("HELD-FOR-GUARANTEES", "held_for_guarantees_bytes"),
    bytes_column("BUDGET-LEFT", "budget_left_bytes"),
    bytes_column("HOST-TIER", "host_bytes", wide=True),
    bytes_column("DEVICE-FREE", "device_free_bytes"),
    plain_column("SESSIONS", "num_sessions"),
    bytes_column("RESERVED", "reserved_bytes", wide=True),
    plain_column("BUFFERS", "num_buffers", wide=True),
    plain_column("CHUNKS", "num_chunks", wide=True),
    plain_column("PID", "pid", wide=True),
    Column("UP", lambda r: "-" if r["uptime_s"] is None else duration(r["uptime_s"]), lambda r: r["uptime_s"], True),
    plain_column("VERSION", "daemon_version", wide=True),
    plain_column("UUID", "device_uuid", wide=True),
]


def cmd_status(client: Client, args: argparse.Namespace) -> Output:
    r = status_record(client)
    device = "host memory" if r["device_index"] is None else f"GPU {r['device_index']} ({r['device_uuid']})"
    share = 100 * r["committed_bytes"] / r["budget_bytes"] if r["budget_bytes"] else 0.0
    device_free = "unknown" if r["device_free_bytes"] is None else format_bytes(r["device_free_bytes"])
    text = "\n".join(
        [
            f"● hbmd instance {r['instance']} — {r['backend']} backend, pid {r['pid']}, up {duration(r['uptime_s'])}",
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
        if t["num_sessions"] or t["used_bytes"] or t["host_bytes"] or t["guaranteed_bytes"]
        or t["max_bytes"] is not None
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
    plain_column("SESSION", "session_id"),
    plain_column("PID", "pid"),
    plain_column("UID", "uid"),
    plain_column("GID", "gid", wide=True),
    plain_column("NAME", "client_name"),
    plain_column("TENANT", "tenant"),
    plain_column("BUFFERS", "num_buffers"),
    plain_column("CHUNKS", "num_chunks"),
    bytes_column("COMMITTED", "committed_bytes"),
    bytes_column("LEASED", "leased_bytes"),
    bytes_column("RESERVED", "reserved_bytes"),
    Column("AGE", lambda r: duration(r["connected_s"]), lambda r: r["connected_s"]),
    Column("STATE", lambda r: _session_state(r), lambda r: _session_state(r)),
    Column("RECLAIM", lambda r: _reclaim(r), lambda r: r["reclaim_state"]),
]


def cmd_sessions(client: Client, args: argparse.Namespace) -> Output:
    sessions = [_session_record(s) for s in client.sessions()]
    return Output({"sessions": sessions}, "", SESSION_COLUMNS, sessions, "no sessions")


def _session_record(session: SessionInfo) -> dict[str, Any]:
    """A session as JSON: a reclaim never asked has no state and no figures (null), not "" and 0."""
    record = none_for_empty(as_dict(session), "reclaim_state")
    if record["reclaim_state"] is None:
        record["reclaim_requested_bytes"] = None
    return none_for_negative(record, "reclaim_released_bytes")


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


def _last_holder(buffer: dict[str, Any]) -> str:
    """Whose session an orphan was (a daemon older than protocol 1.11, or one that restarted since, may not know)."""
    if buffer["session_id"] or not buffer.get("last_holder_pid"):
        return "-"
    return f"{buffer['last_holder'] or '?'} (pid {buffer['last_holder_pid']})"


def _expires(buffer: dict[str, Any]) -> str:
    """When the daemon frees an orphan nobody attaches or grafts; "never" for one kept until deleted."""
    if buffer["session_id"]:
        return "-"
    if not buffer.get("expires_at"):
        return "never"
    return f"in {duration(max(0.0, buffer['expires_at'] - time.time()))}"


BUFFER_COLUMNS = [
    plain_column("BUFFER", "buffer_id"),
    Column("SESSION", lambda r: r["session_id"] or "orphan", lambda r: r["session_id"] or ""),
    plain_column("NAME", "name"),
    Column("PERSISTENT", lambda r: "yes" if r["persistent"] else "no", lambda r: int(r["persistent"])),
    Column("LAST-HOLDER", _last_holder, lambda r: "" if _last_holder(r) == "-" else _last_holder(r)),
    Column("EXPIRES", _expires, lambda r: r.get("expires_at") or ""),
    plain_column("OWNER", "owner_uid", wide=True),
    plain_column("SEGMENTS", "num_segments"),
    bytes_column("PER-SEGMENT", "bytes_per_segment"),
    bytes_column("SEG-CAPACITY", "segment_capacity_bytes"),
    # Mid-defragment a buffer holds its new chunks beside the old, and status counts both: so does COMMITTED,
    # so that the column adds up to status; PENDING says how much of it is the new chunks.
    Column("COMMITTED", lambda r: format_bytes(_committed(r)), _committed),
    bytes_column("PENDING", "pending_bytes", wide=True),
    bytes_column("RESERVED", "reserved_bytes", wide=True),
    plain_column("CHUNKS", "num_chunks"),
    plain_column("TIER", "tier", wide=True),
    Column("SEALED", lambda r: "yes" if r.get("sealed") else "no", lambda r: int(bool(r.get("sealed")))),
    plain_column("READERS", "readers"),
    # Declared again by the processes that map it after a cold restart: counted, not attachable elsewhere.
    Column("KEPT-BY", lambda r: "mappers" if r.get("held_elsewhere") else "hbmd",
           lambda r: int(bool(r.get("held_elsewhere"))), wide=True),
]


def cmd_buffers(client: Client, args: argparse.Namespace) -> Output:
    # An orphan is held by no session, a sealed or anonymous buffer holds no name unsealed: null, where the wire says 0.
    buffers = [none_for_empty(as_dict(b), "session_id", "orphaned_at", "expires_at", "last_holder", "last_holder_pid",
                              "unsealed_since")
               for b in client.buffers(args.session)]
    return Output({"buffers": buffers}, "", BUFFER_COLUMNS, buffers, "no buffers")


WEIGHTS_COLUMNS = [
    plain_column("NAME", "name"),
    Column("SIZE", lambda r: format_bytes(r["physical_bytes"]), lambda r: r["physical_bytes"]),
    plain_column("READERS", "readers"),
    Column("HELD-BY", lambda r: f"session {r['session_id']}" if r["session_id"] else "nobody (orphan)",
           lambda r: r["session_id"]),
    plain_column("BUFFER", "buffer_id"),
    plain_column("OWNER", "owner_uid", wide=True),
]


def cmd_weights(client: Client, args: argparse.Namespace) -> Output:
    """Sealed buffers: the models resident on the device, each read by its engines from one copy."""
    weights = [none_for_empty(as_dict(b), "session_id") for b in client.buffers() if b.sealed]
    return Output({"weights": weights}, "", WEIGHTS_COLUMNS, weights, "no sealed weights")


def cmd_delete(client: Client, args: argparse.Namespace) -> Output:
    if args.engine is not None:
        return delete_kept(client, args.engine, args.uid)
    freed = client.delete(args.name, args.uid)
    owner = f" of uid {args.uid}" if args.uid != -1 else ""
    return Output(
        {"name": args.name, "buffer_id": freed.buffer_id, "freed_bytes": freed.freed_bytes},
        f"deleted persistent buffer {args.name!r}{owner} (buffer {freed.buffer_id}), "
        f"freed {format_bytes(freed.freed_bytes)}",
    )


def delete_kept(client: Client, engine: str, uid: int) -> Output:
    """Free every KV buffer vLLM engine ``engine`` keeps for its successor (all ranks, replicas and generations) that no
    running engine holds; refused (exit 3) for those one holds."""
    owner = os.getuid() if uid == -1 else uid
    kept = [b for b in client.buffers(owner_uid=owner) if is_kept(b.name, engine)]
    if not kept:
        raise NotFound(f"vLLM engine {engine!r} keeps no KV cache here (of uid {owner})")
    held = [b for b in kept if b.session_id]
    deleted = [(b, client.delete(b.name, uid)) for b in kept if not b.session_id]
    freed = sum(f.freed_bytes for _, f in deleted)
    text = "\n".join([f"deleted {b.name!r} (buffer {f.buffer_id}), freed {format_bytes(f.freed_bytes)}"
                      for b, f in deleted] + [f"kept KV cache of engine {engine!r}: freed {format_bytes(freed)}"])
    output = Output({"engine": engine, "freed_bytes": freed,
                     "deleted": [{"name": b.name, "buffer_id": f.buffer_id, "freed_bytes": f.freed_bytes}
                                 for b, f in deleted],
                     "held": [{"name": b.name, "session_id": b.session_id} for b in held]}, text)
    if held:
        output.exit_code = EXIT_REFUSED
        output.complaint = "; ".join(f"{b.name} is held by session {b.session_id}: a running engine {engine!r} holds "
                                     "it; stop that engine first" for b in held)
    return output


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
    # Not waited for, the answer is not known: pending, as the daemon has it until the session answers.
    data = {"reclaim_id": sent.reclaim_id, "session_id": sent.session_id, "pid": sent.pid, "requested_bytes": size,
            "state": "pending", "released_bytes": None}
    text = f"asked session {sent.session_id} (pid {sent.pid}) to release {format_bytes(size)}"
    if args.wait == 0:
        return Output(data, text)
    deadline = time.monotonic() + args.wait
    while True:
        session = next(iter(client.sessions(sent.session_id)), None)
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
