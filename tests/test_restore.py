"""Restore after a restart skips a buffer that did not all come back, and keeps the rest.

The CUDA backend parks one FD per chunk, so a buffer can come back in part;
it cannot run here, so a backend whose chunks are pipes (a real FD per
chunk, duplicated when parked, as CUDA's exported FDs are) stands in for it,
with the real state, persistence layer and notifier against the systemd
stand-in.
"""

from __future__ import annotations

import logging
import os

import msgpack
import pytest
from fake_systemd import FakeSystemd
from hbmd.daemon.notify import SystemdNotifier
from hbmd.daemon.restart.persist import (
    MAX_NAMES_CHARS,
    MAX_PARKED,
    RESUME_WINDOW_S,
    Journal,
    Persistence,
    buffer_record,
    chunk_name,
)
from hbmd.daemon.state import State
from helpers import GRANULE, ManualClock, descriptors_where, wait_until

pytestmark = pytest.mark.unit


class PipeBackend:
    """Each chunk is the read end of a pipe; ``adopt`` raises a plain RuntimeError at offset ``refuse_at``."""

    name = "pipes"
    instance = "test"
    granularity = GRANULE
    total_bytes = 64 * GRANULE
    device_uuid = ""
    device_index = -1

    def __init__(self, refuse_at: int | None = None) -> None:
        self.refuse_at = refuse_at

    def open_arena(self, reserved_bytes: int, shareable: bool) -> None:
        return None

    def create(self, arena: None, offset: int, size: int, tier: str = "device") -> int:
        read, write = os.pipe()
        os.close(write)
        return read

    def export(self, arena: None, chunk: int) -> int:
        return os.dup(chunk)

    parked_fd = export

    def release(self, arena: None, chunk: int) -> None:
        os.close(chunk)

    def close_arena(self, arena: None) -> None:
        pass

    def adopt_arena(self, reserved_bytes: int, shareable: bool) -> None:
        return None

    def adopt(self, arena: None, offset: int, size: int, fd: int) -> int:
        if offset == self.refuse_at:
            raise RuntimeError("the driver is gone")  # what CudaUnavailable is
        return os.dup(fd)

    def free_bytes(self) -> int:
        return -1

    def held_back_bytes(self) -> int:
        return 0


class OneAtATimeBackend(PipeBackend):
    """Counts the chunks adopted while the descriptor passed for the one adopted before was still open."""

    def __init__(self) -> None:
        super().__init__()
        self.passed: tuple[int, tuple[int, int]] | None = None
        """The descriptor passed to the last ``adopt``, and its pipe."""
        self.both_held = 0

    def adopt(self, arena: None, offset: int, size: int, fd: int) -> int:
        if self.passed_still_open():
            self.both_held += 1
        self.passed = fd, pipe_of(fd)
        return super().adopt(arena, offset, size, fd)

    def passed_still_open(self) -> bool:
        if self.passed is None:
            return False
        fd, pipe = self.passed
        try:
            return pipe_of(fd) == pipe  # closed, its number may be another thread's by now
        except OSError:
            return False


def pipe_of(fd_or_path: int | str) -> tuple[int, int]:
    """The pipe a descriptor is open on (a chunk of :class:`PipeBackend`), as device and inode."""
    st = os.stat(fd_or_path)
    return st.st_dev, st.st_ino


def descriptors_on(chunks) -> int:
    """How many of this process's descriptors are open on the pipes of ``chunks``, whoever holds them (a state, the
    systemd stand-in's store). Only these tests open such descriptors."""
    pipes = {pipe_of(chunk.handle) for chunk in chunks}
    return descriptors_where(lambda path: pipe_of(path) in pipes)


@pytest.fixture
def store(tmp_path):
    """The systemd stand-in, and a notifier that speaks to it."""
    systemd = FakeSystemd(tmp_path / "notify.sock")
    notifier = SystemdNotifier(os.fsencode(systemd.path))
    yield systemd, notifier
    notifier.close()
    systemd.close()


def kept_state(notifier, journal, max_parked=MAX_PARKED):
    """A state of pipe chunks, each parked and journaled, and a session of it."""
    state = State(PipeBackend(), 32 * GRANULE)
    persistence = Persistence(state, notifier, journal, max_parked=max_parked)
    return state, persistence, state.open_session(1, 1000, 1000, "writer", "")


@pytest.fixture
def parked(tmp_path, store):
    """Two persistent buffers parked chunk by chunk: 'kept' (2 chunks) and 'lost' (3 chunks)."""
    systemd, notifier = store
    state, persistence, session = kept_state(notifier, tmp_path / "journal")
    ids = {}
    for name, chunks in (("kept", 2), ("lost", 3)):
        buffer = state.buffers.create(session, 8 * GRANULE, 1, name, persistent=True)
        for size in range(1, chunks + 1):
            state.commit(session, buffer.buffer_id, size * GRANULE)
        ids[name] = buffer
    persistence.sync()
    names = {chunk_name(c.chunk_id) for b in ids.values() for c in b.chunks}
    wait_until(lambda: systemd.names() == names)
    state.close_session(session)
    persistence.sync()
    yield systemd, notifier, tmp_path / "journal", ids
    for buffer in list(state.buffers.by_id.values()):
        for chunk in buffer.chunks:
            os.close(chunk.handle)


def restart(systemd, notifier, journal, backend):
    """A new state restored from what the store passes back; returns it and how many buffers it restored."""
    with systemd.lock:
        passed = {name: [os.dup(fd) for fd in fds] for name, fds in systemd.store.items()}
    state = State(backend, 32 * GRANULE)
    return state, Persistence(state, notifier, journal).restore(passed)


def test_a_buffer_missing_one_chunk_fd_is_skipped_and_unparked(parked, caplog):
    systemd, notifier, journal, buffers = parked
    lost = buffers["lost"]
    dropped = chunk_name(lost.chunks[1].chunk_id)
    with systemd.lock:  # the store lets one go, as beyond FileDescriptorStoreMax
        for fd in systemd.store.pop(dropped):
            os.close(fd)
    kept = buffers["kept"]
    kept_before, lost_before = descriptors_on(kept.chunks), descriptors_on(lost.chunks)
    with caplog.at_level(logging.WARNING, "hbmd.persist"):
        state, restored = restart(systemd, notifier, journal, PipeBackend())
    assert restored == (0, 1) and [b.name for b in state.buffers.by_id.values()] == ["kept"]
    lost_line = f"buffer {lost.buffer_id} 'lost' (6.0 MiB) is lost: 1 of its 3 parked descriptors did not come back"
    assert lost_line in caplog.text
    state.check_invariants()
    wait_until(lambda: systemd.names() == {chunk_name(c.chunk_id) for c in kept.chunks})
    # The new state holds the two chunks of 'kept'; the FDs of 'lost' that did come back are closed, and the store
    # let go of its own two.
    assert descriptors_on(kept.chunks) == kept_before + 2
    assert descriptors_on(lost.chunks) == lost_before - 2
    for chunk in state.buffers.by_id[kept.buffer_id].chunks:
        os.close(chunk.handle)


def test_a_buffer_the_backend_cannot_adopt_is_skipped_and_what_was_adopted_released(parked, caplog):
    systemd, notifier, journal, buffers = parked
    lost, kept = buffers["lost"], buffers["kept"]
    kept_before, lost_before = descriptors_on(kept.chunks), descriptors_on(lost.chunks)
    with caplog.at_level(logging.WARNING, "hbmd.persist"):
        state, restored = restart(systemd, notifier, journal, PipeBackend(refuse_at=lost.chunks[2].offset))
    assert restored == (0, 1) and [b.name for b in state.buffers.by_id.values()] == ["kept"]
    assert f"buffer {lost.buffer_id} 'lost' (6.0 MiB) is lost: the driver is gone" in caplog.text
    state.check_invariants()
    wait_until(lambda: systemd.names() == {chunk_name(c.chunk_id) for c in kept.chunks})
    assert descriptors_on(kept.chunks) == kept_before + 2
    # The two adopted chunks of 'lost' were released, the three passed closed, and the store let go of its own three.
    assert descriptors_on(lost.chunks) == lost_before - 3
    for chunk in state.buffers.by_id[kept.buffer_id].chunks:
        os.close(chunk.handle)


def test_no_more_chunks_are_parked_than_the_service_manager_can_pass_back(tmp_path, store, caplog):
    # LISTEN_FDNAMES must fit one environment variable: the most parked, with typical ids, does.
    assert len(":".join(chunk_name(i) for i in range(50_000_000, 50_000_000 + MAX_PARKED))) < MAX_NAMES_CHARS
    systemd, notifier = store
    state, persistence, session = kept_state(notifier, tmp_path / "journal", max_parked=3)
    buffer = state.buffers.create(session, 8 * GRANULE, 4)
    with caplog.at_level(logging.WARNING, "hbmd.persist"):
        state.commit(session, buffer.buffer_id, [GRANULE, 0, 0, 0])
        state.commit(session, buffer.buffer_id, [GRANULE, GRANULE, GRANULE, GRANULE])  # 3 runs: 4 chunks in all
    assert "the buffers of further chunks will not survive a restart" in caplog.text
    wait_until(lambda: systemd.names() == {chunk_name(c.chunk_id) for c in buffer.chunks[:3]})
    state.close_session(session)  # releases them all: unparked once the journal says so
    persistence.sync()
    wait_until(lambda: systemd.names() == set())


def test_a_released_chunk_is_unparked_only_once_the_journal_says_it_is_gone(tmp_path, store):
    # A daemon that dies between the two comes back from a journal that still lists the chunk: it must find it.
    systemd, notifier = store
    state, persistence, session = kept_state(notifier, tmp_path / "journal")
    buffer = state.buffers.create(session, 8 * GRANULE, 1)
    state.commit(session, buffer.buffer_id, 2 * GRANULE)
    persistence.sync()
    names = {chunk_name(c.chunk_id) for c in buffer.chunks}
    wait_until(lambda: systemd.names() == names)
    state.buffers.release(session, buffer.buffer_id)
    systemd.barrier()
    assert systemd.names() == names  # the journal still lists them
    persistence.sync()
    assert Journal(tmp_path / "journal").read()["buffers"][buffer.buffer_id]["chunks"] == []
    wait_until(lambda: systemd.names() == set())
    state.close_session(session)


def test_a_buffer_that_only_grows_costs_the_journal_its_new_chunks_and_replays_exactly(tmp_path, store):
    _systemd, notifier = store
    state, persistence, session = kept_state(notifier, tmp_path / "journal")
    state.tenants.budget_bytes = 1024 * GRANULE
    buffer = state.buffers.create(session, 512 * GRANULE, 2)
    journal = persistence.journal
    growth = []
    for step in range(1, 201):  # granule by granule: a chunk a commit, each segment's list growing
        state.commit(session, buffer.buffer_id, step * GRANULE)
        before = journal.size
        persistence.sync()
        growth.append(journal.size - before)
    # The record of a commit does not grow with the chunks before it (a whole record would, by ~12 bytes each).
    assert max(growth[150:]) <= max(growth[:10]) + 8
    state.buffers.release(session, buffer.buffer_id)  # a shrink is a whole record again
    state.commit(session, buffer.buffer_id, 3 * GRANULE)
    persistence.sync()
    replayed = Journal(tmp_path / "journal").read()["buffers"][buffer.buffer_id]
    assert replayed == msgpack.unpackb(msgpack.packb(buffer_record(buffer)), strict_map_key=False)
    state.close_session(session)
    persistence.sync()


def test_a_restored_session_waits_for_its_client_by_the_states_clock(tmp_path, store):
    """The resume window is kept by the clock the state is built with: a test moves it instead of waiting it out."""
    systemd, notifier = store
    _, persistence, session = kept_state(notifier, tmp_path / "journal")
    persistence.sync()
    with systemd.lock:
        passed = {name: [os.dup(fd) for fd in fds] for name, fds in systemd.store.items()}
    clock = ManualClock()
    restored = State(PipeBackend(), 32 * GRANULE, clock=clock)
    assert Persistence(restored, notifier, tmp_path / "journal").restore(passed) == (1, 0)
    waiting = restored.sessions.by_id[session.session_id]
    clock.advance(RESUME_WINDOW_S - 1)
    assert restored.sessions.unresumed(clock.monotonic(), lambda pid: False) == []
    clock.advance(2)
    assert restored.sessions.unresumed(clock.monotonic(), lambda pid: False) == [waiting]


def test_a_restore_holds_one_descriptor_a_chunk_not_two(tmp_path, store):
    # Thousands of chunks come back under an FD limit that holds them once: each passed FD closes once adopted, before
    # the next chunk is.
    systemd, notifier = store
    state, persistence, session = kept_state(notifier, tmp_path / "journal")
    state.tenants.budget_bytes = 1024 * GRANULE
    buffer = state.buffers.create(session, 800 * GRANULE, 400, "many", persistent=True)
    state.commit(session, buffer.buffer_id, GRANULE)  # a chunk per segment: 400
    persistence.sync()
    wait_until(lambda: len(systemd.names()) == 400)
    with systemd.lock:
        passed = {name: [os.dup(fd) for fd in fds] for name, fds in systemd.store.items()}
    backend = OneAtATimeBackend()
    restored = State(backend, 1024 * GRANULE)
    assert Persistence(restored, notifier, tmp_path / "journal").restore(passed) == (1, 1)
    assert len(restored.buffers.by_id[buffer.buffer_id].chunks) == 400
    assert backend.both_held == 0 and not backend.passed_still_open()
    for state_of in (state, restored):
        for chunk in state_of.buffers.by_id[buffer.buffer_id].chunks:
            os.close(chunk.handle)


def test_a_daemon_that_took_over_parks_each_chunk_once_beside_what_its_predecessor_parked(tmp_path, store):
    systemd, notifier = store
    state, persistence, session = kept_state(notifier, tmp_path / "journal")
    buffer = state.buffers.create(session, 8 * GRANULE, 4)
    state.commit(session, buffer.buffer_id, GRANULE)
    persistence.sync()
    wait_until(lambda: len(systemd.names()) == 4)
    # The successor holds the same chunks (handed over) and parks them with the same service.
    Persistence(state, notifier, tmp_path / "journal").start_afresh({})
    systemd.barrier()
    with systemd.lock:
        assert sorted(len(fds) for fds in systemd.store.values()) == [1, 1, 1, 1]
    state.close_session(session)
