"""The journal file: records framed one by one, so that damage loses the record it hits and no other.

Each record is one frame::

    header   mark (4 bytes), kind (1), id (8), payload length (4), payload CRC-32 (4), header CRC-32 (4)
    payload  the record's value, msgpack
    footer   kind (1), id (8), CRC-32 of those (4)

A reader takes the frames in order. A payload whose checksum fails (or
that does not decode) loses the session or buffer its header names. A
header whose checksum fails is skipped up to the next mark that starts a
sound header, and the footer just before it names what was lost: one byte
damaged anywhere loses one record, named in the log. A frame cut short at
the end (a full disk, a crash mid-write) loses its record alone.

Replayed, the records make an image (``meta``, ``sessions`` and ``buffers``
by id). A record that cannot be replayed (a growth of a buffer whose record
was lost, say) loses that session or buffer too. Journals written before
version 7, one msgpack stream without frames, are read as well: there a
record that decodes but cannot be replayed loses its session or buffer, and
a stream that stops decoding loses what follows, logged.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
from pathlib import Path
from typing import Any

import msgpack
from hbmd.proto.records import CHECK, checked, checksum, sealed, write_all

log = logging.getLogger("hbmd.persist")

Image = dict[str, Any]
"""A state as plain data: ``meta``, ``sessions`` and ``buffers`` (records by id)."""

MARK = b"\xc1HBJ"
"""Starts every frame. 0xc1 is no msgpack type, so a journal of version 6 or older never starts with it."""
HEADER = struct.Struct("<4sBqII")
FOOTER = struct.Struct("<BqI")
FRAME_BYTES = HEADER.size + CHECK.size + FOOTER.size
KINDS = ("meta", "s", "b", "b+", "-s", "-b")
"""A record's kind by its code less one: the journal's ``meta``, a session ``s`` or buffer ``b`` as it now is, ``b+``
the chunks a buffer gained, ``-s``/``-b`` one gone."""
WHAT = {"s": "session", "-s": "session", "b": "buffer", "b+": "buffer", "-b": "buffer"}


def frame(kind: str, record_id: int, value: Any) -> bytes:
    """One record as the journal holds it."""
    payload = msgpack.packb(value, use_bin_type=True)
    code = KINDS.index(kind) + 1
    header = HEADER.pack(MARK, code, record_id, len(payload), checksum(payload))
    named = FOOTER.pack(code, record_id, 0)[:-CHECK.size]
    return b"".join((sealed(header), payload, sealed(named)))


def record_id(kind: str, value: Any) -> int:
    """The id a record of ``kind`` is about: its value's ``id``, or the value itself for an end."""
    if kind == "meta":
        return 0
    return int(value if kind in ("-s", "-b") else value["id"])


class Replay:
    """An image built record by record, losing a session or buffer whose record is damaged or cannot be applied."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.image: Image = {"meta": {}, "sessions": {}, "buffers": {}}
        self.lost: dict[tuple[str, int], tuple[int, str, str | None]] = {}
        """The sessions and buffers lost so far, with where, why and, where known, the buffer's name."""
        self.last_session = 0
        """The highest session id a record named, gone since or not: no later session may have it again."""

    def apply(self, kind: str, key: int, value: Any, at: int) -> None:
        try:
            self._apply(kind, key, value)
        except (ValueError, TypeError, KeyError, AttributeError, IndexError) as exc:
            self.lose(kind, key, at, f"its record cannot be replayed ({type(exc).__name__}: {exc})")

    def _apply(self, kind: str, key: int, value: Any) -> None:
        image = self.image
        if kind in ("s", "-s"):
            self.last_session = max(self.last_session, key)
        if kind in ("s", "b", "-s", "-b"):
            self.lost.pop((WHAT[kind], key), None)  # whole again, or gone anyway: nothing is lost of it
        if kind == "meta":
            if not isinstance(value, dict):
                raise TypeError("the journal's meta is not a map")
            image["meta"] = value
        elif kind == "image":  # version 4 to 6: the state whole, where a journal was rewritten
            if not isinstance(value, dict):
                raise TypeError("the image is not a map")
            self.image = {"meta": value.get("meta", {}), "sessions": dict(value.get("sessions", {})),
                          "buffers": dict(value.get("buffers", {}))}
        elif kind in ("s", "b"):
            if not isinstance(value, dict) or value.get("id") != key:
                raise ValueError(f"its record names id {value.get('id') if isinstance(value, dict) else None!r}")
            image["sessions" if kind == "s" else "buffers"][key] = value
        elif kind == "b+":
            self._grow(key, value)
        elif kind in ("-s", "-b"):
            image["sessions" if kind == "-s" else "buffers"].pop(key, None)
        else:
            raise ValueError(f"a record of unknown kind {kind!r}")

    def _grow(self, key: int, value: dict[str, Any]) -> None:
        grown = self.image["buffers"].get(key)
        if grown is None:
            raise KeyError("it grows a buffer whose record is not in the journal")
        # Version 7 says how many chunks the buffer had: a growth in between that was lost must not pass unseen.
        if "since" in value and value["since"] != len(grown["chunks"]):
            raise ValueError(f"it follows {value['since']} chunks, the journal holds {len(grown['chunks'])}")
        chunks, held, host = list(value["chunks"]), list(value["held"]), list(value.get("host", []))
        sizes = value["sizes"]
        grown["chunks"] = grown["chunks"] + chunks
        grown["held"] = list(grown.get("held", [])) + held
        grown["host"] = list(grown.get("host", [])) + host
        grown["sizes"] = sizes

    def lose(self, kind: str, key: int | None, at: int, why: str) -> None:
        """Forget the session or buffer a record was about (``key`` None: not known); it is reported by :meth:`finish`
        unless a later record has it whole."""
        if kind == "meta":
            log.warning("journal %s, byte %d: its header is lost (%s); read as this version's", self.path, at, why)
        elif key is None or kind not in WHAT:
            log.warning("journal %s, byte %d: a record is lost, whose is not known (%s)", self.path, at, why)
        else:
            table = self.image["sessions" if WHAT[kind] == "session" else "buffers"]
            record = table.pop(key, None)
            name = record.get("name") if isinstance(record, dict) and WHAT[kind] == "buffer" else None
            self.lost.setdefault((WHAT[kind], key), (at, why, name))

    def finish(self) -> Image:
        """The image replayed, once what it lost is logged; the ids of the sessions lost are its ``lost_sessions``
        (their clients start over), the highest session id it named its ``last_session``."""
        for (what, key), (at, why, name) in self.lost.items():
            named = "" if name is None else f" {name!r}"
            log.warning("journal %s, byte %d: %s %d%s is lost: %s", self.path, at, what, key, named, why)
        self.image["lost_sessions"] = [key for what, key in self.lost if what == "session"]
        self.image["last_session"] = self.last_session
        return self.image


def read_frames(replay: Replay, data: bytes) -> None:
    """Replay the framed records of ``data`` (version 7 on)."""
    at = 0
    while at < len(data):
        header = _header_at(data, at)
        if header is None:
            found = data.find(MARK, at + 1)
            while found >= 0 and _header_at(data, found) is None:
                found = data.find(MARK, found + 1)
            end = len(data) if found < 0 else found
            named = _footer_before(data, at, end)
            if named is None:
                replay.lose("", None, at, f"{end - at} bytes cannot be read")
            else:
                replay.lose(named[0], named[1], at, "its frame's header is damaged")
            at = end
            continue
        kind, key, length, payload_check = header
        start = at + HEADER.size + CHECK.size
        payload = data[start:start + length]
        if len(payload) < length:
            replay.lose(kind, key, at, "the journal ends inside it (a torn write)")
            return
        try:
            if checksum(payload) != payload_check:
                raise ValueError("its checksum does not match")
            value = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except (ValueError, msgpack.UnpackException) as exc:
            replay.lose(kind, key, at, f"its record is damaged ({exc})")
        else:
            replay.apply(kind, key, value, at)
        # A damaged footer costs nothing: the header said where the next frame starts.
        at = start + length + FOOTER.size


def _header_at(data: bytes, at: int) -> tuple[str, int, int, int] | None:
    """The kind, id, payload length and checksum of the frame at ``at``; None where no sound header starts there."""
    if data[at:at + len(MARK)] != MARK or checked(data, at, at + HEADER.size) is None:
        return None
    _, code, key, length, payload_check = HEADER.unpack_from(data, at)
    if not 1 <= code <= len(KINDS):
        return None
    return KINDS[code - 1], key, length, payload_check


def _footer_before(data: bytes, at: int, end: int) -> tuple[str, int] | None:
    """The kind and id a sound footer between ``at`` and ``end``, ending there, names; None where there is none."""
    if end - FOOTER.size < at:
        return None
    code, key, _ = FOOTER.unpack_from(data, end - FOOTER.size)
    if checked(data, end - FOOTER.size, end - CHECK.size) is None or not 1 <= code <= len(KINDS):
        return None
    return KINDS[code - 1], key


def read_stream(replay: Replay, data: bytes) -> None:
    """Replay a journal of version 4 to 6: msgpack records ``[kind, value]`` one after another, without frames."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(data), 1))
    unpacker.feed(data)
    used = 0
    try:
        for record in unpacker:
            kind, value = record if isinstance(record, list) and len(record) == 2 else ("?", None)
            try:
                key = 0 if kind == "image" else record_id(kind, value)
            except (ValueError, TypeError, KeyError, IndexError):
                replay.lose(kind, None, used, "its id cannot be read")
            else:
                replay.apply(kind, key, value, used)
            used = unpacker.tell()
    except (ValueError, msgpack.UnpackException) as exc:
        log.warning("journal %s, byte %d: the %d bytes from here cannot be read (%s): what they recorded is lost",
                    replay.path, used, len(data) - used, exc)
        return
    if used < len(data):
        log.warning("journal %s ends in a torn record (%d bytes): ignored", replay.path, len(data) - used)


class Journal:
    """The append-only journal file of one instance's state (see the module's docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = -1
        self.size = 0

    def read(self) -> Image:
        """The state the journal describes, its records replayed, what it cannot read logged and left out (a v3 JSON
        journal beside it read where there is no later one); empty where there is none. Raises ``OSError``."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return _legacy_image(self._legacy) or {"meta": {}, "sessions": {}, "buffers": {}}
        replay = Replay(self.path)
        if data[:1] == b"\x92":  # a msgpack list of two: the first record of a journal before version 7
            read_stream(replay, data)
        else:
            read_frames(replay, data)
        return replay.finish()

    def rewrite(self, image: Image) -> None:
        """Replace the journal by ``image``, a frame a record (written aside, then renamed over it); raises
        ``OSError``."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        data = b"".join((
            frame("meta", 0, image["meta"]),
            *(frame("s", key, record) for key, record in image["sessions"].items()),
            *(frame("b", key, record) for key, record in image["buffers"].items()),
        ))
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                write_all(fd, data)
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
        self.stale.unlink(missing_ok=True)

    @property
    def stale(self) -> Path:
        """Where a journal that could not be written lies, set aside (:meth:`set_aside`)."""
        return self.path.with_name(self.path.name + ".stale")

    def set_aside(self) -> bool:
        """Rename the journal out of a restart's way (a rename takes no room on a full filesystem): it misses changes
        since, and a restart that resumed sessions from it would resume them without what they made meanwhile.
        Returns whether there was one."""
        self.close()
        self.size = 0
        try:
            self.path.replace(self.stale)
        except FileNotFoundError:
            return False
        return True

    @property
    def _legacy(self) -> Path:
        """Where a journal written before version 4 lies."""
        return self.path.with_name(self.path.name + ".json")

    def append(self, records: list[list[Any]]) -> None:
        """Append ``records`` (``[kind, value]``) in one write; raises ``OSError``."""
        data = b"".join(frame(kind, record_id(kind, value), value) for kind, value in records)
        write_all(self._fd, data)
        self.size += len(data)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _legacy_image(path: Path) -> Image | None:
    """The persistent buffers of a journal written before version 4 (JSON), as orphans; None where there is none."""
    try:
        journal = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.error("journal %s unreadable (%s): persistent buffers are not restored", path, exc)
        return None
    if not isinstance(journal, dict):
        log.error("journal %s is not a map: persistent buffers are not restored", path)
        return None
    buffers = {}
    for entry in journal.get("buffers", []):
        if isinstance(entry, dict) and "buffer_id" in entry:
            buffers[entry["buffer_id"]] = {
                **entry, "id": entry["buffer_id"], "persistent": True, "owner": 0, "uid": entry.get("owner_uid"),
                "readers": [], "pending": [],
            }
    return {"meta": {"version": journal.get("version") or 3}, "sessions": {}, "buffers": buffers}
