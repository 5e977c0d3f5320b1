"""The daemon's state machine over the real host backend: granule arithmetic, chunk runs, budget, rollback."""

from __future__ import annotations

import errno
import itertools
import os
import random

import pytest
from hbmd.daemon.backends.host import HostBackend
from hbmd.daemon.backends.pool import HostPool
from hbmd.daemon.state import DEMOTE_IDLE_S, State
from hbmd.proto.errors import (
    Conflict,
    InvalidRequest,
    NotFound,
    OutOfBudget,
    OutOfDeviceMemory,
    PermissionDenied,
    SessionLost,
)
from hbmd.proto.runs import backed_runs, merge_runs, new_runs, subtract_runs
from hbmd.proto.units import round_up
from helpers import GRANULE, ManualClock, MiB, wait_until

pytestmark = pytest.mark.unit


class FailingHostBackend(HostBackend):
    """Host memory whose ``create`` fails at call number ``fail_at`` (1-based); counts live chunks."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.calls = 0
        self.live = 0
        self.arenas = 0

    def open_arena(self, reserved_bytes, shareable):
        self.arenas += 1
        return super().open_arena(reserved_bytes, shareable)

    def close_arena(self, arena):
        self.arenas -= 1
        super().close_arena(arena)

    def create(self, arena, offset, size, tier="device"):
        self.calls += 1
        if self.calls == self.fail_at:
            raise OutOfDeviceMemory("injected failure")
        chunk = super().create(arena, offset, size, tier)
        self.live += 1
        return chunk

    def release(self, arena, chunk):
        self.live -= 1
        super().release(arena, chunk)


@pytest.fixture
def state():
    s = State(HostBackend(), budget_bytes=64 * MiB)
    return s


@pytest.fixture
def session(state):
    return state.open_session(pid=1, uid=1000, gid=1000, client_name="t", tenant="")


def test_merge_and_subtract_runs():
    assert merge_runs([(4, 6), (0, 2), (2, 3), (10, 10)]) == [(0, 3), (4, 6)]
    assert subtract_runs([(0, 10), (20, 30)], [(2, 4), (8, 22), (29, 40)]) == [(0, 2), (4, 8), (22, 29)]
    assert subtract_runs([(0, 10)], []) == [(0, 10)]
    assert subtract_runs([(0, 10)], [(0, 10)]) == []


def test_backed_runs_merge_a_straddling_granule():
    # Segments of 3 MiB: segment 1 starts inside granule 1, which segment 0's prefix also needs.
    seg = 3 * MiB
    assert backed_runs([0, seg], [3 * MiB] * 2, GRANULE) == [(0, 6 * MiB)]
    # Segment 0 needs granule 0, segment 1 (starting at 3 MiB) needs granule 1: touching runs merge.
    assert backed_runs([0, seg], [1 * MiB] * 2, GRANULE) == [(0, 4 * MiB)]
    assert backed_runs([0, seg], [0] * 2, GRANULE) == []


def test_backed_runs_of_two_segments_are_two_runs():
    assert backed_runs([0, 32 * MiB], [3 * MiB] * 2, GRANULE) == [(0, 4 * MiB), (32 * MiB, 36 * MiB)]


def test_new_runs_takes_its_short_way_only_where_it_gives_the_same_answer():
    rng = random.Random(7)
    for _ in range(2000):
        capacities = [rng.choice([GRANULE, 2 * GRANULE, 3 * MiB, 5 * MiB, 1, 4096]) for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.5:
            capacities = [round_up(c, GRANULE) for c in capacities]  # every segment on a granule: the short way
        offsets = list(itertools.accumulate(capacities, initial=0))[:-1]
        old = [rng.randint(0, c) for c in capacities]
        new = [rng.randint(o, c) for o, c in zip(old, capacities)]
        runs = subtract_runs(backed_runs(offsets, new, GRANULE), backed_runs(offsets, old, GRANULE))
        assert new_runs(offsets, old, new, GRANULE) == runs


def test_sessions_are_counted_by_uid_and_workers_by_tenant_as_they_come_and_go(state):
    a = state.open_session(pid=1, uid=1000, gid=1000, client_name="a", tenant="train")
    b = state.open_session(pid=2, uid=1000, gid=1000, client_name="b", tenant="serve")
    state.open_session(pid=3, uid=1000, gid=1000, client_name="ctl", tenant="serve", observer=True)
    c = state.open_session(pid=4, uid=1001, gid=1001, client_name="c", tenant="serve")

    def workers_by_tenant(uid=None):
        return {t.name: t.num_sessions for t in state.tenant_infos(uid)}

    assert state.sessions.num_workers == 3
    assert workers_by_tenant() == {"train": 1, "serve": 2}
    assert workers_by_tenant(1001) == {"serve": 2}
    state.close_session(b)
    state.close_session(c)
    assert state.sessions.num_workers == 1
    assert workers_by_tenant() == {"train": 1, "serve": 0}
    assert workers_by_tenant(1001) == {}
    assert set(state.sessions.of_uid) == {1000}
    state.check_invariants()
    state.close_session(a)
    assert state.sessions.num_workers == 0
    state.check_invariants()


def test_commit_makes_one_chunk_per_run_not_per_granule(state, session):
    buf = state.buffers.create(session, 64 * MiB, 1)
    chunks = state.commit(session, buf.buffer_id, 40 * MiB)
    assert [(c.offset, c.size) for c in chunks] == [(0, 40 * MiB)]
    chunks = state.commit(session, buf.buffer_id, 41 * MiB)
    assert [(c.offset, c.size) for c in chunks] == [(40 * MiB, 2 * MiB)]
    assert buf.physical_bytes == 42 * MiB and state.tenants.committed_bytes == 42 * MiB


def test_segments_grow_in_lockstep(state, session):
    buf = state.buffers.create(session, 64 * MiB, 2)
    chunks = state.commit(session, buf.buffer_id, 3 * MiB)
    assert [(c.offset, c.size) for c in chunks] == [(0, 4 * MiB), (32 * MiB, 4 * MiB)]
    chunks = state.commit(session, buf.buffer_id, 5 * MiB)
    assert [(c.offset, c.size) for c in chunks] == [(4 * MiB, 2 * MiB), (36 * MiB, 2 * MiB)]
    assert buf.bytes_per_segment == 5 * MiB


def test_a_straddling_granule_is_backed_exactly_once(state, session):
    # 2 segments of 3 MiB: granule [2, 4) MiB holds the end of segment 0 and the start of segment 1.
    buf = state.buffers.create(session, 6 * MiB, 2)
    first = state.commit(session, buf.buffer_id, 1 * MiB)
    assert [(c.offset, c.size) for c in first] == [(0, 4 * MiB)]
    second = state.commit(session, buf.buffer_id, 3 * MiB)
    assert [(c.offset, c.size) for c in second] == [(4 * MiB, 2 * MiB)]
    assert buf.physical_bytes == 6 * MiB == buf.reserved
    granules = [g for c in buf.chunks for g in range(c.offset // GRANULE, (c.offset + c.size) // GRANULE)]
    assert sorted(granules) == [0, 1, 2]


def test_capacity_is_rounded_to_granules(state, session):
    buf = state.buffers.create(session, 5 * MiB + 1, 1)
    assert buf.reserved == 6 * MiB and buf.capacity == 5 * MiB + 1
    state.commit(session, buf.buffer_id, 5 * MiB + 1)
    assert buf.physical_bytes == 6 * MiB


@pytest.mark.parametrize(
    "capacity, segments",
    [(0, 1), (-1, 1), (1 << 51, 1), (MiB, 0), (MiB, -2), (MiB, 3), (4, 5), (MiB, 1 << 17)],
)
def test_bad_buffer_shapes_are_refused(state, session, capacity, segments):
    with pytest.raises(InvalidRequest):
        state.buffers.create(session, capacity, segments)
    assert state.buffers.by_id == {}


def test_commit_errors_change_nothing(state, session):
    buf = state.buffers.create(session, 16 * MiB, 2)
    state.commit(session, buf.buffer_id, 2 * MiB)
    before = (buf.bytes_per_segment, list(buf.chunks), state.tenants.committed_bytes)
    with pytest.raises(InvalidRequest, match="grow-only"):
        state.commit(session, buf.buffer_id, MiB)
    with pytest.raises(InvalidRequest, match="exceeds the segment capacity"):
        state.commit(session, buf.buffer_id, 8 * MiB + 1)
    with pytest.raises(InvalidRequest):
        state.commit(session, buf.buffer_id, -1)
    with pytest.raises(NotFound):
        state.commit(session, 999, MiB)
    assert (buf.bytes_per_segment, list(buf.chunks), state.tenants.committed_bytes) == before


def test_budget_refuses_the_whole_commit(state, session):
    buf = state.buffers.create(session, 128 * MiB, 2)
    with pytest.raises(OutOfBudget, match="budget") as info:
        state.commit(session, buf.buffer_id, 33 * MiB)
    assert info.value.details == {"budget": 64 * MiB, "used": 0, "requested": 68 * MiB, "held": 0}
    assert buf.chunks == [] and state.tenants.committed_bytes == 0
    state.commit(session, buf.buffer_id, 32 * MiB)
    assert state.tenants.committed_bytes == 64 * MiB  # the whole budget is usable


def test_another_sessions_buffer_is_refused(state, session):
    other = state.open_session(pid=2, uid=1000, gid=1000, client_name="", tenant="")
    buf = state.buffers.create(session, 8 * MiB, 1)
    for op in (lambda: state.commit(other, buf.buffer_id, MiB), lambda: state.buffers.release(other, buf.buffer_id),
               lambda: state.free(other, buf.buffer_id)):
        with pytest.raises(NotFound, match="no buffer"):
            op()
    assert buf.buffer_id in state.buffers.by_id


def test_release_keeps_the_reservation_and_close_frees_everything(state, session):
    buf = state.buffers.create(session, 16 * MiB, 1)
    state.commit(session, buf.buffer_id, 8 * MiB)
    assert state.buffers.release(session, buf.buffer_id) == 8 * MiB
    assert buf.buffer_id in state.buffers.by_id and buf.chunks == [] and state.tenants.committed_bytes == 0
    state.commit(session, buf.buffer_id, 4 * MiB)
    assert state.close_session(session) == 4 * MiB
    assert state.buffers.by_id == {} and state.sessions.by_id == {} and state.tenants.committed_bytes == 0


@pytest.mark.parametrize("fail_at", [1, 2, 3])
def test_a_failing_create_undoes_the_chunks_already_made(fail_at):
    backend = FailingHostBackend(fail_at)
    state = State(backend, budget_bytes=1 << 30)
    session = state.open_session(1, 1000, 1000, "", "")
    buf = state.buffers.create(session, 3 * 8 * MiB, 3)  # three segments: three runs, three creates
    with pytest.raises(OutOfDeviceMemory):
        state.commit(session, buf.buffer_id, 2 * MiB)
    assert backend.live == 0 and buf.chunks == [] and state.tenants.committed_bytes == 0 and buf.bytes_per_segment == 0
    state.close_session(session)
    assert backend.arenas == 0


def test_a_host_chunk_is_a_sealed_memfd_of_exactly_its_size_really_backed():
    backend = HostBackend()
    arena = backend.open_arena(8 * MiB, False)
    chunk = backend.create(arena, 2 * MiB, 4 * MiB)
    exported = backend.export(arena, chunk)
    try:
        assert os.fstat(exported).st_size == 4 * MiB and os.fstat(exported).st_blocks * 512 == 4 * MiB
        # What a client holding the FD would try: neither grows the memory behind it.
        with pytest.raises(PermissionError):
            os.ftruncate(exported, 8 * MiB)
        with pytest.raises(PermissionError):
            os.posix_fallocate(exported, 4 * MiB, 4 * MiB)
        assert os.fstat(exported).st_blocks * 512 == 4 * MiB
        backend.release(arena, chunk)
        assert os.fstat(exported).st_blocks == 0  # a copy kept past the release holds no memory
    finally:
        os.close(exported)
        backend.close_arena(arena)


def test_persistent_names_are_scoped_per_user(state, session):
    buf = state.buffers.create(session, 8 * MiB, 1, name="kv", persistent=True)
    state.close_session(session)
    stranger = state.open_session(pid=9, uid=2000, gid=2000, client_name="", tenant="")
    with pytest.raises(NotFound):
        state.orphans.attach(stranger, "kv")
    with pytest.raises(NotFound):
        state.delete(stranger, "kv")
    state.buffers.create(stranger, 8 * MiB, 1, name="kv", persistent=True)  # its own, same name
    owner_again = state.open_session(pid=10, uid=1000, gid=1000, client_name="", tenant="")
    assert state.orphans.attach(owner_again, "kv") is buf


def test_a_session_ending_mid_defragment_keeps_the_old_chunks(state, session):
    buf = state.buffers.create(session, 16 * MiB, 1, name="kv", persistent=True)
    for size in (2 * MiB, 4 * MiB, 6 * MiB):
        state.commit(session, buf.buffer_id, size)
    old = list(buf.chunks)
    new = state.buffers.defragment(session, buf.buffer_id, preserve=True)
    assert [(c.offset, c.size) for c in new] == [(0, 6 * MiB)] and state.tenants.committed_bytes == 12 * MiB
    with pytest.raises(Conflict):
        state.commit(session, buf.buffer_id, 8 * MiB)
    state.close_session(session)
    assert buf.chunks == old and buf.pending == [] and state.tenants.committed_bytes == 6 * MiB and buf.owner is None


def test_finish_defragment_swaps_or_drops(state, session):
    buf = state.buffers.create(session, 16 * MiB, 1)
    for size in (2 * MiB, 4 * MiB):
        state.commit(session, buf.buffer_id, size)
    state.buffers.defragment(session, buf.buffer_id, preserve=True)
    assert state.buffers.finish_defragment(session, buf.buffer_id, keep_new=False) == 4 * MiB
    assert len(buf.chunks) == 2 and buf.physical_bytes == 4 * MiB
    state.buffers.defragment(session, buf.buffer_id, preserve=True)
    assert state.buffers.finish_defragment(session, buf.buffer_id, keep_new=True) == 4 * MiB
    assert len(buf.chunks) == 1 and buf.physical_bytes == 4 * MiB and state.tenants.committed_bytes == 4 * MiB
    with pytest.raises(InvalidRequest):
        state.buffers.finish_defragment(session, buf.buffer_id, keep_new=True)


def test_detach_orphans_a_persistent_buffer_with_its_chunks(state, session):
    buf = state.buffers.create(session, 16 * MiB, 1, name="kv", persistent=True)
    state.commit(session, buf.buffer_id, 4 * MiB)
    chunks = list(buf.chunks)
    assert state.orphans.detach(session, buf.buffer_id) == 0
    assert buf.owner is None and buf.buffer_id not in session.buffers
    assert buf.chunks == chunks and state.tenants.committed_bytes == 4 * MiB
    with pytest.raises(NotFound):
        state.orphans.detach(session, 999)
    other = state.open_session(pid=2, uid=1000, gid=1000, client_name="", tenant="")
    assert state.orphans.attach(other, "kv") is buf
    state.check_invariants()


def test_detach_refuses_anonymous_and_others_buffers(state, session):
    anonymous = state.buffers.create(session, 8 * MiB, 1)
    with pytest.raises(InvalidRequest):
        state.orphans.detach(session, anonymous.buffer_id)
    named = state.buffers.create(session, 8 * MiB, 1, name="kv", persistent=True)
    other = state.open_session(pid=2, uid=1000, gid=1000, client_name="", tenant="")
    with pytest.raises(NotFound):  # another session's buffer is answered as a missing one
        state.orphans.detach(other, named.buffer_id)
    assert anonymous.owner is session and named.owner is session


def test_detach_mid_defragment_keeps_the_old_chunks(state, session):
    buf = state.buffers.create(session, 16 * MiB, 1, name="kv", persistent=True)
    for size in (2 * MiB, 4 * MiB):
        state.commit(session, buf.buffer_id, size)
    old = list(buf.chunks)
    state.buffers.defragment(session, buf.buffer_id, preserve=True)
    assert state.orphans.detach(session, buf.buffer_id) == 4 * MiB
    assert buf.chunks == old and buf.pending == [] and state.tenants.committed_bytes == 4 * MiB and buf.owner is None
    state.check_invariants()


def test_a_top_up_past_its_time_makes_one_granule_and_leaves_the_session_first_in_line():
    state = State(HostBackend(), budget_bytes=256 * MiB)
    first, second = (state.open_session(1, 1000, 100 + i, "w", "", lease=True) for i in range(2))
    for session in (first, second):
        buffer = state.buffers.create(session, 64 * MiB, 1)
        state.commit(session, buffer.buffer_id, GRANULE)  # through the daemon: a lease of two granules is due
    assert state.leases.take_due() == [first.session_id, second.session_id]
    assert len(state.leases.top_up(first, until=0.0)) == 1  # the time is up already: one granule, the rest later
    state.leases.due_again([second.session_id])  # not reached this time
    assert state.leases.due and state.leases.take_due() == [second.session_id, first.session_id]
    assert len(state.leases.top_up(second)) == 2 and len(state.leases.top_up(first)) == 1
    assert not state.leases.due and len(first.lease) == len(second.lease) == 2
    state.check_invariants()


def test_a_state_keeps_every_time_by_the_one_clock_it_is_built_with():
    """Sessions are stamped by the clock the state is given, never the system's: a test moves it, and nothing
    waits."""
    clock = ManualClock()
    state = State(HostBackend(), budget_bytes=256 * MiB, clock=clock)
    session = state.open_session(1, 1000, 100, "w", "", lease=True)
    assert state.started_at == session.connected_at == session.lease_used_at == session.grown_at == clock.monotonic()
    clock.advance(5)
    assert state.sessions.info(session).connected_s == 5


def test_a_lease_left_idle_is_asked_back_and_grows_again_with_demand():
    clock = ManualClock()
    state = State(HostBackend(), budget_bytes=256 * MiB, lease_idle_s=30, clock=clock)
    session = state.open_session(1, 1000, 100, "w", "", lease=True)
    buffer = state.buffers.create(session, 64 * MiB, 1)
    state.commit(session, buffer.buffer_id, GRANULE)
    assert len(state.leases.top_up(session)) == 2
    now = clock.monotonic()
    state.leases.ask_back_idle(state.sessions.by_id.values(), now + 10)
    assert not state.leases.revokes_due
    state.leases.ask_back_idle(state.sessions.by_id.values(), now + 31)
    assert state.leases.revokes_due == [(session, sorted(session.lease))] and session.lease_target == 0
    state.leases.given_back(session, sorted(session.lease))
    assert state.tenants.leased_bytes == 0 and state.leases.top_up(session) == []
    state.commit(session, buffer.buffer_id, 2 * GRANULE)  # demand again
    assert len(state.leases.top_up(session)) == 2
    state.close_session(session)
    state.check_invariants()


def test_a_credential_resumes_once_and_the_one_before_only_until_the_client_speaks():
    state = State(HostBackend(), 64 * MiB)
    session = state.open_session(4242, 1000, 1000, "engine", "")
    first = state.sessions.issue_credential(session)
    state.sessions.suspend(session, float("inf"))  # the daemon went away
    assert state.sessions.resume(session.session_id, 1000, 4242, first) is session
    second = state.sessions.issue_credential(session)  # in a welcome the daemon may have gone with, unsent
    state.sessions.suspend(session, float("inf"))
    state.sessions.resume(session.session_id, 1000, 4242, first)  # the client never got `second`
    third = state.sessions.issue_credential(session)
    session.previous_credential_hash = ""  # what a request of the session does: it holds `third`
    state.sessions.suspend(session, float("inf"))
    for stale in (first, second):
        with pytest.raises(PermissionDenied, match="another process or credential"):
            state.sessions.resume(session.session_id, 1000, 4242, stale)
    with pytest.raises(PermissionDenied):
        state.sessions.resume(session.session_id, 1000, 4243, third)  # another process
    state.sessions.resume(session.session_id, 1000, 4242, third)
    with pytest.raises(SessionLost, match="no session 1 to resume"):
        state.sessions.resume(session.session_id, 1000, 4242, third)  # it is back: nothing to resume


def tiered_state(backend=None) -> State:
    """64 MiB of device budget, 32 MiB of host tier cut into 4 MiB pieces."""
    return State(backend or HostBackend(host_piece=4 * MiB), budget_bytes=64 * MiB, host_budget_bytes=32 * MiB)


def test_a_demote_charges_the_host_tier_and_frees_the_device_only_at_its_finish():
    state = tiered_state()
    session = state.open_session(1, 1000, 1000, "", "team")
    buf = state.buffers.create(session, 16 * MiB, 2)
    state.commit(session, buf.buffer_id, 6 * MiB)
    pending = state.move(session, buf.buffer_id, "host")
    # Runs [0, 6) and [8, 14) MiB, in pieces of at most 4 MiB; both tiers charged until the client is done.
    assert [(c.offset // MiB, c.size // MiB, c.tier) for c in pending] == [
        (0, 4, "host"), (4, 2, "host"), (8, 4, "host"), (12, 2, "host")]
    assert (state.tenants.committed_bytes, state.tenants.host_bytes, buf.tier) == (12 * MiB, 12 * MiB, "device")
    state.check_invariants()
    with pytest.raises(Conflict):
        state.move(session, buf.buffer_id, "device")  # one move at a time
    assert state.buffers.finish_defragment(session, buf.buffer_id, True) == 12 * MiB
    assert (state.tenants.committed_bytes, state.tenants.host_bytes) == (0, 12 * MiB)
    assert (buf.tier, buf.physical_bytes) == ("host", 12 * MiB)
    assert state.tenants.by_name["team"].host_bytes == 12 * MiB and state.tenants.by_name["team"].used_bytes == 0
    state.check_invariants()
    with pytest.raises(Conflict, match="promote"):
        state.commit(session, buf.buffer_id, 8 * MiB)
    assert state.move(session, buf.buffer_id, "host") == []  # there already
    promoted = state.move(session, buf.buffer_id, "device")
    assert [(c.offset // MiB, c.size // MiB, c.tier) for c in promoted] == [(0, 6, "device"), (8, 6, "device")]
    state.buffers.finish_defragment(session, buf.buffer_id, True)
    assert (state.tenants.committed_bytes, state.tenants.host_bytes, buf.tier) == (12 * MiB, 0, "device")
    state.check_invariants()


def test_a_demote_past_the_host_budget_or_without_a_host_tier_changes_nothing():
    state = tiered_state()
    session = state.open_session(1, 1000, 1000, "", "")
    buf = state.buffers.create(session, 48 * MiB, 1)
    state.commit(session, buf.buffer_id, 34 * MiB)
    with pytest.raises(OutOfBudget, match="host budget"):
        state.move(session, buf.buffer_id, "host")
    assert buf.pending == [] and state.tenants.host_bytes == 0 and state.tenants.committed_bytes == 34 * MiB
    untiered = State(HostBackend(), budget_bytes=64 * MiB)
    other = untiered.open_session(1, 1000, 1000, "", "")
    small = untiered.buffers.create(other, 4 * MiB, 1)
    untiered.commit(other, small.buffer_id, 2 * MiB)
    with pytest.raises(OutOfBudget, match="--host-budget"):
        untiered.move(other, small.buffer_id, "host")
    with pytest.raises(InvalidRequest, match="tier"):
        untiered.move(other, small.buffer_id, "x" * 10_000)


@pytest.mark.parametrize("fail_at", [2, 3, 4])
def test_a_failing_host_create_undoes_the_pieces_already_made(fail_at):
    backend = FailingHostBackend(fail_at + 1)  # the commit's one create first
    backend.host_piece = 4 * MiB
    state = tiered_state(backend)
    session = state.open_session(1, 1000, 1000, "", "")
    buf = state.buffers.create(session, 16 * MiB, 1)
    state.commit(session, buf.buffer_id, 14 * MiB)
    with pytest.raises(OutOfDeviceMemory):
        state.move(session, buf.buffer_id, "host")
    assert backend.live == 1 and buf.pending == [] and state.tenants.host_bytes == 0 and buf.tier == "device"
    state.check_invariants()


def test_a_session_ending_mid_demote_keeps_the_old_chunks_of_its_persistent_buffer():
    state = tiered_state()
    session = state.open_session(1, 1000, 1000, "", "")
    buf = state.buffers.create(session, 16 * MiB, 1, name="kv", persistent=True)
    state.commit(session, buf.buffer_id, 8 * MiB)
    state.move(session, buf.buffer_id, "host")
    assert state.close_session(session) == 8 * MiB  # the unconfirmed host pieces
    assert (buf.owner, buf.tier) == (None, "device")
    assert (state.tenants.committed_bytes, state.tenants.host_bytes) == (8 * MiB, 0)
    state.check_invariants()


def test_the_host_pool_fills_within_the_room_the_host_tier_leaves_on_its_own_thread():
    backend = HostBackend(host_pool_bytes=16 * MiB, host_piece=4 * MiB)
    assert backend.idle(10 * MiB, moving=False) is False  # nothing for the daemon's loop: the pool's thread does it
    wait_until(lambda: backend.host_pool_bytes() == 8 * MiB)  # two pieces fit in 10 MiB, a third would not
    wait_until(lambda: backend._host_pool.settled)
    assert backend.host_pool_bytes() == 8 * MiB
    backend.idle(4 * MiB, moving=False)
    wait_until(lambda: backend.host_pool_bytes() == 4 * MiB)  # trimmed to the room left
    backend.close()
    assert backend.host_pool_bytes() == 0
    assert backend.idle(10 * MiB, moving=False) is False and backend.host_pool_bytes() == 0  # closed: stays empty


def test_the_host_pool_waits_while_a_move_is_in_flight_and_releases_what_it_is_given_back():
    made, released = [], []

    def make(size: int) -> bytearray:
        if not made:
            made.append(size)
            raise OSError(errno.EMFILE, "too many open files")  # the first piece fails: the pool pauses, then goes on
        made.append(size)
        return bytearray(size)

    pool = HostPool(1024, 2048, make, released.append, quiet_s=0.5, retry_s=0.1)
    given = bytearray(4096)
    pool.give_back(given, 4096)  # no thread yet: released at once
    assert released == [given]
    pool.idle(4096, moving=True)
    wait_until(lambda: pool.settled)
    assert pool.bytes == 0 and made == []  # a move is in flight: nothing is pinned beside it
    pool.idle(4096, moving=False)
    wait_until(lambda: pool.bytes == 2048)  # quiet_s after the move, and a pause after the failure
    assert made == [1024, 1024, 1024]
    assert len(pool.take(512)) == 512 and pool.bytes == 2048  # a piece of another size is made, not taken
    pool.idle(4096, moving=True)
    later, over = bytearray(2048), bytearray(1024)
    pool.give_back(later, 2048)  # waits for the move: up to the pool's 2048 bytes may wait
    wait_until(lambda: pool.settled)
    assert len(released) == 1
    pool.give_back(over, 1024)  # past that: the thread releases at once, move or not, until no more than that waits
    wait_until(lambda: len(released) == 2)
    assert released[1] is over
    wait_until(lambda: pool.settled)
    assert len(released) == 2
    pool.idle(4096, moving=False)
    wait_until(lambda: len(released) == 3)
    assert released[2] is later
    pool.close()
    assert pool.bytes == 0 and len(released) == 5


def test_a_demoted_buffer_is_not_sealed_for_it_would_never_move_again():
    state = tiered_state()
    session = state.open_session(1, 1000, 1000, "", "")
    buf = state.buffers.create(session, 8 * MiB, 1, name="weights", persistent=True)
    state.commit(session, buf.buffer_id, 4 * MiB)
    state.move(session, buf.buffer_id, "host")
    with pytest.raises(Conflict, match="moved"):
        state.sealed.seal(session, buf.buffer_id)
    state.buffers.finish_defragment(session, buf.buffer_id, True)
    with pytest.raises(Conflict, match="promote it before sealing"):
        state.sealed.seal(session, buf.buffer_id)
    assert not buf.sealed
    state.check_invariants()


def demotable_state(clock: ManualClock, host_budget_bytes: int, demote_idle_s: float = DEMOTE_IDLE_S) -> State:
    """:func:`tiered_state` with a host tier of ``host_budget_bytes``, a tenant "batch" whose idle buffers are demoted
    under pressure, and ``clock`` for its time."""
    from hbmd.daemon.config import parse_config

    config = parse_config('[[tenants]]\nname = "batch"\ndemote = 1\n', total_bytes=64 * MiB, budget_bytes=64 * MiB)
    return State(HostBackend(host_piece=4 * MiB), budget_bytes=64 * MiB, config=config,
                 host_budget_bytes=host_budget_bytes, demote_idle_s=demote_idle_s, clock=clock)


def test_a_refused_commit_asks_idle_demotable_tenants_to_demote_and_promotes_wait_for_quiet():
    clock = ManualClock()
    state = demotable_state(clock, host_budget_bytes=16 * MiB)
    batch = state.open_session(1, 1000, 1000, "", "batch")
    online = state.open_session(2, 1001, 1001, "", "online")
    idle = state.buffers.create(batch, 48 * MiB, 1)
    state.commit(batch, idle.buffer_id, 40 * MiB)
    wanted = state.buffers.create(online, 64 * MiB, 1)
    with pytest.raises(OutOfBudget) as refused:
        state.commit(online, wanted.buffer_id, 32 * MiB)
    assert "demoting" not in refused.value.details and not state.sessions.reclaims_due  # it grew just now: busy
    clock.advance(DEMOTE_IDLE_S / 2)
    with pytest.raises(OutOfBudget) as refused:
        state.commit(online, wanted.buffer_id, 32 * MiB)
    assert "demoting" not in refused.value.details and not state.sessions.reclaims_due  # still busy
    clock.advance(DEMOTE_IDLE_S / 2)
    with pytest.raises(OutOfBudget, match="being demoted") as refused:
        state.commit(online, wanted.buffer_id, 32 * MiB)
    # Never more than the host tier holds; its own tenant's sessions are never asked.
    assert refused.value.details["demoting"] == 16 * MiB
    due = [(s.session_id, r.requested_bytes, r.demote) for s, r in state.sessions.reclaims_due]
    assert due == [(1, 16 * MiB, True)]
    more = state.buffers.create(batch, 32 * MiB, 1)
    with pytest.raises(OutOfBudget) as own:
        state.commit(batch, more.buffer_id, 32 * MiB)
    assert "demoting" not in own.value.details  # nor for its own tenant's commits
    state.sessions.reclaim_answered(batch, batch.reclaim.reclaim_id, 0)
    assert batch.demoted_under_pressure is False and state.pressure.promotes_due(clock.monotonic() + 60) == []


def test_a_state_that_needs_no_idle_time_asks_a_session_that_grew_just_now():
    state = demotable_state(ManualClock(), host_budget_bytes=16 * MiB, demote_idle_s=0)
    batch = state.open_session(1, 1000, 1000, "", "batch")
    online = state.open_session(2, 1001, 1001, "", "online")
    busy = state.buffers.create(batch, 48 * MiB, 1)
    state.commit(batch, busy.buffer_id, 40 * MiB)
    wanted = state.buffers.create(online, 64 * MiB, 1)
    with pytest.raises(OutOfBudget, match="being demoted"):
        state.commit(online, wanted.buffer_id, 32 * MiB)
    assert [(s.session_id, r.demote) for s, r in state.sessions.reclaims_due] == [(1, True)]


def test_a_demote_done_while_the_daemon_asks_for_one_is_marked_with_the_move_not_with_the_answer():
    """The room a demote makes can be given away before its client's answer comes; a daemon killed in between
    journaled the move, so its successor still knows to promote the buffer back."""
    clock = ManualClock()
    state = demotable_state(clock, host_budget_bytes=32 * MiB)
    batch = state.open_session(1, 1000, 1000, "", "batch")
    online = state.open_session(2, 1001, 1001, "", "online")
    idle = state.buffers.create(batch, 48 * MiB, 1)
    state.commit(batch, idle.buffer_id, 16 * MiB)
    mine = state.buffers.create(batch, 8 * MiB, 1)
    state.commit(batch, mine.buffer_id, 8 * MiB)
    state.move(batch, mine.buffer_id, "host")  # its own choice: nobody asked
    state.buffers.finish_defragment(batch, mine.buffer_id, True)
    assert batch.demoted_under_pressure is False
    wanted = state.buffers.create(online, 64 * MiB, 1)
    clock.advance(DEMOTE_IDLE_S)
    with pytest.raises(OutOfBudget, match="being demoted"):
        state.commit(online, wanted.buffer_id, 56 * MiB)
    state.move(batch, idle.buffer_id, "host")
    assert batch.demoted_under_pressure is True and batch.reclaim.released_bytes is None
    state.buffers.finish_defragment(batch, idle.buffer_id, True)
    state.commit(online, wanted.buffer_id, 56 * MiB)  # the room went to the commit before the answer
    state.check_invariants()
