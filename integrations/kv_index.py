"""The index of a kept KV cache: which block holds which prefix, written as vLLM computes it, read by its successor.

An engine that keeps its KV cache in hbmd (``HBMD_VLLM_KEEP_KV``, see
:mod:`hbmd.integrations.vllm_keep`) appends to one file per engine what its
block pool may serve again: a block is *published* only once the step that
computed it has finished, and *withdrawn* before the step that reuses it is
sent to the GPU. A successor reads the file back and puts every published
block into its own pool; what it cannot read (a torn last record, a header of
another engine) it does not trust.

The file lives beside the engine, not in the daemon: an append is one
``write(2)``, which the kernel keeps whatever happens to the process after it
returns, and the GPU memory the index describes does not outlive the machine
either. No vLLM here, so that CI tests it without vLLM (tests/test_kv_index.py).

An engine that serves for days publishes and withdraws blocks at every step:
appended forever, its index would fill ``/dev/shm`` and its successor would
read for minutes. Past :data:`COMPACT_AT_BYTES` and :data:`COMPACT_FACTOR`
times what it publishes, the writer puts a new file in its place with only
the blocks published now, in one rename, as at the start; the file stays
within a few times the largest index the pool can have. A writer whose file a
successor replaced (a predecessor still running) finds out then, and writes
no more (:class:`Superseded`).

Format: a first line ``hbmd-kv-index 1``, a second line of JSON (the header:
what the cache is bound to), then records::

    P  block_id:u32  num_tokens:u32  hash_len:u16  hash      published
    W  block_id:u32                                          withdrawn
    C                                                        every block withdrawn
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import glob
import json
import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MAGIC = b"hbmd-kv-index 1\n"
MAX_HEADER_BYTES = 1 << 20
"""A header longer than this is not one this module wrote."""
MAX_HASH_BYTES = 1024
"""vLLM's block hashes (with their group id) are tens of bytes; a longer one is damage."""
COMPACT_AT_BYTES = 8 << 20
"""An index is not rewritten before it is this large: a rewrite is a few milliseconds at most, paid this rarely."""
COMPACT_FACTOR = 4
"""An index is rewritten once it holds this many times the bytes of what it publishes now."""
LOCK_WAIT_S = 5.0
"""The longest a writer waits for the index's lock (another's rewrite takes milliseconds) before it gives up
keeping the index, rather than hold its scheduler behind a writer that hung in one."""
_PUBLISHED = struct.Struct("<cIIH")
_WITHDRAWN = struct.Struct("<cI")


@dataclasses.dataclass
class Published:
    block_hash: bytes
    num_tokens: int


@dataclasses.dataclass
class IndexContents:
    header: dict[str, Any]
    blocks: dict[int, Published]
    """The blocks published and not withdrawn since, by block id."""
    torn: bool = False
    """The file ended inside a record (the writer died mid-append, or the file was cut): the records before it
    stand, the torn one is ignored."""


class NotAnIndex(ValueError):
    """The file is not a kept KV cache's index (or its header is damaged): nothing of it may be trusted."""


class Superseded(RuntimeError):
    """Another writer (a successor) put its own index where this writer's was: this one's records matter to nobody
    now, and it must write no more."""


def read_index(path: str | os.PathLike[str]) -> IndexContents:
    """The index at ``path``; :class:`NotAnIndex` where its magic line or header cannot be read,
    ``FileNotFoundError`` where there is none."""
    data = Path(path).read_bytes()
    if not data.startswith(MAGIC):
        raise NotAnIndex(f"{path}: not an hbmd KV index")
    end = data.find(b"\n", len(MAGIC), len(MAGIC) + MAX_HEADER_BYTES)
    if end < 0:
        raise NotAnIndex(f"{path}: its header is damaged")
    try:
        header = json.loads(data[len(MAGIC) : end])
    except ValueError as exc:
        raise NotAnIndex(f"{path}: its header is damaged ({exc})") from exc
    if not isinstance(header, dict):
        raise NotAnIndex(f"{path}: its header is damaged")
    contents = IndexContents(header, {})
    at = end + 1
    while at < len(data):
        kind = data[at : at + 1]
        if kind == b"P" and at + _PUBLISHED.size <= len(data):
            _, block_id, num_tokens, hash_len = _PUBLISHED.unpack_from(data, at)
            start = at + _PUBLISHED.size
            if hash_len > MAX_HASH_BYTES or start + hash_len > len(data):
                contents.torn = True
                break
            contents.blocks[block_id] = Published(data[start : start + hash_len], num_tokens)
            at = start + hash_len
        elif kind == b"W" and at + _WITHDRAWN.size <= len(data):
            contents.blocks.pop(_WITHDRAWN.unpack_from(data, at)[1], None)
            at += _WITHDRAWN.size
        elif kind == b"C":
            contents.blocks.clear()
            at += 1
        else:
            contents.torn = True
            break
    return contents


class IndexWriter:
    """Appends to an engine's index. Records wait in memory until :meth:`flush`, which writes them with one
    ``write(2)`` (or, where the file has grown too large, rewrites it): the caller flushes withdrawals before the GPU
    may overwrite the blocks, publications whenever."""

    def __init__(self, path: str | os.PathLike[str], header: dict[str, Any],
                 published: dict[int, Published] | None = None) -> None:
        """Start a new index at ``path`` with ``header`` and the ``published`` blocks, replacing any there in one
        rename: a reader sees the old index or the new one, never a mix."""
        self.path = Path(path)
        self.pending = bytearray()
        self.head = MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n"
        self.live = {block_id: _publish_record(block_id, block) for block_id, block in (published or {}).items()}
        """What a reader of the file and :attr:`pending` would find published: each block's record."""
        self.live_bytes = sum(map(len, self.live.values()))
        self.file_bytes = 0
        self.fd = -1
        with self._locked():
            for leftover in self.path.parent.glob(glob.escape(self.path.name) + ".new-*"):
                leftover.unlink(missing_ok=True)  # a writer's killed mid-rewrite: none is writing one under the lock
            self._replace()

    def publish(self, block_id: int, block_hash: bytes, num_tokens: int) -> None:
        record = _publish_record(block_id, Published(block_hash, num_tokens))
        self.live_bytes += len(record) - len(self.live.get(block_id, b""))
        self.live[block_id] = record
        self.pending += record

    def published(self, block_id: int) -> bytes | None:
        """The hash ``block_id`` is published under now (pending records included); None where it is not published."""
        record = self.live.get(block_id)
        return None if record is None else record[_PUBLISHED.size:]

    def withdraw(self, block_id: int) -> None:
        self.live_bytes -= len(self.live.pop(block_id, b""))
        self.pending += _WITHDRAWN.pack(b"W", block_id)

    def clear(self) -> None:
        self.live.clear()
        self.live_bytes = 0
        self.pending += b"C"

    def flush(self) -> None:
        """Write what is pending; an error (a full disk) propagates, with nothing pending lost from memory.
        :class:`Superseded` where the file had to be rewritten and is no longer this writer's."""
        if not self.pending:
            return
        if self.file_bytes + len(self.pending) > max(COMPACT_AT_BYTES,
                                                     COMPACT_FACTOR * (len(self.head) + self.live_bytes)):
            self.compact()
            return
        while self.pending:  # a short write is followed by the rest, or by the error that cut it short
            written = os.write(self.fd, self.pending)
            self.file_bytes += written
            del self.pending[:written]

    def compact(self) -> None:
        """Put a file with only what is published now in the index's place (what is pending included)."""
        with self._locked():
            if not self.owns_path():
                raise Superseded(f"{self.path} is another engine's index now")
            self._replace()

    def owns_path(self) -> bool:
        """Whether the file at :attr:`path` is still the one this writer appends to."""
        try:
            there = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        mine = os.fstat(self.fd)
        return (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino)

    def remove(self) -> None:
        """Close, and remove the index where it is still this writer's (not a successor's that replaced it)."""
        try:
            with self._locked():
                if self.owns_path():
                    self.path.unlink()
        finally:
            self.close()

    def close(self) -> None:
        os.close(self.fd)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the index's lock: between this writer's look at whose the file is and its rename, no other writer
        of this index replaces it."""
        lock = self.path.with_name(self.path.name + ".lock")
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            deadline = time.monotonic() + LOCK_WAIT_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{lock} is held by another writer (a hung predecessor?) for over "
                                           f"{LOCK_WAIT_S:g} s") from None
                    time.sleep(0.01)
            yield
        finally:
            os.close(fd)

    def _replace(self) -> None:
        """Write the header and the live records to a new file and rename it over :attr:`path` (the caller holds
        the lock); where that fails the old file and what is pending stay as they were."""
        staging = self.path.with_name(self.path.name + f".new-{os.getpid()}")
        body = memoryview(self.head + b"".join(self.live.values()))
        fd = os.open(staging, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            at = 0
            while at < len(body):
                at += os.write(fd, body[at:])
            os.replace(staging, self.path)
        except BaseException:
            os.close(fd)
            staging.unlink(missing_ok=True)
            raise
        if self.fd >= 0:
            os.close(self.fd)
        self.fd = fd
        self.file_bytes = len(body)
        self.pending.clear()


def _publish_record(block_id: int, block: Published) -> bytes:
    if len(block.block_hash) > MAX_HASH_BYTES:
        raise ValueError(f"a block hash of {len(block.block_hash)} bytes is longer than {MAX_HASH_BYTES}")
    return _PUBLISHED.pack(b"P", block_id, block.num_tokens, len(block.block_hash)) + block.block_hash
