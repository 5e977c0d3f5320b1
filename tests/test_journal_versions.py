"""Today's daemon reads the journal of every earlier version: real journals, written by the daemon of each version.

``tests/data/journals/vN/`` holds what the daemon of journal version N left
in its state directory (``README.md`` there says which commit and how): a
session that declared a persistent buffer ``kv`` of two 8 MiB segments, two
granules committed in each (chunks 1 to 4), and a plain 8 MiB buffer with one
4 MiB chunk (chunk 5), the daemon stopped with SIGTERM under its live
client. Versions 1 to 3 journaled persistent buffers only, in JSON.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from hbmd import memfd
from hbmd.daemon.restart.journal import Journal
from hbmd.daemon.restart.journaled import JournaledBuffer, buffer_of, session_of
from hbmd.daemon.restart.restore import JOURNAL_VERSION, chunk_name, legacy_chunk_name
from hbmd.proto import TIER_DEVICE
from helpers import GRANULE, MiB, wait_until

JOURNALS = Path(__file__).resolve().parent / "data" / "journals"
VERSIONS = range(1, JOURNAL_VERSION)
KV = [(1, 0, 2 * MiB), (2, 8 * MiB, 2 * MiB), (3, 2 * MiB, 2 * MiB), (4, 10 * MiB, 2 * MiB)]
"""The persistent buffer's chunks as every version journaled them: id, offset, size."""
SCRATCH = [(5, 0, 4 * MiB)]


def journal_of(version: int) -> Journal:
    """The fixture's journal, as the daemon of today opens it (a version 1 to 3 journal lies beside, in JSON)."""
    return Journal(JOURNALS / f"v{version}" / "host.journal")


def rows(buffer: JournaledBuffer) -> list[tuple[int, int, int]]:
    return [(c.chunk_id, c.offset, c.size) for c in buffer.chunks]


@pytest.mark.unit
@pytest.mark.parametrize("version", VERSIONS)
def test_every_earlier_journal_reads_as_the_records_it_was_written_from(version):
    image = journal_of(version).read()
    assert image["meta"]["version"] == version
    if version == 1:
        # The host backend of version 1 parked each buffer's arena whole, a chunk's fourth field its offset in it: no
        # later daemon adopts that, and the record is refused as damage (and its buffer lost) rather than misread.
        (record,) = image["buffers"].values()
        with pytest.raises(ValueError, match=r"its chunks are not \[id, offset, size\] each"):
            buffer_of(record, GRANULE)
        # Its CUDA backend wrote that field as 0 (each chunk its own allocation): then the equal segments read.
        record = {**record, "chunks": [[*row[:3], 0] for row in record["chunks"]]}
        image = {**image, "buffers": {1: record}}
    buffers = {key: buffer_of(record, GRANULE) for key, record in image["buffers"].items()}
    kv = buffers[1]
    assert (kv.buffer_id, kv.name, kv.persistent, kv.uid, kv.tenant) == (1, "kv", True, 0, "uid:0")
    assert (kv.capacity, kv.capacities, kv.sizes) == (16 * MiB, [8 * MiB] * 2, [4 * MiB] * 2)
    assert rows(kv) == KV and kv.pending == [] and kv.held == frozenset()
    assert {c.tier for c in kv.chunks} == {TIER_DEVICE}  # no version before 6 knew the host tier; 6 wrote none
    assert (kv.sealed, kv.shareable, kv.readers) == (False, False, {})
    assert kv.orphan == (0.0, 0.0, 0.0, ("", 0))  # no grace period: kept until deleted, as every version meant
    if version < 4:  # persistent buffers only, brought back as orphans
        assert image["sessions"] == {} and list(buffers) == [1] and kv.owner == 0
        return
    assert kv.owner == 1
    scratch = buffers[2]
    assert (scratch.name, scratch.persistent, scratch.owner, scratch.capacities, scratch.sizes) == (
        "", False, 1, [8 * MiB], [4 * MiB])
    assert rows(scratch) == SCRATCH
    (record,) = image["sessions"].values()
    session = session_of(record, GRANULE, 256 * MiB)
    assert (session.session_id, session.name, session.uid, session.tenant, session.lease) == (
        1, "fixture", 0, "uid:0", [])
    assert len(session.credential) == 64 and session.previous_credential == ""
    # Its last answer: the commit of the plain buffer, chunk 5, answered again if the request is sent again.
    assert session.answer is not None
    assert (session.answer.frames, session.answer.buffer_id, session.answer.chunk_ids) == (None, 2, [5])
    # Fields later versions added read as what their absence meant: no credit, never demoted, holdings unknown.
    assert (session.wants_credit, session.credit, session.demoted, session.holds) == (False, 0, False, None)


def parked_chunks(version: int) -> dict[str, tuple[int, int]]:
    """What a service manager kept for the fixture's daemon: the name each chunk was parked under, with its size and a
    byte to fill it with. Version 1's host backend parked each buffer's arena whole, as ``hbmd-a<id>``."""
    if version == 1:
        return {"hbmd-a1": (16 * MiB, 1)}
    chunks = [(1, row) for row in KV] + ([(2, row) for row in SCRATCH] if version >= 4 else [])
    return {legacy_chunk_name(buffer_id, chunk_id) if version < 4 else chunk_name(chunk_id): (size, chunk_id)
            for buffer_id, (chunk_id, _, size) in chunks}


@pytest.mark.ipc
@pytest.mark.parametrize("version", VERSIONS)
def test_todays_daemon_restores_every_earlier_journal_with_its_parked_chunks(start_daemon, run_dir, systemd, version):
    """A restart onto this daemon from one of each earlier journal version: the journal left as it was, each chunk's
    memfd passed back under the name that version parked it under (filled with its id, to tell it by)."""
    state_dir = run_dir / "state"
    shutil.copytree(JOURNALS / f"v{version}", state_dir)
    for name, (size, fill) in parked_chunks(version).items():
        fd = memfd.sealed_memfd(size)
        os.pwrite(fd, bytes([fill]) * size, 0)
        systemd.store[name] = [fd]
    daemon = start_daemon("--budget", "256MiB", "--state-dir", str(state_dir), "--resume-timeout", "1",
                          **systemd.relaunch())
    sessions, buffers = (0, 0) if version == 1 else (0, 1) if version < 4 else (1, 2)
    assert f"restored: {sessions} sessions (resuming within 1s), {buffers} buffers" in daemon.log()
    if version == 1:
        assert "buffer 1 'kv'" in daemon.log() and "is lost" in daemon.log()
        wait_until(lambda: systemd.names() == set())  # the arena nobody claims is let go
        return
    # The session's process is gone: it is not resumed, its plain buffer goes, its persistent one stays an orphan.
    with daemon.connect() as client:
        wait_until(lambda: client.status().committed_bytes == 8 * MiB)
    # Every chunk of kv is parked under this daemon's name for it, the same memory the old name held.
    wait_until(lambda: systemd.names() == {chunk_name(chunk_id) for chunk_id, _, _ in KV})
    for chunk_id, _, size in KV:
        (fd,) = systemd.store[chunk_name(chunk_id)]
        assert os.pread(fd, size, 0) == bytes([chunk_id]) * size
    # The journal is this version's now, and holds the buffer as the old one did.
    journal = Journal(state_dir / "host.journal").read()
    assert journal["meta"]["version"] == JOURNAL_VERSION
    (kv,) = (buffer_of(record, GRANULE) for record in journal["buffers"].values())
    assert (kv.name, kv.owner, kv.sizes, rows(kv)) == ("kv", 0, [4 * MiB] * 2, KV)
    assert not (state_dir / "host.journal.json").exists()


@pytest.mark.ipc
def test_the_latest_earlier_journal_without_its_chunks_is_a_cold_start(start_daemon, run_dir, systemd):
    """The journal of version 6 with nothing passed back (``systemctl stop``, then ``start``): no session resumes and
    no buffer comes back, each named as lost; the journal starts afresh at this version, and clients declare again."""
    version = JOURNAL_VERSION - 1
    state_dir = run_dir / "state"
    shutil.copytree(JOURNALS / f"v{version}", state_dir)
    daemon = start_daemon("--state-dir", str(state_dir), **systemd.relaunch())
    log = daemon.log()
    assert "restored: 0 sessions (resuming within 30s), 0 buffers" in log
    assert "buffer 1 'kv' (8.0 MiB) is lost: 4 of its 4 parked descriptors did not come back" in log
    assert "session 1 is not restored" in log
    assert Journal(state_dir / "host.journal").read()["buffers"] == {}
