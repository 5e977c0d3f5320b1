"""Records on disk, checked: what the daemon's journal and an engine's kept KV index share.

Both files are records that a reader must tell whole from damaged or cut
short: each checked part is followed by its CRC-32, four bytes
little-endian, and is written whole, a short write followed by the rest.
How records are framed and what a damaged one costs stay with each file
(``daemon/restart/journal.py``: frames checked one by one, a damaged one
lost alone; ``integrations/kv_index.py``: one chain of checks, trusted
whole or not at all). Standard library only, so that an engine's process
reads and writes its index without the daemon.
"""

from __future__ import annotations

import os
import struct
import zlib

CHECK = struct.Struct("<I")
"""A CRC-32 as it follows what it checks."""


def checksum(data: bytes | bytearray | memoryview, seed: int = 0) -> int:
    """The CRC-32 of ``data``, continued from ``seed`` (the check before it, for a chain of records)."""
    return zlib.crc32(data, seed)


def sealed(data: bytes, seed: int = 0) -> bytes:
    """``data`` followed by its check (:func:`checksum` from ``seed``)."""
    return data + CHECK.pack(zlib.crc32(data, seed))


def checked(data: bytes, start: int, end: int, seed: int = 0) -> int | None:
    """The check of ``data[start:end]`` from ``seed`` where the four bytes at ``end`` hold it; None where they hold
    another, or where ``data`` ends before them (a torn write)."""
    if end + CHECK.size > len(data):
        return None
    value = zlib.crc32(data[start:end], seed)
    return value if CHECK.unpack_from(data, end)[0] == value else None


def write_all(fd: int, data: bytes | bytearray, offset: int | None = None) -> None:
    """Write all of ``data`` to ``fd``: at its position (an append) or, given ``offset``, there; a short write is
    followed by the rest, an error raised (``OSError``) with what was written left in the file."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view) if offset is None else os.pwrite(fd, view, offset)
        view = view[written:]
        if offset is not None:
            offset += written
