"""Persistent buffers across daemon restarts, through systemd's file-descriptor store.

While it runs, the daemon parks an FD for the memory of every persistent
buffer with the service manager (``FDSTORE=1``, one name per FD) and keeps a
small journal of their layout under its state directory. Neither the
sockets nor the sessions survive a restart, but the parked FDs keep the
memory alive: on start the daemon re-adopts the FDs systemd passes back
(``LISTEN_FDS``/``LISTEN_FDNAMES``), rebuilds each buffer from the journal as
an orphan, and workers attach to it again by name with its data.

Both backends park one FD per chunk (the host backend its sealed memfd, the
CUDA backend an exported handle), so ``FileDescriptorStoreMax`` bounds the
chunks kept.

A buffer whose parked FDs did not all come back (dropped from the store, or
beyond its limit), or that the backend cannot adopt, is skipped and logged
as lost, and the rest are restored: a restart never fails over one buffer,
which under ``Restart=on-failure`` would loop forever.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

from hbmd.proto.errors import HbmdError, NotFound
from hbmd.proto.undo import Undo
from hbmd.proto.units import format_bytes, round_up

from .notify import SystemdNotifier
from .state import Buffer, Chunk, State

log = logging.getLogger("hbmd.persist")

JOURNAL_VERSION = 3
"""3 records a chunk as ``[id, offset, size]``; 2 added a fourth field, always 0, and each segment's capacity and
size (and whether a buffer is sealed; an entry without it is not); version 1's equal segments are read too."""


def chunk_name(buffer_id: int, chunk_id: int) -> str:
    return f"hbmd-c{buffer_id}-{chunk_id}"


class Persistence:
    """Mirrors the state's persistent buffers into the FD store and the journal."""

    def __init__(self, state: State, notifier: SystemdNotifier, journal: Path) -> None:
        self.state = state
        self.notifier = notifier
        self.journal = journal
        state.changed = set()
        self._parked: dict[int, set[str]] = {}
        """FD-store names parked per buffer id."""
        self.degraded = False
        """The last journal write failed (the state directory is full, say)."""

    def sync(self) -> None:
        """Park what persistent buffers gained, unpark what they lost, rewrite the journal; only if anything changed."""
        if not self.state.changed:
            return
        for buffer_id in sorted(self.state.changed):
            buffer = self.state.buffers.get(buffer_id)
            wanted = (
                {chunk_name(buffer_id, c.chunk_id): c for c in buffer.chunks} if buffer is not None and buffer.persistent
                else {}
            )
            parked = self._parked.setdefault(buffer_id, set())
            for name in sorted(parked - wanted.keys()):
                self.notifier.remove_fds(name)
                parked.discard(name)
            for name, chunk in wanted.items():
                if name not in parked and self._park(buffer, chunk, name):
                    parked.add(name)
            if not parked:
                del self._parked[buffer_id]
        self.state.changed.clear()
        self._write_journal()

    def _park(self, buffer: Buffer, chunk: Chunk, name: str) -> bool:
        try:
            fd = self.state.backend.parked_fd(buffer.arena, chunk.handle)
        except (HbmdError, OSError) as exc:
            log.warning("cannot park %s with the service manager: %s", name, exc)
            return False
        try:
            return self.notifier.send_fds([fd], name)
        finally:
            os.close(fd)

    def _write_journal(self) -> None:
        buffers = [
            {
                "buffer_id": b.buffer_id,
                "name": b.name,
                "owner_uid": b.owner_uid,
                "tenant": b.tenant.name,
                "capacity": b.capacity,
                "segment_capacities": b.segment_capacities,
                "segment_sizes": b.segment_sizes,
                "shareable": b.shareable,
                "sealed": b.sealed,
                "chunks": [[c.chunk_id, c.offset, c.size] for c in b.chunks],
            }
            for b in self.state.buffers.values()
            if b.persistent
        ]
        tmp = self.journal.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps({"version": JOURNAL_VERSION, "instance": self.state.backend.instance, "buffers": buffers}))
            tmp.replace(self.journal)
        except OSError as exc:
            # A full or broken state directory must not stop the daemon: it serves on, and writes again at the next change.
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            if not self.degraded:
                log.error(
                    "persistence degraded: cannot write the journal %s (%s); persistent buffers changed since "
                    "will not survive a restart until it can be written (retried at the next change)",
                    self.journal, exc.strerror or exc,
                )
            self.degraded = True
            return
        if self.degraded:
            log.warning("persistence restored: the journal %s is written again", self.journal)
        self.degraded = False

    def restore(self, passed: dict[str, list[int]]) -> int:
        """Re-adopt the buffers of the journal from the FDs passed back; returns how many came back.

        FDs nobody claims are closed and removed from the store.
        """
        try:
            journal = json.loads(self.journal.read_text())
        except FileNotFoundError:
            journal = {"buffers": []}
        except (OSError, ValueError) as exc:
            log.error("journal %s unreadable (%s): persistent buffers are not restored", self.journal, exc)
            journal = {"buffers": []}
        fds = {name: fds[0] for name, fds in passed.items()}
        for extra in passed.values():
            for fd in extra[1:]:
                os.close(fd)
        restored = 0
        for entry in journal.get("buffers", []):
            try:
                self._adopt(entry, fds)
                restored += 1
            except Exception as exc:  # whatever the journal or the backend raised: lose this buffer, not the daemon
                name = entry.get("name") if isinstance(entry, dict) else None
                log.error("persistent buffer %r (%s) is lost: %s", name, _journaled_size(entry), exc)
        for name, fd in fds.items():
            # Parked for a buffer that is not coming back (gone from the journal, or lost above): let it go.
            os.close(fd)
            self.notifier.remove_fds(name)
        self._write_journal()
        return restored

    def _adopt(self, entry: dict, fds: dict[str, int]) -> None:
        """Adopt one journaled buffer, taking its FDs out of ``fds``; raises, taking none, when any is missing.

        FDs of a buffer that is not adopted stay in ``fds`` or are unparked:
        either way the store lets them go.
        """
        backend = self.state.backend
        buffer_id = int(entry["buffer_id"])
        layout = [_chunk_layout(chunk) for chunk in entry["chunks"]]
        needed = [chunk_name(buffer_id, chunk_id) for chunk_id, _, _ in layout]
        missing = [name for name in needed if name not in fds]
        if missing:
            shown = ", ".join(missing[:4])
            raise NotFound(f"{len(missing)} of its {len(needed)} parked descriptors did not come back ({shown})")
        arena = backend.adopt_arena(round_up(int(entry["capacity"]), backend.granularity), bool(entry["shareable"]))
        chunks: list[Chunk] = []
        with Undo() as undo:
            undo.push(backend.close_arena, arena)
            for (chunk_id, offset, size), name in zip(layout, needed):
                fd = fds.pop(name)
                # Out of ``fds`` now, so if the buffer is not adopted only this undo unparks it.
                undo.push(self.notifier.remove_fds, name)
                try:
                    handle = backend.adopt(arena, offset, size, fd)
                finally:
                    os.close(fd)
                undo.push(backend.release, arena, handle)
                chunks.append(Chunk(chunk_id, offset, size, handle))
            self.state.adopt_buffer(
                buffer_id, entry["name"], int(entry["owner_uid"]), entry["tenant"], int(entry["capacity"]),
                *_segments(entry), bool(entry["shareable"]), arena, chunks, bool(entry.get("sealed", False)),
            )
        self._parked[buffer_id] = set(needed)
        log.info("restored persistent buffer %r: %d bytes in %d chunks", entry["name"], sum(c.size for c in chunks), len(chunks))


def _chunk_layout(chunk: list) -> tuple[int, int, int]:
    """A journaled chunk's ``(id, offset, size)``; version 2 wrote a fourth field, always 0."""
    if len(chunk) not in (3, 4) or chunk[3:] not in ([], [0]):
        raise ValueError(f"journaled chunk {chunk[:5]!r} is not [id, offset, size]")
    return int(chunk[0]), int(chunk[1]), int(chunk[2])


def _segments(entry: dict) -> tuple[list[int], list[int]]:
    """An entry's segment capacities and committed sizes, from either journal version."""
    if "segment_capacities" in entry:
        return [int(c) for c in entry["segment_capacities"]], [int(n) for n in entry["segment_sizes"]]
    count = int(entry["num_segments"])
    return [int(entry["capacity"]) // count] * count, [int(entry["bytes_per_segment"])] * count


def _journaled_size(entry: dict) -> str:
    """The bytes a journal entry says its buffer held, for the log line that reports it lost."""
    try:
        return format_bytes(sum(int(chunk[2]) for chunk in entry["chunks"]))
    except (KeyError, TypeError, ValueError, IndexError):
        return "size unknown"
