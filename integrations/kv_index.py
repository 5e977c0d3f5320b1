"""The index of a kept KV cache: which block holds which prefix, written as vLLM computes it, read by its successor.

An engine that keeps its KV cache in hbmd (``HBMD_VLLM_KEEP_KV``, see
:mod:`hbmd.integrations.vllm_keep`) appends to one file per engine what its
block pool may serve again: a block is *published* only once the step that
computed it has finished, and *withdrawn* before the step that reuses it is
sent to the GPU. A successor reads the file back and puts every published
block into its own pool.

A successor trusts the file whole or not at all: an index that lost a record
(a withdrawal above all: the block it names holds other KV now) would make it
serve wrong tokens with no error anywhere. So every record carries a CRC-32
chained from the header's and from every record before it, and a *commit*
slot near the file's start holds the length the writer last completed and the
chain's value there, written after each flush and before the step it
precedes can run. A file shorter than its commit (cut at a record boundary,
or an older copy put back where the newer one was cut), a record whose check
fails before the commit, a commit slot or header that does not check: all
are :class:`NotAnIndex`, and the successor starts cold. Records after the
commit that check are a flush the writer did not live to commit; its step
never ran, so they stand (a torn one ends them).

The file lives beside the engine, not in the daemon: a write is one
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

Format (integers little-endian)::

    magic    b"hbmd-kv-index 2\\n"
    commit   length:u64  chain:u32  crc:u32        (crc of the 12 bytes before it)
    header   length:u32  JSON  crc:u32             (the chain starts at this crc)
    records, each followed by chain:u32 = CRC-32 of the record, seeded with the chain before it:
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

from hbmd.proto.records import CHECK, checked, checksum, sealed
from hbmd.proto.records import write_all as _write_all

MAGIC = b"hbmd-kv-index 2\n"
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
_COMMIT = struct.Struct("<QII")
_LENGTH = struct.Struct("<I")
_PUBLISHED = struct.Struct("<cIIH")
_WITHDRAWN = struct.Struct("<cI")
_HEADER_AT = len(MAGIC) + _COMMIT.size


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
    """Records past the commit ended in one cut short or damaged (the writer died mid-flush, before its step ran):
    those before it stand."""


class NotAnIndex(ValueError):
    """The file is not a kept KV cache's index, or not one whole as its writer committed it: nothing of it may be
    trusted."""


class Superseded(RuntimeError):
    """Another writer (a successor) put its own index where this writer's was: this one's records matter to nobody
    now, and it must write no more."""


def read_index(path: str | os.PathLike[str]) -> IndexContents:
    """The index at ``path``; :class:`NotAnIndex` where it is not one whole, ``FileNotFoundError`` where there is
    none. A link is not followed."""
    data = _read(path)
    header, at, chain = _header(path, data)
    committed, committed_chain, _ = _COMMIT.unpack_from(data, len(MAGIC))
    if committed > len(data):
        raise NotAnIndex(f"{path}: {len(data)} bytes, cut short of the {committed} its writer committed")
    contents = IndexContents(header, {})
    reached = at == committed and chain == committed_chain
    while at < len(data):
        end = _record_end(data, at)
        chained = None if end is None else checked(data, at, end, chain)
        if end is None or chained is None:
            break
        chain = chained
        _apply(contents.blocks, data, at)
        at = end + CHECK.size
        if at == committed:
            reached = chain == committed_chain
    if not reached:
        raise NotAnIndex(f"{path}: its records do not check up to the {committed} bytes its writer committed")
    contents.torn = at < len(data)
    return contents


def read_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The header of the index at ``path``, checked, without reading its records (what the workers look at before
    the scheduler reads the whole); errors as :func:`read_index`'s."""
    return _header(path, _read(path))[0]


def _read(path: str | os.PathLike[str]) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as file:
        return file.read()


def _header(path: str | os.PathLike[str], data: bytes) -> tuple[dict[str, Any], int, int]:
    """The header of the index ``data``, where its records start and the chain's value there; :class:`NotAnIndex`
    where its magic, commit slot or header does not check."""
    if not data.startswith(MAGIC):
        older = data.startswith(b"hbmd-kv-index ")
        raise NotAnIndex(f"{path}: {'written by an older hbmd, without checks' if older else 'not an hbmd KV index'}")
    if len(data) < _HEADER_AT + _LENGTH.size:
        raise NotAnIndex(f"{path}: cut short inside its header")
    if checked(data, len(MAGIC), len(MAGIC) + 12) is None:
        raise NotAnIndex(f"{path}: its commit does not check")
    (header_bytes,) = _LENGTH.unpack_from(data, _HEADER_AT)
    body = _HEADER_AT + _LENGTH.size
    if header_bytes > MAX_HEADER_BYTES or body + header_bytes + CHECK.size > len(data):
        raise NotAnIndex(f"{path}: its header is damaged")
    raw = data[body : body + header_bytes]
    chain = checked(data, body, body + header_bytes)
    if chain is None:
        raise NotAnIndex(f"{path}: its header does not check")
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise NotAnIndex(f"{path}: its header is damaged ({exc})") from exc
    if not isinstance(header, dict):
        raise NotAnIndex(f"{path}: its header is damaged")
    return header, body + header_bytes + CHECK.size, chain


def _record_end(data: bytes, at: int) -> int | None:
    """Where the record at ``at`` ends (its chain value follows), or None where it is cut short or unknown."""
    kind = data[at : at + 1]
    if kind == b"P" and at + _PUBLISHED.size <= len(data):
        hash_len = _PUBLISHED.unpack_from(data, at)[3]
        return at + _PUBLISHED.size + hash_len if hash_len <= MAX_HASH_BYTES else None
    if kind == b"W":
        return at + _WITHDRAWN.size
    if kind == b"C":
        return at + 1
    return None


def _apply(blocks: dict[int, Published], data: bytes, at: int) -> None:
    kind = data[at : at + 1]
    if kind == b"P":
        _, block_id, num_tokens, hash_len = _PUBLISHED.unpack_from(data, at)
        start = at + _PUBLISHED.size
        blocks[block_id] = Published(data[start : start + hash_len], num_tokens)
    elif kind == b"W":
        blocks.pop(_WITHDRAWN.unpack_from(data, at)[1], None)
    else:
        blocks.clear()


class IndexWriter:
    """Appends to an engine's index. Records wait in memory until :meth:`flush`, which writes them and then the
    commit (or, where the file has grown too large, rewrites it): the caller flushes withdrawals before the GPU may
    overwrite the blocks, publications whenever."""

    def __init__(self, path: str | os.PathLike[str], header: dict[str, Any],
                 published: dict[int, Published] | None = None) -> None:
        """Start a new index at ``path`` with ``header`` and the ``published`` blocks, replacing any there in one
        rename: a reader sees the old index or the new one, never a mix."""
        self.path = Path(path)
        self.pending = bytearray()
        header_json = json.dumps(header, sort_keys=True).encode()
        if len(header_json) > MAX_HEADER_BYTES:
            raise ValueError(f"an index header of {len(header_json)} bytes is longer than {MAX_HEADER_BYTES}")
        self.head_crc = checksum(header_json)
        self.head = _LENGTH.pack(len(header_json)) + sealed(header_json)
        self.live = {block_id: _publish_record(block_id, block) for block_id, block in (published or {}).items()}
        """What a reader of the file and :attr:`pending` would find published: each block's record, unchained."""
        self.live_bytes = sum(map(len, self.live.values()))
        self.chain = self.head_crc
        """The chain's value after the last record written or pending."""
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
        self._append(record)

    def published(self, block_id: int) -> bytes | None:
        """The hash ``block_id`` is published under now (pending records included); None where it is not published."""
        record = self.live.get(block_id)
        return None if record is None else record[_PUBLISHED.size:]

    def withdraw(self, block_id: int) -> None:
        self.live_bytes -= len(self.live.pop(block_id, b""))
        self._append(_WITHDRAWN.pack(b"W", block_id))

    def clear(self) -> None:
        self.live.clear()
        self.live_bytes = 0
        self._append(b"C")

    def flush(self) -> None:
        """Write what is pending, then the commit that makes it count; an error (a full disk) propagates, with
        nothing pending lost from memory. :class:`Superseded` where the file had to be rewritten and is no longer
        this writer's."""
        if not self.pending:
            return
        if self.file_bytes + len(self.pending) > max(COMPACT_AT_BYTES,
                                                     COMPACT_FACTOR * (_HEADER_AT + len(self.head) + self.live_bytes)):
            self.compact()
            return
        while self.pending:  # a short write is followed by the rest, or by the error that cut it short
            written = os.pwrite(self.fd, self.pending, self.file_bytes)
            self.file_bytes += written
            del self.pending[:written]
        _write_all(self.fd, _commit(self.file_bytes, self.chain), len(MAGIC))

    def compact(self) -> None:
        """Put a file with only what is published now in the index's place (what is pending included)."""
        with self._locked():
            if not self.owns_path():
                raise Superseded(f"{self.path} is another engine's index now, or was withdrawn")
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

    def _append(self, record: bytes) -> None:
        self.chain = checksum(record, self.chain)
        self.pending += record + CHECK.pack(self.chain)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the index's lock: between this writer's look at whose the file is and its rename, no other writer
        of this index replaces it."""
        with locked(self.path):
            yield

    def _replace(self) -> None:
        """Write the header and the live records, chained anew, to a new file and rename it over :attr:`path` (the
        caller holds the lock); where that fails the old file and what is pending stay as they were."""
        chain = self.head_crc
        records = bytearray()
        for record in self.live.values():
            chain = checksum(record, chain)
            records += record + CHECK.pack(chain)
        body = MAGIC + _commit(_HEADER_AT + len(self.head) + len(records), chain) + self.head + records
        staging = self.path.with_name(self.path.name + f".new-{os.getpid()}")
        staging.unlink(missing_ok=True)  # one a process of this pid left, under the lock this writer holds
        fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, body, 0)
            os.replace(staging, self.path)
        except BaseException:
            os.close(fd)
            staging.unlink(missing_ok=True)
            raise
        if self.fd >= 0:
            os.close(self.fd)
        self.fd = fd
        self.file_bytes = len(body)
        self.chain = chain
        self.pending.clear()


def withdraw_all(path: str | os.PathLike[str], why: str) -> None:
    """Put an index that publishes nothing, and says ``why``, where the index at ``path`` was (a writer still
    appending to the old one finds it replaced at its next rewrite, and stops): what the old one published must not
    be adopted by anyone."""
    IndexWriter(path, {"withdrawn": why}).close()


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold the lock of the index at ``path`` (``<index>.lock``), waiting :data:`LOCK_WAIT_S` at most."""
    lock = path.with_name(path.name + ".lock")
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


def _commit(length: int, chain: int) -> bytes:
    return sealed(_COMMIT.pack(length, chain, 0)[:12])


def _publish_record(block_id: int, block: Published) -> bytes:
    if len(block.block_hash) > MAX_HASH_BYTES:
        raise ValueError(f"a block hash of {len(block.block_hash)} bytes is longer than {MAX_HASH_BYTES}")
    return _PUBLISHED.pack(b"P", block_id, block.num_tokens, len(block.block_hash)) + block.block_hash
