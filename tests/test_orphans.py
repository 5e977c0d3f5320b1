"""Orphans in the state machine: grafts between users and tenants, and grace periods kept by an injected clock."""

from __future__ import annotations

import logging

import pytest
from hbmd.daemon.backends.host import HostBackend
from hbmd.daemon.config import parse_config
from hbmd.daemon.restart.journaled import JournaledBuffer
from hbmd.daemon.restart.restore import rebuild_buffer
from hbmd.daemon.state import State
from hbmd.proto.errors import InvalidRequest, NotFound, OutOfBudget
from helpers import ManualClock, MiB

pytestmark = pytest.mark.unit

BUDGET = 64 * MiB


def new_state(config: str = "", clock: ManualClock | None = None) -> State:
    return State(HostBackend(), BUDGET, parse_config(config, total_bytes=1 << 40, budget_bytes=BUDGET),
                 lease_bytes=0, clock=clock or ManualClock())


def orphan(state: State, name: str = "kv", uid: int = 1000, tenant: str = "", keep_s: float = 0.0,
           committed: int = 4 * MiB):
    """A persistent buffer of two segments, ``committed`` bytes in each, left by its session."""
    session = state.open_session(pid=10, uid=uid, gid=uid, client_name="engine-a", tenant=tenant)
    buffer = state.buffers.create(session, 32 * MiB, 2, name=name, persistent=True, keep_orphan_s=keep_s)
    state.commit(session, buffer.buffer_id, committed)
    state.close_session(session)
    return buffer


def test_a_graft_moves_the_chunks_and_the_charge_and_drops_the_orphans_record():
    state = new_state()
    donor = orphan(state, tenant="old")
    chunks = [(c.chunk_id, c.offset, c.size) for c in donor.chunks]
    session = state.open_session(pid=11, uid=1000, gid=1000, client_name="engine-b", tenant="new")
    target = state.buffers.create(session, 32 * MiB, 2, name="kv-b", persistent=True)

    assert state.graft(session, target.buffer_id, "kv") is target
    assert [(c.chunk_id, c.offset, c.size) for c in target.chunks] == chunks
    assert target.segment_sizes == [4 * MiB, 4 * MiB] and target.physical_bytes == 8 * MiB
    assert list(state.buffers.by_id) == [target.buffer_id] and (1000, "kv") not in state.buffers.persistent
    assert state.tenants.committed_bytes == 8 * MiB and state.buffers.num_chunks == 2
    # "old" held nothing more.
    assert {name: t.used_bytes for name, t in state.tenants.by_name.items()} == {"new": 8 * MiB}
    state.check_invariants()


def test_another_users_orphan_is_not_found_and_nothing_changes():
    state = new_state()
    orphan(state, uid=2000)
    session = state.open_session(pid=11, uid=1000, gid=1000, client_name="b", tenant="")
    target = state.buffers.create(session, 32 * MiB, 2)
    with pytest.raises(NotFound, match="no persistent buffer named 'kv' for uid 1000"):
        state.graft(session, target.buffer_id, "kv")
    assert target.chunks == [] and state.buffers.persistent[(2000, "kv")].physical_bytes == 8 * MiB
    state.check_invariants()


def test_a_graft_that_would_take_a_guaranteed_tenants_room_is_refused():
    # "keep" is guaranteed 48 MiB and holds 16 MiB of it in its orphan. Given to "other", the budget would owe "keep"
    # all 48 MiB beside the 24 MiB committed: more than its 64 MiB.
    state = new_state('[[tenants]]\nname = "keep"\nguaranteed = "48MiB"\n')
    orphan(state, tenant="keep", committed=8 * MiB)
    session = state.open_session(pid=11, uid=1000, gid=1000, client_name="b", tenant="other")
    full = state.buffers.create(session, 48 * MiB, 1)
    state.commit(session, full.buffer_id, 8 * MiB)
    target = state.buffers.create(session, 32 * MiB, 2)
    with pytest.raises(OutOfBudget, match="no room for tenant 'keep''s guaranteed minimum"):
        state.graft(session, target.buffer_id, "kv")
    assert target.chunks == [] and state.tenants.by_name["keep"].used_bytes == 16 * MiB
    state.check_invariants()
    keeper = state.open_session(pid=12, uid=1000, gid=1000, client_name="c", tenant="keep")
    own = state.buffers.create(keeper, 32 * MiB, 2)
    state.graft(keeper, own.buffer_id, "kv")  # within its own tenant the charge does not move
    state.check_invariants()


def test_an_orphan_is_freed_once_its_grace_period_is_over(caplog):
    clock = ManualClock()
    state = new_state(clock=clock)
    buffer = orphan(state, keep_s=60)
    now = clock.unix()
    assert (buffer.orphaned_at, buffer.expires_at, buffer.last_holder) == (now, now + 60, ("engine-a", 10))
    clock.advance(59.9)
    assert state.orphans.expire() == 0 and state.tenants.committed_bytes == 8 * MiB
    clock.advance(0.1)
    with caplog.at_level(logging.WARNING, logger="hbmd.state"):
        assert state.orphans.expire() == 1
    assert state.buffers.by_id == {} and state.tenants.committed_bytes == 0
    assert "orphan 'kv' of uid 1000 freed (8.0 MiB): an orphan since " in caplog.text
    assert "last held by engine-a (pid 10), nobody attached or grafted it within its 60s grace period" in caplog.text
    state.check_invariants()


def test_an_attach_or_a_graft_before_the_deadline_keeps_the_orphan():
    clock = ManualClock()
    state = new_state(clock=clock)
    attached, grafted = orphan(state, "attached", keep_s=10), orphan(state, "grafted", keep_s=10)
    session = state.open_session(pid=11, uid=1000, gid=1000, client_name="b", tenant="")
    state.orphans.attach(session, "attached")
    target = state.buffers.create(session, 32 * MiB, 2)
    state.graft(session, target.buffer_id, "grafted")
    assert attached.expires_at == 0 and attached.orphaned_at == 0
    clock.advance(3600)
    assert state.orphans.expire() == 0 and state.buffers.deadlines == {}
    assert set(state.buffers.by_id) == {attached.buffer_id, target.buffer_id}
    assert grafted.buffer_id not in state.buffers.by_id
    state.check_invariants()
    state.orphans.detach(session, attached.buffer_id)  # an orphan again: the grace period starts over
    assert attached.expires_at == clock.unix() + 10 and attached.last_holder == ("b", 11)
    state.check_invariants()


def test_a_sealed_orphan_waits_for_its_readers_then_goes():
    clock = ManualClock()
    state = new_state(clock=clock)
    owner = state.open_session(pid=10, uid=1000, gid=1000, client_name="loader", tenant="")
    weights = state.buffers.create(owner, 8 * MiB, 1, name="weights", persistent=True, keep_orphan_s=5)
    state.commit(owner, weights.buffer_id, 4 * MiB)
    state.sealed.seal(owner, weights.buffer_id)
    reader = state.open_session(pid=11, uid=1000, gid=1000, client_name="engine", tenant="")
    state.sealed.attach_reader(reader, "weights")
    state.close_session(owner)
    clock.advance(10)
    assert state.orphans.expire() == 0 and weights.buffer_id in state.buffers.by_id
    state.close_session(reader)
    assert state.orphans.expire() == 1 and state.buffers.by_id == {}
    state.check_invariants()


@pytest.mark.parametrize("keep_s, persistent", [(-1.0, True), (float("nan"), True), (float("inf"), True),
                                                 (400 * 86400.0, True), (5.0, False)])
def test_a_grace_period_out_of_range_or_for_an_anonymous_buffer_is_refused(keep_s, persistent):
    state = new_state()
    session = state.open_session(pid=10, uid=1000, gid=1000, client_name="a", tenant="")
    with pytest.raises(InvalidRequest, match="keep_orphan_s"):
        state.buffers.create(session, 8 * MiB, 1, name="kv", persistent=persistent, keep_orphan_s=keep_s)
    assert state.buffers.by_id == {}


def orphan_record(buffer_id: int, name: str, orphan: tuple[float, float, float, tuple[str, int]]) -> JournaledBuffer:
    """An empty persistent buffer of 8 MiB as journaled, an orphan with the grace period ``orphan``."""
    return JournaledBuffer(
        buffer_id=buffer_id, name=name, persistent=True, shareable=False, owner=0, uid=1000, tenant="uid:1000",
        capacity=8 * MiB, capacities=[8 * MiB], sizes=[0], sealed=False, readers={}, chunks=[], pending=[],
        held=frozenset(), orphan=orphan,
    )


def test_a_restored_orphan_keeps_its_deadline_brought_in_where_the_clock_went_back():
    clock = ManualClock()
    state = new_state(clock=clock)
    now = clock.unix()
    restored = rebuild_buffer(
        state, orphan_record(7, "kv", (60.0, now - 10, now + 50, ("engine-a", 10))), None, None, [], [])
    assert (restored.expires_at, restored.last_holder) == (now + 50, ("engine-a", 10))
    set_back = rebuild_buffer(
        state, orphan_record(8, "kv-2", (60.0, now + 3000, now + 3060, ("engine-a", 10))), None, None, [], [])
    assert set_back.expires_at == now + 60
    state.check_invariants()
    clock.advance(50)
    assert state.orphans.expire() == 1 and list(state.buffers.by_id) == [8]
