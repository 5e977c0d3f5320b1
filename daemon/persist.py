"""What outlives the daemon: its state, journaled, and its chunks, kept by someone else.

A daemon that restarts under live engines must come back with everything it
had handed out: every buffer (ordinary and persistent, sealed or not, mid-
defragment or not) with its layout, owner, tenant and readers, every
session with its lease and its last answer, and the memory itself. The
memory cannot outlive the process on its own, so something else holds a
descriptor for every chunk:

- under systemd, the service manager's file-descriptor store: every chunk
  is parked (``FDSTORE=1``, one name per chunk) as it is made and unparked
  as it goes, and the state is journaled under the state directory before
  any reply acknowledges a change (:class:`Persistence`);
- in a live handover (``hbmd --takeover``), the successor: the old daemon
  sends an :func:`image_of` its state and every chunk's descriptor
  (:func:`chunk_fds`), and stops only once the new one serves.

Either way the new daemon rebuilds the state with :func:`restore`: sessions
come back *resuming*, each waiting for its client to take it back with the
credential of its last welcome; one that does not come back in time ends as
a dead one does. A buffer whose descriptors did not all come back, or that
the backend cannot adopt, is logged as lost and the rest is restored: a
restart never fails over one buffer, which under ``Restart=on-failure``
would loop forever.

The journal is append-only: msgpack records ``[kind, value]`` (``meta``, a
session ``s`` or buffer ``b`` as it now is, ``b+`` the chunks a buffer
gained and its new sizes, so that a commit costs the same at 10 chunks as at
10,000, ``-s``/``-b`` one gone),
rewritten whole from the state once it has grown to several times the size
of the state. Records are written whole with one ``write``; the page cache
keeps them across a crash of the daemon, which is what the memory survives
too (not a crash of the machine), so nothing is synced to disk. A torn last
record (a full disk) is ignored and logged. Journals of persistent buffers
only, written before version 4 (JSON), are read as well.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgpack
from hbmd.proto import TIER_DEVICE, TIER_HOST
from hbmd.proto.errors import HbmdError, NotFound
from hbmd.proto.undo import Undo
from hbmd.proto.units import format_bytes, round_up

from .backends import parkable
from .notify import SystemdNotifier
from .state import Answer, Buffer, Chunk, Session, State, Tenant

log = logging.getLogger("hbmd.persist")

JOURNAL_VERSION = 6
"""6: a buffer's chunks in the host tier (``host``: their ids), which an older daemon would count as device memory;
5: a buffer that only grew is journaled by its new chunks (``b+``); 4: every session and buffer, msgpack records; 3
(JSON, persistent buffers only) recorded a chunk as ``[id, offset, size]``, 2 added a fourth field, always 0, and each
segment's capacity and size; version 1's equal segments are read too. A buffer's grace period as an orphan (``orphan``)
needs no new version: a daemon that does not know it keeps the orphan until deleted, as before it."""
COMPACT_MIN_BYTES = 1 << 20
COMPACT_RATIO = 4
"""The journal is rewritten whole once it is this many times the size of the state it describes."""
RESUME_WINDOW_S = 30.0
"""How long a restored session waits for its client by default (``--resume-timeout``)."""

Image = dict[str, Any]
"""A state as plain data: ``meta``, ``sessions`` and ``buffers`` (records by id)."""


MAX_PARKED = 16384
"""The most chunks parked with the service manager (``FileDescriptorStoreMax`` in ``deploy/hbmd@.service``)."""
MAX_NAMES_CHARS = (128 << 10) - 64
"""What the names of the parked chunks may take, a colon each: the service manager passes them back in one
environment variable, ``LISTEN_FDNAMES``, and the kernel refuses an ``execve`` where a variable is over 128 KiB
(``MAX_ARG_STRLEN``), so that the service would not start again. 16384 names of 6 characters fit (chunk ids below
60 million); longer ones leave room for fewer."""


def chunk_name(chunk_id: int) -> str:
    """The FD-store name of a chunk, whether it backs a buffer, waits in a defragment or is leased: ``c`` and its id
    in base 36 (short: see :data:`MAX_PARKED`)."""
    digits = ""
    while True:
        chunk_id, digit = divmod(chunk_id, 36)
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"[digit] + digits
        if not chunk_id:
            return "c" + digits


def legacy_chunk_name(buffer_id: int, chunk_id: int) -> str:
    """The name a daemon of journal version 3 or older parked a persistent buffer's chunk under."""
    return f"hbmd-c{buffer_id}-{chunk_id}"


# the state as records


def session_record(session: Session) -> dict[str, Any]:
    answer = session.answer
    return {
        "id": session.session_id, "pid": session.pid, "uid": session.uid, "gid": session.gid,
        "name": session.client_name, "tenant": session.tenant.name, "admin": session.admin,
        "wants_lease": session.wants_lease, "wants_credit": session.wants_credit,
        "credential": session.credential_hash,
        "previous_credential": session.previous_credential_hash,
        "lease": [[c.chunk_id, c.size] for c in session.lease.values()],
        "credit": session.credit,
        "demoted": session.demoted_under_pressure,
        "answer": None if answer is None else [answer.request_id, answer.frames, answer.buffer_id, answer.chunk_ids],
    }


def buffer_record(buffer: Buffer[Any, Any]) -> dict[str, Any]:
    return {
        "id": buffer.buffer_id, "name": buffer.name, "persistent": buffer.persistent, "shareable": buffer.shareable,
        "owner": buffer.owner.session_id if buffer.owner is not None else 0, "uid": buffer.owner_uid,
        "tenant": buffer.tenant.name, "capacity": buffer.capacity, "capacities": buffer.segment_capacities,
        "sizes": buffer.segment_sizes, "sealed": buffer.sealed, "readers": [[s, n] for s, n in buffer.readers.items()],
        "chunks": [[c.chunk_id, c.offset, c.size] for c in buffer.chunks],
        "pending": [[c.chunk_id, c.offset, c.size] for c in buffer.pending],
        "held": [c.chunk_id for c in (*buffer.chunks, *buffer.pending) if c.handle is None],
        "host": [c.chunk_id for c in (*buffer.chunks, *buffer.pending) if c.tier == TIER_HOST],
        "orphan": [buffer.keep_orphan_s, buffer.orphaned_at, buffer.expires_at, *buffer.last_holder],
    }


def _shape(buffer: Buffer[Any, Any]) -> tuple[tuple[Any, ...], int, int]:
    """What a buffer's record was journaled from: what of it may change besides its chunks and sizes (its layout,
    name and user are fixed at its creation), then how many chunks and the last one's id. Chunk ids are never
    reused, so a buffer whose first chunks are still these only gained chunks."""
    head = (buffer.owner.session_id if buffer.owner else 0, buffer.tenant.name, buffer.sealed,
            tuple(sorted(buffer.readers.items())), tuple(c.chunk_id for c in buffer.pending), buffer.expires_at)
    return head, len(buffer.chunks), buffer.chunks[-1].chunk_id if buffer.chunks else 0


def _growth_record(buffer: Buffer[Any, Any], since: int) -> dict[str, Any]:
    """The chunks a buffer gained after its first ``since``, and its sizes now."""
    gained = buffer.chunks[since:]
    return {"id": buffer.buffer_id, "sizes": buffer.segment_sizes,
            "chunks": [[c.chunk_id, c.offset, c.size] for c in gained],
            "held": [c.chunk_id for c in gained if c.handle is None],
            "host": [c.chunk_id for c in gained if c.tier == TIER_HOST]}


def _only_grew(buffer: Buffer[Any, Any], count: int, last_id: int) -> bool:
    """Whether the buffer's first ``count`` chunks, the last of them ``last_id``, are still its first ones."""
    return count <= len(buffer.chunks) and (count == 0 or buffer.chunks[count - 1].chunk_id == last_id)


def _journaled_as(session: Session) -> tuple[Any, ...]:
    """What of a session changes its record (the rest is fixed at its hello)."""
    answer = session.answer
    return (answer.request_id if answer else 0, session.credential_hash, session.previous_credential_hash,
            tuple(session.lease), session.credit, session.tenant.name, session.demoted_under_pressure)


def _kept(session: Session) -> bool:
    """Whether a session outlives a restart: an observer (a tool) holds nothing and connects anew."""
    return not session.observer


def image_of(state: State[Any, Any]) -> Image:
    """The whole state as records: what a journal is rewritten with, and what a live handover sends."""
    return {
        "meta": {"version": JOURNAL_VERSION, "instance": state.backend.instance},
        "sessions": {s.session_id: session_record(s) for s in state.sessions.values() if _kept(s)},
        "buffers": {b.buffer_id: buffer_record(b) for b in state.buffers.values()},
    }


def every_chunk(state: State[Any, Any]) -> Iterable[tuple[Chunk[Any], Any]]:
    """Every chunk the state holds, with its arena."""
    for buffer in state.buffers.values():
        for chunk in (*buffer.chunks, *buffer.pending):
            if chunk.handle is not None:  # one held only by its mappers has nothing to keep here
                yield chunk, buffer.arena
    for session in state.sessions.values():
        for chunk in session.lease.values():
            yield chunk, state.leases.arena


def chunk_fds(state: State[Any, Any]) -> Iterable[tuple[str, int]]:
    """A new descriptor for every chunk the state holds, by FD-store name; the caller closes each.

    Exported as for a client, not as for parking: parking keeps a copy of each FD for the chunk's first client, and
    a handover of 10,000 chunks would then hold twice as many descriptors as it sends.
    """
    for chunk, arena in every_chunk(state):
        yield chunk_name(chunk.chunk_id), state.backend.export(arena, chunk.handle)


def pack_image(image: Image) -> bytes:
    return msgpack.packb(image, use_bin_type=True)


def unpack_image(data: bytes) -> Image:
    image = msgpack.unpackb(data, raw=False, strict_map_key=False)
    if not isinstance(image, dict) or not isinstance(image.get("meta"), dict):
        raise ValueError("not a state image")
    return image


# restoring


class NewerState(ValueError):
    """A journal or handover written by a newer daemon: this one does not know what it may hold."""


def restore(state: State[Any, Any], image: Image, fds: dict[str, int], resume_window_s: float) -> tuple[int, int]:
    """Rebuild the state of ``image`` from the chunks' descriptors in ``fds`` (taken out of it as they are adopted;
    the caller closes what is left); returns how many sessions and buffers came back.

    Sessions come back resuming, until ``resume_window_s`` from now.
    Raises :class:`NewerState`, with nothing restored, for an image of a
    later version than this daemon's.
    """
    version = image["meta"].get("version") or JOURNAL_VERSION
    if version > JOURNAL_VERSION:
        raise NewerState(f"it is of version {version}, newer than this daemon's {JOURNAL_VERSION}: run the newer hbmd")
    resume_by = time.monotonic() + resume_window_s
    records = list(image.get("buffers", {}).values())
    short = _owners_of_incomplete(records, fds, version)
    sessions = 0
    for record in image.get("sessions", {}).values():
        if _field(record, "id") in short:
            # Resumed, it would go on mapping memory the daemon no longer counts: refused its resume, its client starts
            # over and declares what it maps, as after a cold restart.
            log.warning("session %s is not restored: a buffer of it did not come back whole; its client starts over",
                        _field(record, "id"))
            continue
        try:
            _restore_session(state, record, fds, resume_by)
            sessions += 1
        except Exception as exc:  # whatever the journal or the backend raised: lose this session, not the daemon
            log.error("session %s is lost: %s", _field(record, "id"), exc)
    buffers = 0
    for record in records:
        try:
            _restore_buffer(state, record, fds, version)
            buffers += 1
        except Exception as exc:
            log.error("buffer %r (%s) is lost: %s", _field(record, "name"), _journaled_size(record), exc)
    return sessions, buffers


def _field(record: Any, key: str) -> Any:
    return record.get(key) if isinstance(record, dict) else None


def _restore_session(state: State[Any, Any], record: dict[str, Any], fds: dict[str, int], resume_by: float) -> None:
    granule = state.backend.granularity
    lease: list[Chunk[Any]] = []
    with Undo() as undo:
        arena = state.leases.adopted_arena()
        claimed = []
        for chunk_id, size in record["lease"]:
            name = chunk_name(int(chunk_id))
            if name not in fds or int(size) != granule:
                continue  # a granule that did not come back is one the client gives up at its resume
            handle = parkable(state.backend).adopt(arena, 0, granule, fds[name])
            undo.push(state.backend.release, arena, handle)
            lease.append(Chunk(int(chunk_id), 0, granule, handle))
            claimed.append(name)
        answer = record["answer"]
        session = Session(
            session_id=int(record["id"]), token=os.urandom(16).hex(), pid=int(record["pid"]), uid=int(record["uid"]),
            gid=int(record["gid"]), client_name=str(record["name"]), tenant=Tenant(str(record["tenant"])),
            admin=bool(record["admin"]), wants_lease=bool(record["wants_lease"]),
            wants_credit=bool(record.get("wants_credit", False)),
            credential_hash=str(record["credential"]),
            previous_credential_hash=str(record.get("previous_credential", "")),
            # Its client promotes what it demoted for the daemon once told there is room: the successor tells it.
            demoted_under_pressure=bool(record.get("demoted", False)),
            answer=None if answer is None else Answer(int(answer[0]), answer[1], int(answer[2]), list(answer[3])),
        )
        state.restore_session(session, lease, int(record.get("credit", 0)), resume_by)
    _claimed(fds, claimed)


def _claimed(fds: dict[str, int], names: list[str]) -> None:
    """The chunks parked under ``names`` are adopted (the backend holds copies): close the descriptors passed in.

    Until then they stay in ``fds``, so that those of a session that is not
    restored are closed and unparked with the unclaimed ones.
    """
    for name in names:
        os.close(fds.pop(name))


def _owners_of_incomplete(records: list[Any], fds: dict[str, int], image_version: int) -> set[Any]:
    """The journaled ids of the sessions owning or reading a buffer that cannot come back whole: a descriptor of it was
    not passed back (a service manager that dropped its store), or its record cannot be read."""
    owners = set()
    for record in records:
        try:
            complete = all(name in fds for name in _needed(record, _layout(record), image_version))
        except Exception:  # a record the restore itself reports lost
            complete = False
        if not complete:
            owners.add(_field(record, "owner"))
            try:
                owners.update(int(session_id) for session_id, _ in record.get("readers", []))
            except (TypeError, ValueError, AttributeError):
                pass  # readers that cannot be read are no session's
    owners.discard(0)
    owners.discard(None)
    return owners


def _layout(record: dict[str, Any]) -> list[tuple[str, tuple[int, int, int]]]:
    """Each journaled chunk of a buffer with the part it belongs to (``chunks``, or ``pending`` mid-defragment)."""
    layout = [("chunks", _chunk_layout(c)) for c in record["chunks"]]
    return layout + [("pending", _chunk_layout(c)) for c in record.get("pending", [])]


def _needed(record: dict[str, Any], layout: list[tuple[str, tuple[int, int, int]]], image_version: int) -> list[str]:
    """The names its chunks were parked under, but for those held only by the processes that map them."""
    buffer_id = int(record["id"])
    named = legacy_chunk_name if int(image_version) < 4 else lambda _, chunk_id: chunk_name(chunk_id)
    held = {int(chunk_id) for chunk_id in record.get("held", [])}
    return [named(buffer_id, chunk_id) for _, (chunk_id, _, _) in layout if chunk_id not in held]


def _restore_buffer(state: State[Any, Any], record: dict[str, Any], fds: dict[str, int], image_version: int) -> None:
    """Adopt one journaled buffer, taking its FDs out of ``fds``; raises, taking none, where it cannot be adopted
    whole."""
    backend = parkable(state.backend)
    buffer_id = int(record["id"])
    layout = _layout(record)
    held = {int(chunk_id) for chunk_id in record.get("held", [])}
    host = {int(chunk_id) for chunk_id in record.get("host", [])}
    needed = _needed(record, layout, image_version)
    missing = [name for name in needed if name not in fds]
    if missing:
        shown = ", ".join(missing[:4])
        raise NotFound(f"{len(missing)} of its {len(needed)} parked descriptors did not come back ({shown})")
    owner_id = int(record.get("owner", 0))
    owner = state.sessions.get(owner_id) if owner_id else None
    if owner_id and owner is None and not record["persistent"]:
        # As when a session ends: its anonymous buffers go with it, its persistent ones stay, orphans.
        raise NotFound(f"its session {owner_id} did not come back")
    arena = backend.adopt_arena(round_up(int(record["capacity"]), backend.granularity), bool(record["shareable"]))
    adopted: dict[str, list[Chunk[Any]]] = {"chunks": [], "pending": []}
    with Undo() as undo:
        undo.push(backend.close_arena, arena)
        names = iter(needed)
        for part, (chunk_id, offset, size) in layout:
            handle = None
            if chunk_id not in held:
                name = next(names)
                handle = backend.adopt(arena, offset, size, fds[name])
                undo.push(backend.release, arena, handle)
                # The backend holds its own copy: one descriptor a chunk, not two, at any moment of a restore of
                # thousands. Should a later chunk fail, the name is unparked with those of buffers not restored.
                os.close(fds.pop(name))
            tier = TIER_HOST if chunk_id in host else TIER_DEVICE
            adopted[part].append(Chunk(chunk_id, offset, size, handle, tier=tier))
        capacities, sizes = _segments(record)
        state.restore_buffer(
            buffer_id, str(record["name"]), bool(record["persistent"]), owner, int(record["uid"]),
            str(record["tenant"]), int(record["capacity"]), capacities, sizes, bool(record["shareable"]), arena,
            adopted["chunks"], adopted["pending"], bool(record.get("sealed", False)),
            {int(s): int(n) for s, n in record.get("readers", [])}, _orphan(record),
        )
    log.info("restored buffer %d %r: %s in %d chunks", buffer_id, record["name"],
             format_bytes(sum(c.size for c in adopted["chunks"])), len(adopted["chunks"]))


def _orphan(record: dict[str, Any]) -> tuple[float, float, float, tuple[str, int]]:
    """A record's grace period as an orphan, when it became one, its deadline (Unix times: see
    ``daemon/state/orphans.py``) and who held it last; a buffer journaled without them is kept until deleted."""
    keep, orphaned_at, expires_at, holder, pid = record.get("orphan") or (0.0, 0.0, 0.0, "", 0)
    return float(keep), float(orphaned_at), float(expires_at), (str(holder), int(pid))


def _chunk_layout(chunk: list) -> tuple[int, int, int]:
    """A journaled chunk's ``(id, offset, size)``; version 2 wrote a fourth field, always 0."""
    if len(chunk) not in (3, 4) or chunk[3:] not in ([], [0]):
        raise ValueError(f"journaled chunk {chunk[:5]!r} is not [id, offset, size]")
    return int(chunk[0]), int(chunk[1]), int(chunk[2])


def _segments(record: dict) -> tuple[list[int], list[int]]:
    """A record's segment capacities and committed sizes, from any journal version."""
    if "capacities" in record:
        return [int(c) for c in record["capacities"]], [int(n) for n in record["sizes"]]
    if "segment_capacities" in record:
        return [int(c) for c in record["segment_capacities"]], [int(n) for n in record["segment_sizes"]]
    count = int(record["num_segments"])
    return [int(record["capacity"]) // count] * count, [int(record["bytes_per_segment"])] * count


def _journaled_size(record: Any) -> str:
    """The bytes a record says its buffer held, for the log line that reports it lost."""
    try:
        return format_bytes(sum(int(chunk[2]) for chunk in record["chunks"]))
    except (KeyError, TypeError, ValueError, IndexError):
        return "size unknown"


# the journal


class Journal:
    """The append-only journal file of one instance's state (see the module's docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = -1
        self.size = 0

    def read(self) -> Image:
        """The state the journal describes: its records replayed (a v3 JSON journal beside it read where there is no
        v4 one); empty where there is none. Raises ``ValueError`` for a journal that cannot be read."""
        image: Image = {"meta": {}, "sessions": {}, "buffers": {}}
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return _legacy_image(self._legacy) or image
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(data), 1))
        unpacker.feed(data)
        used = 0
        try:
            for kind, value in unpacker:
                if kind == "meta":
                    image["meta"] = value
                elif kind == "image":
                    image = value
                elif kind in ("s", "b"):
                    image["sessions" if kind == "s" else "buffers"][value["id"]] = value
                elif kind == "b+":
                    grown = image["buffers"][value["id"]]
                    grown["sizes"] = value["sizes"]
                    grown["chunks"].extend(value["chunks"])
                    grown.setdefault("held", []).extend(value["held"])
                    grown.setdefault("host", []).extend(value.get("host", []))
                elif kind in ("-s", "-b"):
                    image["sessions" if kind == "-s" else "buffers"].pop(value, None)
                used = unpacker.tell()
        except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
            raise ValueError(f"record at byte {used}: {exc}") from None
        if used < len(data):
            log.warning("journal %s ends in a torn record (%d bytes) : ignored", self.path, len(data) - used)
        return image

    def rewrite(self, image: Image) -> None:
        """Replace the journal by ``image`` (written aside, then renamed over it); raises ``OSError``."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        data = msgpack.packb(["image", image], use_bin_type=True)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                _write_all(fd, data)
            finally:
                os.close(fd)
            tmp.replace(self.path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise
        self.close()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        self.size = len(data)
        self._legacy.unlink(missing_ok=True)

    @property
    def _legacy(self) -> Path:
        """Where a journal written before version 4 lies."""
        return self.path.with_name(self.path.name + ".json")

    def append(self, records: list[list[Any]]) -> None:
        """Append ``records`` in one write; raises ``OSError``."""
        data = b"".join(msgpack.packb(r, use_bin_type=True) for r in records)
        _write_all(self._fd, data)
        self.size += len(data)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _legacy_image(path: Path) -> Image | None:
    """The persistent buffers of a journal written before version 4 (JSON), as orphans; None where there is none."""
    try:
        journal = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.error("journal %s unreadable (%s): persistent buffers are not restored", path, exc)
        return None
    buffers = {}
    for entry in journal.get("buffers", []):
        if isinstance(entry, dict) and "buffer_id" in entry:
            buffers[entry["buffer_id"]] = {
                **entry, "id": entry["buffer_id"], "persistent": True, "owner": 0, "uid": entry["owner_uid"],
                "readers": [], "pending": [],
            }
    return {"meta": {"version": journal.get("version") or 3}, "sessions": {}, "buffers": buffers}


class Persistence:
    """Keeps the state restartable under systemd: parks every chunk with the service manager as it is made (and
    unparks it as it goes), and journals every change before it is acknowledged (:meth:`sync`)."""

    def __init__(self, state: State[Any, Any], notifier: SystemdNotifier, journal: Path,
                 resume_window_s: float = RESUME_WINDOW_S, max_parked: int = MAX_PARKED) -> None:
        self.state = state
        self.notifier = notifier
        self.journal = Journal(journal)
        self.resume_window_s = resume_window_s
        self.max_parked = min(max_parked, MAX_PARKED)
        state.changed = set()
        state.chunks.fd_store = self
        self._parked: set[int] = set()
        """Ids of the chunks parked."""
        self._names_chars = 0
        """What their names take in ``LISTEN_FDNAMES``."""
        self._unparking: list[str] = []
        """Names of chunks released since the last sync, unparked once it has journaled their release."""
        self._sessions: dict[int, tuple[Any, ...]] = {}
        """What each kept session's record was last journaled from."""
        self._buffers: dict[int, tuple[tuple[Any, ...], int, int]] = {}
        """What each buffer's record was last journaled from (:func:`_shape`)."""
        self.degraded = False
        """The last journal write failed (the state directory is full, say)."""
        self._image_bytes = 0
        """The size of the journal when last rewritten whole: what the state takes."""
        self._full = False
        """Whether chunks went unparked for want of room (logged once until there is room again)."""

    # parking, as chunks come and go (the state's Chunks calls these)

    def made(self, chunk: Chunk[Any], arena: Any) -> None:
        """Park a chunk just made: from now on it outlives the daemon."""
        name = chunk_name(chunk.chunk_id)
        if len(self._parked) >= self.max_parked or self._names_chars + len(name) + 1 > MAX_NAMES_CHARS:
            if not self._full:
                log.warning("%d chunks are parked with the service manager, the most it can pass back "
                            "(FileDescriptorStoreMax, LISTEN_FDNAMES): the buffers of further chunks will not survive "
                            "a restart (defragmenting makes fewer chunks)", len(self._parked))
                self._full = True
            return
        try:
            fd = parkable(self.state.backend).parked_fd(arena, chunk.handle)
        except (HbmdError, OSError) as exc:
            log.warning("cannot park chunk %d with the service manager: %s", chunk.chunk_id, exc)
            return
        try:
            if self.notifier.send_fds([fd], name):
                self._parked.add(chunk.chunk_id)
                self._names_chars += len(name) + 1
        finally:
            os.close(fd)

    def released(self, chunk: Chunk[Any]) -> None:
        """Unpark a chunk released, once the journal says so (:meth:`sync`): the service manager must not keep its
        memory alive, but a daemon that dies before the journal is written comes back from a journal that still
        lists the chunk, and finds it."""
        if chunk.chunk_id in self._parked:
            name = chunk_name(chunk.chunk_id)
            self._parked.discard(chunk.chunk_id)
            self._names_chars -= len(name) + 1
            self._unparking.append(name)
            self._full = False

    # the journal

    def sync(self) -> None:
        """Journal what changed since the last sync, then unpark the chunks released meanwhile."""
        records = self._buffer_records() + self._session_records()
        if records:
            self._journal(records)
        for name in self._unparking:
            self.notifier.remove_fds(name)
        self._unparking.clear()

    def _journal(self, records: list[list[Any]]) -> None:
        try:
            if self.degraded or not self.journal.size or self.journal.size > max(
                COMPACT_MIN_BYTES, COMPACT_RATIO * self._image_bytes
            ):
                self._rewrite()  # after a failed write too: the records it lost are in the state
            else:
                self.journal.append(records)
        except OSError as exc:
            self._failed(exc)
            return
        if self.degraded:
            log.warning("persistence restored: the journal %s is written again", self.journal.path)
            self.degraded = False

    def _rewrite(self) -> None:
        self.journal.rewrite(image_of(self.state))
        self._image_bytes = self.journal.size

    def _buffer_records(self) -> list[list[Any]]:
        changed = self.state.changed
        if not changed:
            return []
        records: list[list[Any]] = []
        for buffer_id in sorted(changed):
            buffer = self.state.buffers.get(buffer_id)
            if buffer is None:
                self._buffers.pop(buffer_id, None)
                records.append(["-b", buffer_id])
                continue
            before, shape = self._buffers.get(buffer_id), _shape(buffer)
            self._buffers[buffer_id] = shape
            if before is not None and before[0] == shape[0] and _only_grew(buffer, before[1], before[2]):
                records.append(["b+", _growth_record(buffer, before[1])])
            else:
                records.append(["b", buffer_record(buffer)])
        changed.clear()
        return records

    def _session_records(self) -> list[list[Any]]:
        records: list[list[Any]] = []
        kept = {s.session_id: s for s in self.state.sessions.values() if _kept(s)}
        for session_id in sorted(self._sessions.keys() - kept.keys()):
            del self._sessions[session_id]
            records.append(["-s", session_id])
        for session_id, session in kept.items():
            seen = _journaled_as(session)
            if self._sessions.get(session_id) != seen:
                self._sessions[session_id] = seen
                records.append(["s", session_record(session)])
        return records

    def _failed(self, exc: OSError) -> None:
        # A full or broken state directory must not stop the daemon: it serves on, and writes again at the next change.
        if not self.degraded:
            log.error(
                "persistence degraded: cannot write the journal %s (%s); changes since will not survive a restart "
                "until it can be written (retried at the next change)",
                self.journal.path, exc.strerror or exc,
            )
        self.degraded = True

    # starting

    def restore(self, passed: dict[str, list[int]]) -> tuple[int, int]:
        """Rebuild the state the journal describes from the FDs the service manager passed back, then journal it
        afresh; returns how many sessions and buffers came back. FDs nobody claims are closed and unparked.

        Raises :class:`NewerState` for a newer daemon's journal, leaving it and the store as they are.
        """
        try:
            image = self.journal.read()
        except (OSError, ValueError) as exc:
            log.error("journal %s unreadable (%s): nothing is restored", self.journal.path, exc)
            image = {}
        fds = {name: fds[0] for name, fds in passed.items()}
        for extra in passed.values():
            for fd in extra[1:]:
                os.close(fd)
        try:
            counts = restore(self.state, image, fds, self.resume_window_s) if image else (0, 0)
        except NewerState:
            for fd in fds.values():
                os.close(fd)
            raise
        for name, fd in fds.items():
            # Parked for a chunk that is not coming back (gone from the journal, or lost above): let it go.
            os.close(fd)
            self.notifier.remove_fds(name)
        parked_before = {name for name in passed if name not in fds}
        for chunk, arena in every_chunk(self.state):
            name = chunk_name(chunk.chunk_id)
            if name in parked_before:
                self._parked.add(chunk.chunk_id)
                self._names_chars += len(name) + 1
            else:
                # Parked by an older daemon under another name, which it forgets: under this one from now on.
                self.made(chunk, arena)
        for name in parked_before - {chunk_name(c) for c in self._parked}:
            self.notifier.remove_fds(name)
        self._start_journal()
        return counts

    def start_afresh(self, passed: dict[str, list[int]]) -> None:
        """The state came from elsewhere (a daemon taken over): let go of what the store passed back, and park and
        journal all of the state."""
        for name, fds in passed.items():
            for fd in fds:
                os.close(fd)
            self.notifier.remove_fds(name)
        for chunk, arena in every_chunk(self.state):
            # The daemon taken over may have parked it with this same service under this same name: the store
            # keeps one descriptor a name, not one from each daemon (10,000 chunks would hold 20,000).
            self.notifier.remove_fds(chunk_name(chunk.chunk_id))
            self.made(chunk, arena)
        self._start_journal()

    def _start_journal(self) -> None:
        """Take the state as it is now as journaled, and write it whole; from here on each change is a record."""
        assert self.state.changed is not None  # tracked since __init__
        self.state.changed.clear()
        self._sessions = {s.session_id: _journaled_as(s) for s in self.state.sessions.values() if _kept(s)}
        self._buffers = {b.buffer_id: _shape(b) for b in self.state.buffers.values()}
        try:
            self._rewrite()
        except OSError as exc:
            self._failed(exc)

    def close(self) -> None:
        self.journal.close()
