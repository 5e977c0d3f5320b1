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

Either way the new daemon rebuilds the state with :func:`.restore.restore`: sessions
come back *resuming*, each waiting for its client to take it back with the
credential of its last welcome; one that does not come back in time ends as
a dead one does. A record that cannot be read, a buffer whose descriptors
did not all come back, or one the backend cannot adopt, is logged as lost
and the rest is restored: a restart never fails over one record, which
under ``Restart=on-failure`` would loop forever.

The journal (:mod:`.journal`) is append-only: records (``meta``, a session
``s`` or buffer ``b`` as it now is, ``b+`` the chunks a buffer gained and
its new sizes, so that a commit costs the same at 10 chunks as at 10,000,
``-s``/``-b`` one gone), each framed and checksummed on its own, rewritten
whole from the state once it has grown to several times the size of the
state. Records are written whole with one ``write``; the page cache keeps
them across a crash of the daemon, which is what the memory survives too
(not a crash of the machine), so nothing is synced to disk. A damaged
record, or a torn last one (a full disk), loses its session or buffer
alone, logged. Journals of earlier versions are read as well.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgpack
from hbmd.proto import TIER_HOST
from hbmd.proto.errors import HbmdError

from ..backends import parkable
from ..notify import SystemdNotifier
from ..state import Buffer, Chunk, Session, State
from .journal import Image, Journal
from .restore import JOURNAL_VERSION, NewerState, chunk_name, restore

log = logging.getLogger("hbmd.persist")

COMPACT_MIN_BYTES = 1 << 20
COMPACT_RATIO = 4
"""The journal is rewritten whole once it is this many times the size of the state it describes."""
RESUME_WINDOW_S = 30.0
"""How long a restored session waits for its client by default (``--resume-timeout``)."""

MAX_PARKED = 16384
"""The most chunks parked with the service manager (``FileDescriptorStoreMax`` in ``deploy/hbmd@.service``)."""
MAX_NAMES_CHARS = (128 << 10) - 64
"""What the names of the parked chunks may take, a colon each: the service manager passes them back in one
environment variable, ``LISTEN_FDNAMES``, and the kernel refuses an ``execve`` where a variable is over 128 KiB
(``MAX_ARG_STRLEN``), so that the service would not start again. 16384 names of 6 characters fit (chunk ids below
60 million); longer ones leave room for fewer."""


# the state as records


def session_record(session: Session) -> dict[str, Any]:
    """A session's record (read back by :func:`.journaled.session_of`): what its hello fixed, then what may change."""
    return {**_at_hello(session), **_since_hello(session)}


def _at_hello(session: Session) -> dict[str, Any]:
    """What of a session's record its hello fixes for good: a change to it would never be journaled (see
    :meth:`Persistence.sync`), so whatever may change goes in :func:`_since_hello`."""
    return {
        "id": session.session_id, "pid": session.pid, "uid": session.uid, "gid": session.gid,
        "name": session.client_name, "admin": session.admin, "wants_lease": session.wants_lease,
        "wants_credit": session.wants_credit,
    }


def _since_hello(session: Session) -> dict[str, Any]:
    """What of a session's record may change: a session is journaled again whenever this does."""
    answer = session.answer
    return {
        "tenant": session.tenant.name, "credential": session.credential_hash,
        "previous_credential": session.previous_credential_hash,
        "lease": [[c.chunk_id, c.size] for c in session.lease.values()],
        "credit": session.credit,
        "demoted": session.demoted_under_pressure,
        "answer": None if answer is None else [answer.request_id, answer.frames, answer.buffer_id, answer.chunk_ids],
        "holds": _holds(session),
    }


def _holds(session: Session) -> list[int]:
    """The buffers a session owns or reads: it is not resumed without them (see :mod:`.restore`)."""
    return sorted(session.buffers.keys() | session.reading.keys())


def buffer_record(buffer: Buffer[Any, Any]) -> dict[str, Any]:
    """A buffer's record (read back by :func:`.journaled.buffer_of`): its head, then its sizes and every chunk."""
    every = (*buffer.chunks, *buffer.pending)
    return {
        **_head(buffer), "sizes": buffer.segment_sizes,
        "chunks": [[c.chunk_id, c.offset, c.size] for c in buffer.chunks],
        "held": [c.chunk_id for c in every if c.handle is None],
        "host": [c.chunk_id for c in every if c.tier == TIER_HOST],
    }


def _head(buffer: Buffer[Any, Any]) -> dict[str, Any]:
    """A buffer's record but for what a growth record (:func:`_growth_record`) carries: a buffer whose head changed
    is journaled whole."""
    return {
        "id": buffer.buffer_id, "name": buffer.name, "persistent": buffer.persistent, "shareable": buffer.shareable,
        "owner": buffer.owner.session_id if buffer.owner is not None else 0, "uid": buffer.owner_uid,
        "tenant": buffer.tenant.name, "capacity": buffer.capacity, "capacities": buffer.segment_capacities,
        "sealed": buffer.sealed, "readers": [[s, n] for s, n in buffer.readers.items()],
        "pending": [[c.chunk_id, c.offset, c.size] for c in buffer.pending],
        "orphan": [buffer.keep_orphan_s, buffer.orphaned_at, buffer.expires_at, *buffer.last_holder],
        "unsealed_since": buffer.unsealed_since,
    }


def _shape(buffer: Buffer[Any, Any]) -> tuple[dict[str, Any], int, int]:
    """What a buffer's record was journaled from: its head, then how many chunks and the last one's id. Chunk ids are
    never reused, so a buffer whose head is the same and whose first chunks are still these only gained chunks."""
    return _head(buffer), len(buffer.chunks), buffer.chunks[-1].chunk_id if buffer.chunks else 0


def _growth_record(buffer: Buffer[Any, Any], since: int) -> dict[str, Any]:
    """The chunks a buffer gained after its first ``since``, and its sizes now."""
    gained = buffer.chunks[since:]
    return {"id": buffer.buffer_id, "since": since, "sizes": buffer.segment_sizes,
            "chunks": [[c.chunk_id, c.offset, c.size] for c in gained],
            "held": [c.chunk_id for c in gained if c.handle is None],
            "host": [c.chunk_id for c in gained if c.tier == TIER_HOST]}


def _only_grew(buffer: Buffer[Any, Any], count: int, last_id: int) -> bool:
    """Whether the buffer's first ``count`` chunks, the last of them ``last_id``, are still its first ones."""
    return count <= len(buffer.chunks) and (count == 0 or buffer.chunks[count - 1].chunk_id == last_id)


def _kept(session: Session) -> bool:
    """Whether a session outlives a restart: an observer (a tool) holds nothing and connects anew."""
    return not session.observer


def image_of(state: State[Any, Any]) -> Image:
    """The whole state as records: what a journal is rewritten with, and what a live handover sends."""
    return {
        "meta": meta_of(state),
        "sessions": {s.session_id: session_record(s) for s in state.sessions.by_id.values() if _kept(s)},
        "buffers": {b.buffer_id: buffer_record(b) for b in state.buffers.by_id.values()},
    }


def meta_of(state: State[Any, Any]) -> dict[str, Any]:
    """The journal's header: its version, the instance, and the line of daemons its credentials belong to."""
    return {"version": JOURNAL_VERSION, "instance": state.backend.instance,
            "next_session": state.sessions.next_id, **state.sessions.credentials.record()}


def every_chunk(state: State[Any, Any]) -> Iterable[tuple[Chunk[Any], Any]]:
    """Every chunk the state holds, with its arena."""
    for buffer in state.buffers.by_id.values():
        for chunk in (*buffer.chunks, *buffer.pending):
            if chunk.handle is not None:  # one held only by its mappers has nothing to keep here
                yield chunk, buffer.arena
    for session in state.sessions.by_id.values():
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
        state.buffers.changed = set()
        state.chunks.fd_store = self
        self._parked: set[int] = set()
        """Ids of the chunks parked."""
        self._names_chars = 0
        """What their names take in ``LISTEN_FDNAMES``."""
        self._unparking: list[str] = []
        """Names of chunks released since the last sync, unparked once it has journaled their release."""
        self._sessions: dict[int, dict[str, Any]] = {}
        """What of each kept session's record may change, as last journaled (:func:`_since_hello`)."""
        self._buffers: dict[int, tuple[dict[str, Any], int, int]] = {}
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
        if self.state.sessions.credentials.changed:
            # Before the sessions it opens: a start-over journaled as spent is never replayed by a later daemon.
            records.insert(0, ["meta", meta_of(self.state)])
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
        changed = self.state.buffers.changed
        if not changed:
            return []
        records: list[list[Any]] = []
        for buffer_id in sorted(changed):
            buffer = self.state.buffers.by_id.get(buffer_id)
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
        kept = {s.session_id: s for s in self.state.sessions.by_id.values() if _kept(s)}
        for session_id in sorted(self._sessions.keys() - kept.keys()):
            del self._sessions[session_id]
            records.append(["-s", session_id])
        for session_id, session in kept.items():
            seen = _since_hello(session)
            if self._sessions.get(session_id) != seen:
                self._sessions[session_id] = seen
                records.append(["s", session_record(session)])
        return records

    def _failed(self, exc: OSError) -> None:
        # A full or broken state directory must not stop the daemon: it serves on, and writes again at the next change.
        if not self.degraded:
            set_aside = self.journal.set_aside()
            log.error(
                "persistence degraded: cannot write the journal %s (%s); %still it can be written again (retried at "
                "the next change), a restart is cold: clients declare again what they map, buffers nobody maps are "
                "lost",
                self.journal.path, exc.strerror or exc,
                f"it is set aside as {self.journal.stale.name}, and " if set_aside else "",
            )
        self.degraded = True

    # starting

    def restore(self, passed: dict[str, list[int]]) -> tuple[int, int]:
        """Rebuild the state the journal describes from the FDs the service manager passed back, then journal it
        afresh; returns how many sessions and buffers came back. FDs nobody claims are closed and unparked.

        Raises :class:`NewerState` for a newer daemon's journal, leaving it and the store as they are.
        """
        if self.journal.stale.exists() and not self.journal.path.exists():
            log.warning("the last daemon could not write its journal and set it aside (%s): this start is cold, "
                        "clients declare again what they map", self.journal.stale)
        try:
            image = self.journal.read()
        except OSError as exc:
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
        assert self.state.buffers.changed is not None  # tracked since __init__
        self.state.buffers.changed.clear()
        self._sessions = {s.session_id: _since_hello(s) for s in self.state.sessions.by_id.values() if _kept(s)}
        self._buffers = {b.buffer_id: _shape(b) for b in self.state.buffers.by_id.values()}
        try:
            self._rewrite()
        except OSError as exc:
            self._failed(exc)

    def close(self) -> None:
        self.journal.close()
