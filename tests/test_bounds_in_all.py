"""The state's bounds per uid (sessions, buffers, segments) have bounds in all beside them, shared fairly between the
uids (issue #65): each uid's bound alone let the daemon's worst case grow with the number of uids in its group. Past
its floor a uid takes at most the bound in all split among the uids holding some and one more; its floor it may
always take. A refusal changes nothing."""

from __future__ import annotations

import pytest
from hbmd.daemon.backends.host import HostBackend
from hbmd.daemon.state import State
from hbmd.daemon.state.records import Limits
from hbmd.proto.errors import Conflict, OutOfBudget
from helpers import MiB

pytestmark = pytest.mark.unit


def new_state(limits: Limits) -> State:
    return State(HostBackend(), 64 * MiB, limits=limits, lease_bytes=0)


def open_sessions(state: State, uid: int, count: int) -> list:
    return [state.open_session(pid=uid * 100 + n, uid=uid, gid=uid, client_name="", tenant="") for n in range(count)]


def test_sessions_of_several_uids_share_a_bound_in_all_and_each_uid_keeps_its_floor():
    state = new_state(Limits(sessions_per_uid=6, sessions=8, sessions_floor=2))
    open_sessions(state, 1000, 4)  # alone, a uid takes half the bound in all
    with pytest.raises(Conflict, match=r"uid 1000 already has 4 sessions, its share now of the 8 all uids may have"):
        open_sessions(state, 1000, 1)
    open_sessions(state, 1001, 2)
    with pytest.raises(Conflict, match="uid 1001 already has 2 sessions") as refused:
        open_sessions(state, 1001, 1)
    assert refused.value.retryable
    open_sessions(state, 1002, 2)  # the bound in all is reached: a newcomer still has its floor
    open_sessions(state, 1003, 2)
    with pytest.raises(Conflict):
        open_sessions(state, 1003, 1)
    assert len(state.sessions.by_id) == 10
    state.check_invariants()


def test_buffers_and_segments_of_several_uids_share_their_bounds_in_all():
    state = new_state(Limits(buffers_per_uid=8, buffers=8, buffers_floor=1, segments_per_uid=64, segments=64,
                             segments_floor=8))
    first, second = (open_sessions(state, uid, 1)[0] for uid in (1000, 1001))
    for _ in range(2):
        state.buffers.create(first, 16 * MiB, 16)  # 32 segments: its share, half the bound in all
    with pytest.raises(OutOfBudget, match="uid 1000 already holds 2 buffers of 32 segments, its share now"):
        state.buffers.create(first, 4 * MiB, 1)
    buffers = len(state.buffers.by_id)
    with pytest.raises(OutOfBudget, match="uid 1001 already holds 0 buffers of 0 segments"):
        state.buffers.create(second, 32 * MiB, 32)  # past its floor and its share (64 // 3 = 21 segments)
    assert len(state.buffers.by_id) == buffers and state.buffers.num_segments == 32
    state.buffers.create(second, 16 * MiB, 16)
    state.check_invariants()
