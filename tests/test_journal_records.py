"""What the journal's writer records and what makes it write again: one list of fields each, so that a field added to
a record is journaled whenever it changes.

A session's record is what its hello fixed and what may change since
(``_since_hello``, compared at every sync); a buffer's is its head (compared
for each buffer that changed) and what a growth record (``b+``) carries. A
field of a record that neither the comparison nor a growth record saw would be
journaled once and then never again, and nothing would fail: these tests fail
instead.
"""

from __future__ import annotations

import pytest
from hbmd.daemon.backends.host import HostBackend
from hbmd.daemon.restart import persist
from hbmd.daemon.restart.journaled import JournaledBuffer, JournaledSession, buffer_of, session_of
from hbmd.daemon.state import Answer, State
from helpers import GRANULE

pytestmark = pytest.mark.unit


@pytest.fixture
def state():
    state = State(HostBackend(), 16 * GRANULE)
    yield state
    for session in list(state.sessions.by_id.values()):
        state.close_session(session)


def test_a_sessions_record_is_what_its_hello_fixed_and_what_is_compared_each_sync(state):
    session = state.open_session(pid=10, uid=1000, gid=1000, client_name="engine", tenant="")
    fixed, changing = persist._at_hello(session), persist._since_hello(session)
    assert not fixed.keys() & changing.keys()
    assert persist.session_record(session) == {**fixed, **changing}
    # Pinned: a field that may change belongs in _since_hello, or it is never journaled again.
    assert set(fixed) == {"id", "pid", "uid", "gid", "name", "admin", "wants_lease", "wants_credit"}


def test_every_field_of_a_buffers_record_outside_its_head_goes_in_every_growth_record(state):
    session = state.open_session(pid=10, uid=1000, gid=1000, client_name="engine", tenant="")
    buffer = state.buffers.create(session, 8 * GRANULE, 2, "kv", persistent=True)
    state.commit(session, buffer.buffer_id, GRANULE)
    head, record = persist._head(buffer), persist.buffer_record(buffer)
    assert record.items() >= head.items()
    assert set(record) - set(head) == set(persist._growth_record(buffer, 0)) - {"id", "since"}


def test_a_change_to_the_head_is_seen_and_a_commit_is_only_growth(state):
    session = state.open_session(pid=10, uid=1000, gid=1000, client_name="engine", tenant="")
    buffer = state.buffers.create(session, 8 * GRANULE, 1, "kv", persistent=True)
    before = persist._shape(buffer)
    state.commit(session, buffer.buffer_id, GRANULE)
    after = persist._shape(buffer)
    assert after[0] == before[0] and persist._only_grew(buffer, before[1], before[2])
    buffer.keep_orphan_s = 60.0  # a field of the head that nothing else in it follows
    assert persist._shape(buffer)[0] != after[0]


def test_each_record_reads_back_as_its_type_with_every_field_it_wrote(state):
    session = state.open_session(pid=10, uid=1000, gid=1000, client_name="engine", tenant="")
    buffer = state.buffers.create(session, 8 * GRANULE, 2, "kv", persistent=True)
    state.commit(session, buffer.buffer_id, GRANULE)
    session.answer = Answer(3, None, buffer.buffer_id, [c.chunk_id for c in buffer.chunks])
    read = session_of(persist.session_record(session), GRANULE, state.tenants.budget_bytes)
    assert read == JournaledSession(
        session_id=session.session_id, pid=10, uid=1000, gid=1000, name="engine", tenant=session.tenant.name,
        admin=session.admin, wants_lease=session.wants_lease, wants_credit=session.wants_credit,
        credential=session.credential_hash, previous_credential="", lease=[], credit=0, demoted=False,
        answer=session.answer, holds=frozenset({buffer.buffer_id}),
    )
    journaled = buffer_of(persist.buffer_record(buffer), GRANULE)
    assert isinstance(journaled, JournaledBuffer)
    assert (journaled.buffer_id, journaled.name, journaled.owner, journaled.capacities, journaled.sizes) == (
        buffer.buffer_id, "kv", session.session_id, [4 * GRANULE] * 2, [GRANULE] * 2)
    assert [(c.chunk_id, c.offset, c.size) for c in journaled.chunks] == [
        (c.chunk_id, c.offset, c.size) for c in buffer.chunks]
