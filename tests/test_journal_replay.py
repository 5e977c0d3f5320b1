"""Replaying the journal brings back the state it was written from.

A hypothesis state machine drives :class:`State` over the host backend as
sessions would (open, close, create, commit, release, free, defragment and
move both ways with their finish, seal, read-only attach and detach, detach,
attach and delete by name, leases topped up, placed and returned, reclaims
asked and answered, answers kept for a request sent again), journals every
step as the daemon does (a :class:`Persistence` synced after each request,
each chunk parked with an in-process stand-in for systemd's file-descriptor
store), and now and then restarts: a fresh state restored from the journal
and the parked descriptors must hold the same sessions, buffers with their
layouts and chunks, tenants' charges and budget totals, with invariants that
hold. The machine then drives the restored state on, as the restarted
daemon serves, so that later restarts replay a journal a restore began.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hbmd.daemon.backends.host import HostBackend
from hbmd.daemon.restart.persist import Persistence, chunk_name, every_chunk
from hbmd.daemon.state import Answer, Chunk, Session, State
from hbmd.proto.errors import HbmdError, InternalError
from hbmd.proto.runs import new_runs
from helpers import GRANULE
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

pytestmark = pytest.mark.unit

BUDGET = 16 * GRANULE
HOST_BUDGET = 8 * GRANULE
LEASE_BYTES = 4 * GRANULE
TENANTS = ["", "team-a", "team-b"]


class Store:
    """The service manager's file-descriptor store, in process: a duplicate of each descriptor parked, by name, kept
    across restarts until removed."""

    def __init__(self) -> None:
        self.parked: dict[str, list[int]] = {}

    def send_fds(self, fds: list[int], name: str) -> bool:
        self.parked.setdefault(name, []).extend(os.dup(fd) for fd in fds)
        return True

    def remove_fds(self, name: str) -> None:
        for fd in self.parked.pop(name, []):
            os.close(fd)

    def passed(self) -> dict[str, list[int]]:
        """What the restarted service is passed: a descriptor for each one parked."""
        return {name: [os.dup(fd) for fd in fds] for name, fds in self.parked.items()}

    def close(self) -> None:
        for name in list(self.parked):
            self.remove_fds(name)


def chunk_layout(chunks: list[Chunk[Any]]) -> list[tuple[int, int, int, str]]:
    return [(c.chunk_id, c.offset, c.size, c.tier) for c in chunks]


def accounts(state: State[Any, Any]) -> dict[str, Any]:
    """What a restart must bring back: the sessions it keeps (an observer connects anew), every buffer with its
    layout, chunks and readers, each tenant's charges, and the budget's totals."""
    return {
        "sessions": {
            s.session_id: (
                s.pid, s.uid, s.gid, s.client_name, s.tenant.name, s.admin, s.wants_lease, s.wants_credit,
                s.credential_hash, s.previous_credential_hash, sorted(s.lease), s.leased_bytes, s.credit,
                s.demoted_under_pressure, s.answer and (s.answer.request_id, s.answer.frames, s.answer.buffer_id,
                                                        s.answer.chunk_ids),
                sorted(s.buffers), sorted(s.reading),
            )
            for s in state.sessions.by_id.values() if not s.observer
        },
        "buffers": {
            b.buffer_id: (
                b.name, b.persistent, b.shareable, b.owner and b.owner.session_id, b.owner_uid, b.tenant.name,
                b.capacity, b.reserved, list(b.segment_capacities), list(b.segment_sizes), b.sealed, dict(b.readers),
                chunk_layout(b.chunks), chunk_layout(b.pending),
            )
            for b in state.buffers.by_id.values()
        },
        "tenants": {name: (t.used_bytes, t.host_bytes) for name, t in state.tenants.by_name.items()
                    if t.used_bytes or t.host_bytes},
        "totals": (state.tenants.committed_bytes, state.tenants.leased_bytes, state.tenants.host_bytes,
                   state.buffers.reserved_bytes,
                   state.buffers.num_chunks),
    }


class JournalReplay(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = Store()
        self.pids = itertools.count(4242)
        self.uids = itertools.cycle([1000, 1001])
        self.names = itertools.count()
        self.requests = itertools.count(1)
        self.directory = tempfile.TemporaryDirectory(prefix="hbmd-journal-")
        self.journal = Path(self.directory.name) / "host.journal"
        self.state = self.new_state()
        self.persistence = Persistence(self.state, self.store, self.journal)
        self.persistence.start_afresh({})

    def new_state(self) -> State[Any, Any]:
        return State(HostBackend(), BUDGET, lease_bytes=LEASE_BYTES, host_budget_bytes=HOST_BUDGET)

    def teardown(self) -> None:
        self.die()
        self.store.close()
        self.directory.cleanup()

    def die(self) -> None:
        """What the end of the daemon's process lets go of: its journal and its own descriptors of the chunks (the
        store keeps its copies)."""
        self.persistence.close()
        for chunk, _ in every_chunk(self.state):
            os.close(chunk.handle.fd)
        self.state.backend.close()

    # helpers

    def session(self, data: st.DataObject) -> Session:
        return data.draw(st.sampled_from(sorted(self.state.sessions.by_id.values(), key=lambda s: s.session_id)))

    def owned(self, data: st.DataObject):
        owned = sorted((b for b in self.state.buffers.by_id.values() if b.owner is not None), key=lambda b: b.buffer_id)
        return data.draw(st.sampled_from(owned))

    def attempt(self, call, *args) -> Any:
        """One request, refused or not, journaled before its reply as the daemon does."""
        try:
            return call(*args)
        except HbmdError as exc:
            assert not isinstance(exc, InternalError), exc
            return None
        finally:
            self.persistence.sync()

    def has_owned(self) -> bool:
        return any(b.owner is not None for b in self.state.buffers.by_id.values())

    # rules

    @precondition(lambda self: len(self.state.sessions.by_id) < 4)
    @rule(tenant=st.sampled_from(TENANTS), lease=st.booleans(), observer=st.integers(0, 4))
    def open_session(self, tenant, lease, observer):
        session = self.attempt(self.state.open_session, next(self.pids), next(self.uids), 100, "worker", tenant,
                               False, observer == 0, lease)
        if session is not None:
            self.attempt(self.state.sessions.issue_credential, session)  # what its welcome carries

    @precondition(lambda self: self.state.sessions.by_id)
    @rule(data=st.data(), now=st.integers(0, 2))
    def close_session(self, data, now):
        if not now:  # a session lives a while: its buffers and lease have time to grow
            self.attempt(self.state.close_session, self.session(data))

    @precondition(lambda self: self.state.sessions.by_id)
    @rule(data=st.data(), granules=st.integers(1, 8), segments=st.integers(1, 3), persistent=st.booleans(),
          shareable=st.booleans())
    def create_buffer(self, data, granules, segments, persistent, shareable):
        name = f"b{next(self.names)}" if persistent else ""
        session = self.session(data)
        buffer = self.attempt(self.state.buffers.create, session, granules * GRANULE * segments, segments, name,
                              persistent, shareable)
        if buffer is not None:  # an engine grows what it creates
            self.attempt(self.state.commit, session, buffer.buffer_id, data.draw(st.integers(0, granules)) * GRANULE)

    @precondition(has_owned)
    @rule(data=st.data(), fraction=st.floats(0, 1))
    def commit(self, data, fraction):
        buffer = self.owned(data)
        target = buffer.bytes_per_segment + int((buffer.segment_capacity - buffer.bytes_per_segment) * fraction)
        self.attempt(self.state.commit, buffer.owner, buffer.buffer_id, target)

    @precondition(has_owned)
    @rule(data=st.data(), preserve=st.booleans(), finish=st.none() | st.booleans())
    def defragment(self, data, preserve, finish):
        buffer = self.owned(data)
        self.attempt(self.state.buffers.defragment, buffer.owner, buffer.buffer_id, preserve)
        if finish is not None:
            self.attempt(self.state.buffers.finish_defragment, buffer.owner, buffer.buffer_id, finish)

    @precondition(has_owned)
    @rule(data=st.data(), tier=st.sampled_from(["host", "device"]), finish=st.none() | st.booleans())
    def move(self, data, tier, finish):
        # Mostly a buffer with something committed in the other tier.
        movable = sorted((b for b in self.state.buffers.by_id.values() if b.owner and b.chunks and b.tier != tier),
                         key=lambda b: b.buffer_id)
        buffer = data.draw(st.sampled_from(movable)) if movable and data.draw(st.integers(0, 3)) else self.owned(data)
        self.attempt(self.state.move, buffer.owner, buffer.buffer_id, tier)
        if finish is not None:
            self.attempt(self.state.buffers.finish_defragment, buffer.owner, buffer.buffer_id, finish)

    @precondition(has_owned)
    @rule(data=st.data(), call=st.sampled_from(["release", "free", "detach"]))
    def change_buffer(self, data, call):
        buffer = self.owned(data)
        change = {"release": self.state.buffers.release, "free": self.state.free, "detach": self.state.orphans.detach}
        self.attempt(change[call], buffer.owner, buffer.buffer_id)

    @precondition(has_owned)
    @rule(data=st.data())
    def seal(self, data):
        # Mostly a persistent buffer: only those are sealed.
        persistent = sorted((b for b in self.state.buffers.by_id.values() if b.owner and b.persistent),
                            key=lambda b: b.buffer_id)
        buffer = data.draw(st.sampled_from(persistent)) if persistent and data.draw(st.integers(0, 3)) else self.owned(
            data)
        self.attempt(self.state.sealed.seal, buffer.owner, buffer.buffer_id)

    @precondition(lambda self: self.state.sessions.by_id and self.state.buffers.by_id)
    @rule(data=st.data(), call=st.sampled_from(["attach", "delete"]))
    def by_name(self, data, call):
        session = self.session(data)
        buffer = data.draw(st.sampled_from(sorted(self.state.buffers.by_id.values(), key=lambda b: b.buffer_id)))
        by_name = {"attach": self.state.orphans.attach, "delete": self.state.delete}
        self.attempt(by_name[call], session, buffer.name)

    @precondition(lambda self: self.state.sessions.by_id and any(b.sealed for b in self.state.buffers.by_id.values()))
    @rule(data=st.data())
    def attach_reader(self, data):
        # Mostly a session of the sealed buffer's user, so that readers pile up.
        readable = sorted((b.buffer_id, s.session_id) for b in self.state.buffers.by_id.values() if b.sealed
                           for s in self.state.sessions.by_id.values() if s.uid == b.owner_uid)
        if readable and data.draw(st.integers(0, 3)):
            buffer_id, session_id = data.draw(st.sampled_from(readable))
            buffer, session = self.state.buffers.by_id[buffer_id], self.state.sessions.by_id[session_id]
        else:
            buffer = data.draw(st.sampled_from(sorted(self.state.buffers.by_id.values(), key=lambda b: b.buffer_id)))
            session = self.session(data)
        self.attempt(self.state.sealed.attach_reader, session, buffer.name)

    @precondition(lambda self: any(s.reading for s in self.state.sessions.by_id.values()))
    @rule(data=st.data())
    def detach_reader(self, data):
        readers = sorted((s for s in self.state.sessions.by_id.values() if s.reading), key=lambda s: s.session_id)
        session = data.draw(st.sampled_from(readers))
        self.attempt(self.state.sealed.detach_reader, session, data.draw(st.sampled_from(sorted(session.reading))))

    @precondition(lambda self: self.state.sessions.by_id)
    @rule(data=st.data(), granules=st.integers(1, 3))
    def top_up_lease(self, data, granules):
        session = self.session(data)
        self.state.leases.note_demand(session, [Chunk(0, 0, GRANULE, None)] * granules)  # a commit of that many runs
        self.attempt(self.state.leases.top_up, session)

    @precondition(lambda self: any(b.owner and b.owner.lease for b in self.state.buffers.by_id.values()))
    @rule(data=st.data(), granules=st.integers(1, 4))
    def place_leased_granules(self, data, granules):
        """What a client sends after mapping leased granules: each segment grown by as many as its lease covers."""
        leased = sorted((b for b in self.state.buffers.by_id.values() if b.owner and b.owner.lease),
                        key=lambda b: b.buffer_id)
        buffer = data.draw(st.sampled_from(leased))
        session = buffer.owner
        granules = min(granules, len(session.lease) // buffer.num_segments)
        sizes = [min(old + granules * GRANULE, capacity)
                 for old, capacity in zip(buffer.segment_sizes, buffer.segment_capacities, strict=True)]
        runs = new_runs(buffer.segment_offsets, buffer.segment_sizes, sizes, GRANULE)
        offsets = [start for begin, end in runs for start in range(begin, end, GRANULE)]
        self.attempt(self.state.place, session, buffer.buffer_id, sizes, sorted(session.lease)[: len(offsets)],
                     offsets)

    @precondition(lambda self: any(s.lease for s in self.state.sessions.by_id.values()))
    @rule(data=st.data())
    def return_lease(self, data):
        leased = sorted((s for s in self.state.sessions.by_id.values() if s.lease), key=lambda s: s.session_id)
        session = data.draw(st.sampled_from(leased))
        self.attempt(self.state.leases.given_back, session, data.draw(st.lists(st.sampled_from(sorted(session.lease)))))

    @precondition(lambda self: self.state.sessions.by_id)
    @rule(data=st.data(), demote=st.booleans(), released=st.none() | st.integers(0, 4 * GRANULE))
    def reclaim(self, data, demote, released):
        session = self.session(data)
        reclaim = self.attempt(self.state.pressure.request_reclaim, session, GRANULE, "test", demote)
        if reclaim is not None and released is not None:
            self.attempt(self.state.sessions.reclaim_answered, session, reclaim.reclaim_id, released)

    @precondition(lambda self: self.state.sessions.by_id)
    @rule(data=st.data(), chunks=st.booleans())
    def answered(self, data, chunks):
        """The server keeps each session's last answer, so that the request sent again after a restart is answered
        again (one that brought chunks by buffer and chunk ids, rebuilt then)."""
        session = self.session(data)
        buffers = sorted(session.buffers.values(), key=lambda b: b.buffer_id)
        if chunks and buffers:
            buffer = buffers[0]
            answer = Answer(next(self.requests), None, buffer.buffer_id, [c.chunk_id for c in buffer.chunks])
        else:
            answer = Answer(next(self.requests), [b"kind", b"reply %d" % session.session_id])
        self.attempt(setattr, session, "answer", answer)

    @rule()
    def restart(self):
        """The daemon dies and a new one restores what the journal and the store hold."""
        before = accounts(self.state)
        self.die()
        self.state = self.new_state()
        self.persistence = Persistence(self.state, self.store, self.journal)
        sessions, buffers = self.persistence.restore(self.store.passed())
        assert (sessions, buffers) == (len(before["sessions"]), len(before["buffers"]))
        after = accounts(self.state)
        for part, was in before.items():
            assert after[part] == was, part

    # promises

    @invariant()
    def invariants_hold(self):
        self.state.check_invariants()

    @invariant()
    def every_chunk_and_none_other_is_parked(self):
        assert set(self.store.parked) == {chunk_name(chunk.chunk_id) for chunk, _ in every_chunk(self.state)}


JournalReplay.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestJournalReplay = JournalReplay.TestCase
