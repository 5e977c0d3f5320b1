"""Orphans in the state machine: grafts between users and tenants."""

from __future__ import annotations

import pytest
from hbmd.daemon.backends.host import HostBackend
from hbmd.daemon.config import parse_config
from hbmd.daemon.state import State
from hbmd.proto.errors import NotFound, OutOfBudget
from helpers import MiB

pytestmark = pytest.mark.unit

BUDGET = 64 * MiB


def new_state(config: str = "") -> State:
    return State(HostBackend(), BUDGET, parse_config(config, total_bytes=1 << 40, budget_bytes=BUDGET),
                 lease_bytes=0)


def orphan(state: State, name: str = "kv", uid: int = 1000, tenant: str = "", committed: int = 4 * MiB):
    """A persistent buffer of two segments, ``committed`` bytes in each, left by its session."""
    session = state.open_session(pid=10, uid=uid, gid=uid, client_name="engine-a", tenant=tenant)
    buffer = state.create_buffer(session, 32 * MiB, 2, name=name, persistent=True)
    state.commit(session, buffer.buffer_id, committed)
    state.close_session(session)
    return buffer


def test_a_graft_moves_the_chunks_and_the_charge_and_drops_the_orphans_record():
    state = new_state()
    donor = orphan(state, tenant="old")
    chunks = [(c.chunk_id, c.offset, c.size) for c in donor.chunks]
    session = state.open_session(pid=11, uid=1000, gid=1000, client_name="engine-b", tenant="new")
    target = state.create_buffer(session, 32 * MiB, 2, name="kv-b", persistent=True)

    assert state.graft(session, target.buffer_id, "kv") is target
    assert [(c.chunk_id, c.offset, c.size) for c in target.chunks] == chunks
    assert target.segment_sizes == [4 * MiB, 4 * MiB] and target.physical_bytes == 8 * MiB
    assert list(state.buffers) == [target.buffer_id] and (1000, "kv") not in state.persistent
    assert state.committed_bytes == 8 * MiB and state.num_chunks == 2
    assert {name: t.used_bytes for name, t in state.tenants.items()} == {"new": 8 * MiB}  # "old" held nothing more
    state.check_invariants()


def test_another_users_orphan_is_not_found_and_nothing_changes():
    state = new_state()
    orphan(state, uid=2000)
    session = state.open_session(pid=11, uid=1000, gid=1000, client_name="b", tenant="")
    target = state.create_buffer(session, 32 * MiB, 2)
    with pytest.raises(NotFound, match="no persistent buffer named 'kv' for uid 1000"):
        state.graft(session, target.buffer_id, "kv")
    assert target.chunks == [] and state.persistent[(2000, "kv")].physical_bytes == 8 * MiB
    state.check_invariants()


def test_a_graft_that_would_take_a_guaranteed_tenants_room_is_refused():
    # "keep" is guaranteed 48 MiB and holds 16 MiB of it in its orphan. Given to "other", the budget would owe "keep"
    # all 48 MiB beside the 24 MiB committed: more than its 64 MiB.
    state = new_state('[[tenants]]\nname = "keep"\nguaranteed = "48MiB"\n')
    orphan(state, tenant="keep", committed=8 * MiB)
    session = state.open_session(pid=11, uid=1000, gid=1000, client_name="b", tenant="other")
    full = state.create_buffer(session, 48 * MiB, 1)
    state.commit(session, full.buffer_id, 8 * MiB)
    target = state.create_buffer(session, 32 * MiB, 2)
    with pytest.raises(OutOfBudget, match="no room for tenant 'keep''s guaranteed minimum"):
        state.graft(session, target.buffer_id, "kv")
    assert target.chunks == [] and state.tenants["keep"].used_bytes == 16 * MiB
    state.check_invariants()
    keeper = state.open_session(pid=12, uid=1000, gid=1000, client_name="c", tenant="keep")
    own = state.create_buffer(keeper, 32 * MiB, 2)
    state.graft(keeper, own.buffer_id, "kv")  # within its own tenant the charge does not move
    state.check_invariants()
