"""The state's invariants hold after any sequence of requests, failed ones included.

A hypothesis state machine drives :class:`State` as sessions would (open,
create, commit, release, defragment both ways, finish, attach, detach, delete,
free, close, seal, read-only attach and its detach, leases topped up, placed,
returned and asked back, buffers declared again by clients after a cold restart,
orphans grafted and freed as their grace periods end) over a backend that fails on
demand in ``create`` and ``export``, and checks :meth:`State.check_invariants` after every step, plus two promises of
its own: a refused request changes nothing, and no chunk the backend made is
leaked or released twice.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hbmd.daemon.config import Config, ConfigError, TenantLimits
from hbmd.daemon.state import Chunk, State
from hbmd.proto.errors import HbmdError, InternalError, OutOfDeviceMemory
from hbmd.proto.runs import backed_runs, new_runs, prefix_offsets
from helpers import ManualClock
from hypothesis import HealthCheck, assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

pytestmark = pytest.mark.unit

GRANULE = 2 << 20
BUDGET = 24 * GRANULE
CONFIGS = [
    Config(),
    Config(tenants=(TenantLimits("team-a", None, None, 8 * GRANULE, 2 * GRANULE),)),
    Config(tenants=(TenantLimits("team-b", None, None, 6 * GRANULE, 4 * GRANULE),
                    TenantLimits("uid:1001", 1001, None, 12 * GRANULE, 0))),
]
"""What SIGHUP may load: tenants gain, change and lose limits while sessions hold memory."""


class FlakyBackend:
    """Chunks are numbers; ``create`` and ``export`` fail when armed. Tracks every live chunk and arena."""

    name = "flaky"
    instance = "test"
    granularity = GRANULE
    host_piece = 4 * GRANULE
    total_bytes = 64 * GRANULE
    device_uuid = ""
    device_index = -1

    def __init__(self) -> None:
        self.fail_create_in: int | None = None
        """Fail the create call after this many more succeed."""
        self.fail_export = False
        self.live: set[int] = set()
        self.arenas: set[int] = set()
        self._ids = itertools.count(1)

    def open_arena(self, reserved_bytes: int, shareable: bool) -> int:
        arena = next(self._ids)
        self.arenas.add(arena)
        return arena

    def create(self, arena: int, offset: int, size: int, tier: str = "device") -> int:
        if self.fail_create_in is not None:
            if self.fail_create_in == 0:
                self.fail_create_in = None
                raise OutOfDeviceMemory("injected create failure")
            self.fail_create_in -= 1
        chunk = next(self._ids)
        self.live.add(chunk)
        return chunk

    def export(self, arena: int, chunk: int) -> int:
        if chunk not in self.live:
            raise AssertionError(f"export of released chunk {chunk}")
        if self.fail_export:
            raise InternalError("injected export failure")
        return -1

    def release(self, arena: int, chunk: int) -> None:
        if chunk not in self.live:
            raise AssertionError(f"chunk {chunk} released twice")
        self.live.remove(chunk)

    def close_arena(self, arena: int) -> None:
        self.arenas.remove(arena)

    def free_bytes(self) -> int:
        return -1

    def held_back_bytes(self) -> int:
        return 0

    def idle(self, host_room: int) -> bool:
        return False

    def host_pool_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


def snapshot(state: State) -> tuple:
    """What a refused request must leave as it was."""
    return (
        state.tenants.committed_bytes,
        {t.name: t.used_bytes for t in state.tenants.by_name.values()},
        {
            b.buffer_id: (list(b.segment_sizes), b.physical_bytes, b.pending_bytes, b.owner and b.owner.session_id,
                          [dataclasses.astuple(c) for c in b.chunks], [dataclasses.astuple(c) for c in b.pending],
                          b.sealed, dict(b.readers))
            for b in state.buffers.by_id.values()
        },
        sorted(state.sessions.by_id),
        state.tenants.leased_bytes,
        state.tenants.host_bytes,
        {t.name: t.host_bytes for t in state.tenants.by_name.values()},
        # Which granules are leased, not which were asked back: a refusal for budget asks, by design.
        {s.session_id: sorted(s.lease) for s in state.sessions.by_id.values()},
    )


class StateMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.backend = FlakyBackend()
        # Leases of up to 4 granules; none granted while a tenant's room is under a 16th of the budget.
        self.clock = ManualClock()
        self.state = State(self.backend, BUDGET, lease_bytes=4 * GRANULE, host_budget_bytes=BUDGET // 2,
                           clock=self.clock)
        self.uids = itertools.cycle([1000, 1001])
        self.names = itertools.count()
        self.frozen: dict[int, tuple[list[int], list[int]]] = {}
        """Sizes and chunk ids of each sealed buffer, as sealed."""

    # helpers

    def session(self, data: st.DataObject):
        return data.draw(st.sampled_from(sorted(self.state.sessions.by_id.values(), key=lambda s: s.session_id)))

    def owned(self, data: st.DataObject):
        owned = [b for b in self.state.buffers.by_id.values() if b.owner is not None]
        return data.draw(st.sampled_from(sorted(owned, key=lambda b: b.buffer_id)))

    def attempt(self, call, *args) -> None:
        """Run one request; a refusal must change nothing (a discarding defragment has dropped its old pages first, by
        design)."""
        before = snapshot(self.state)
        try:
            call(*args)
        except HbmdError as exc:
            assert not isinstance(exc, InternalError), exc
            if not (call == self.state.buffers.defragment and not args[2]):
                assert snapshot(self.state) == before, (
                    f"{call.__name__}{args[1:]} refused ({exc}) but changed the state"
                )

    # rules

    @rule(tenant=st.sampled_from(["", "team-a", "team-b"]), lease=st.booleans())
    def open_session(self, tenant, lease):
        # A uid held to its own tenant by the config in force may be refused a declared one.
        self.attempt(self.state.open_session, 4242, next(self.uids), 100, "worker", tenant, False, False, lease)

    @precondition(lambda self: self.state.sessions.by_id)
    @rule(data=st.data())
    def close_session(self, data):
        self.state.close_session(self.session(data))

    @precondition(lambda self: self.state.sessions.by_id)
    @rule(data=st.data(), granules=st.integers(1, 12), segments=st.integers(1, 3), extra=st.integers(0, GRANULE - 1),
          persistent=st.booleans(), keep_s=st.sampled_from([0.0, 0.0, 1.0, 5.0]))
    def create_buffer(self, data, granules, segments, extra, persistent, keep_s):
        capacity = (granules * GRANULE + extra) // segments * segments
        name = f"b{next(self.names)}" if persistent else ""
        self.attempt(self.state.buffers.create, self.session(data), capacity, segments, name, persistent, False, None,
                     keep_s)

    @precondition(lambda self: self.state.sessions.by_id)
    @rule(data=st.data(), capacities=st.lists(st.integers(1, 5 * GRANULE), min_size=1, max_size=4))
    def create_uneven_buffer(self, data, capacities):
        self.attempt(self.state.buffers.create, self.session(data), sum(capacities), 1, "", False, False, capacities)

    @precondition(lambda self: any(b.owner for b in self.state.buffers.by_id.values()))
    @rule(data=st.data(), fraction=st.floats(0, 1), fail_after=st.none() | st.integers(0, 2))
    def commit(self, data, fraction, fail_after):
        buffer = self.owned(data)
        target = buffer.bytes_per_segment + int((buffer.segment_capacity - buffer.bytes_per_segment) * fraction)
        self.backend.fail_create_in = fail_after
        self.attempt(self.state.commit, buffer.owner, buffer.buffer_id, target)
        self.backend.fail_create_in = None

    @precondition(lambda self: any(b.owner for b in self.state.buffers.by_id.values()))
    @rule(data=st.data(), bytes_per_segment=st.integers(-1, 64 * GRANULE))
    def commit_anything(self, data, bytes_per_segment):
        buffer = self.owned(data)
        self.attempt(self.state.commit, buffer.owner, buffer.buffer_id, bytes_per_segment)

    @precondition(lambda self: any(b.owner for b in self.state.buffers.by_id.values()))
    @rule(data=st.data(), fail_after=st.none() | st.integers(0, 2))
    def commit_each_segment(self, data, fail_after):
        buffer = self.owned(data)
        sizes = [data.draw(st.integers(old - 1, capacity + 1)) for old, capacity in
                 zip(buffer.segment_sizes, buffer.segment_capacities)]
        self.backend.fail_create_in = fail_after
        self.attempt(self.state.commit, buffer.owner, buffer.buffer_id, sizes)
        self.backend.fail_create_in = None

    @precondition(lambda self: any(b.owner for b in self.state.buffers.by_id.values()))
    @rule(data=st.data(), preserve=st.booleans(), fail_after=st.none() | st.integers(0, 2))
    def defragment(self, data, preserve, fail_after):
        buffer = self.owned(data)
        self.backend.fail_create_in = fail_after
        self.attempt(self.state.buffers.defragment, buffer.owner, buffer.buffer_id, preserve)
        self.backend.fail_create_in = None

    @precondition(lambda self: any(b.owner for b in self.state.buffers.by_id.values()))
    @rule(data=st.data(), keep_new=st.booleans())
    def finish_defragment(self, data, keep_new):
        buffer = self.owned(data)
        self.attempt(self.state.buffers.finish_defragment, buffer.owner, buffer.buffer_id, keep_new)

    @precondition(lambda self: any(b.owner for b in self.state.buffers.by_id.values()))
    @rule(data=st.data(), tier=st.sampled_from(["host", "device", "tape"]), fail_after=st.none() | st.integers(0, 2),
          finish=st.none() | st.booleans())
    def move(self, data, tier, fail_after, finish):
        # Mostly a buffer with something committed in the other tier, and its client mostly done with the copy at once.
        committed = sorted((b for b in self.state.buffers.by_id.values() if b.owner and b.chunks and b.tier != tier),
                           key=lambda b: b.buffer_id)
        buffer = (data.draw(st.sampled_from(committed)) if committed and data.draw(st.integers(0, 3))
                  else self.owned(data))
        self.backend.fail_create_in = fail_after
        self.attempt(self.state.move, buffer.owner, buffer.buffer_id, tier)
        self.backend.fail_create_in = None
        if finish is not None:
            self.attempt(self.state.buffers.finish_defragment, buffer.owner, buffer.buffer_id, finish)

    @precondition(lambda self: any(b.owner for b in self.state.buffers.by_id.values()))
    @rule(data=st.data())
    def release(self, data):
        buffer = self.owned(data)
        self.attempt(self.state.buffers.release, buffer.owner, buffer.buffer_id)

    @precondition(lambda self: any(b.owner for b in self.state.buffers.by_id.values()))
    @rule(data=st.data())
    def free(self, data):
        buffer = self.owned(data)
        self.attempt(self.state.free, buffer.owner, buffer.buffer_id)

    @precondition(lambda self: any(b.owner for b in self.state.buffers.by_id.values()))
    @rule(data=st.data(), by_owner=st.booleans())
    def detach(self, data, by_owner):
        buffer = self.owned(data)
        session = buffer.owner if by_owner else self.session(data)
        self.attempt(self.state.orphans.detach, session, buffer.buffer_id)

    @precondition(lambda self: self.state.sessions.by_id and self.state.buffers.by_id)
    @rule(data=st.data())
    def attach_or_delete_by_name(self, data):
        session = self.session(data)
        buffer = data.draw(st.sampled_from(sorted(self.state.buffers.by_id.values(), key=lambda b: b.buffer_id)))
        call = data.draw(st.sampled_from([self.state.orphans.attach, self.state.delete]))
        self.attempt(call, session, buffer.name)

    @precondition(lambda self: self.state.sessions.by_id and self.state.buffers.by_id)
    @rule(data=st.data(), successor=st.integers(0, 3))
    def graft(self, data, successor):
        """Mostly what a restarted engine does: a buffer of an orphan's layout made by a session of its user, then the
        orphan grafted into it; at times any buffer and name, to be refused."""
        orphans = [(b, s) for b in self.state.buffers.by_id.values() if b.owner is None
                   for s in self.state.sessions.by_id.values() if s.uid == b.owner_uid]
        if orphans and successor:
            orphan, session = data.draw(st.sampled_from(sorted(orphans, key=lambda p: (p[0].buffer_id,
                                                                                        p[1].session_id))))
            # As often a reservation a granule longer or shorter per segment (a restarted vLLM's, its profiled
            # memory moved): each chunk moves with its segment, or the graft is refused whole.
            grown = data.draw(st.sampled_from([0, 0, 1, -1])) * self.state.backend.granularity
            capacities = [max(capacity + grown, 1) for capacity in orphan.segment_capacities]
            self.attempt(self.state.buffers.create, session, sum(capacities), 1, "", False, orphan.shareable,
                         capacities)
            target = max(session.buffers.values(), key=lambda b: b.buffer_id, default=None)
        else:
            target = self.owned(data) if any(b.owner for b in self.state.buffers.by_id.values()) else None
            orphan = data.draw(st.sampled_from(sorted(self.state.buffers.by_id.values(), key=lambda b: b.buffer_id)))
        if target is not None and target.owner is not None:
            self.attempt(self.state.graft, target.owner, target.buffer_id, orphan.name)

    @rule(seconds=st.sampled_from([0.5, 1.0, 5.0]))
    def time_passes(self, seconds):
        self.clock.advance(seconds)
        self.state.orphans.expire()

    @precondition(lambda self: any(b.owner for b in self.state.buffers.by_id.values()))
    @rule(data=st.data(), by_owner=st.booleans())
    def seal(self, data, by_owner):
        buffer = self.owned(data)
        session = buffer.owner if by_owner else self.session(data)
        self.attempt(self.state.sealed.seal, session, buffer.buffer_id)

    @precondition(lambda self: self.state.sessions.by_id and self.state.buffers.by_id)
    @rule(data=st.data())
    def attach_read_only(self, data):
        # Mostly a sealed buffer and a session of its user, so that readers pile up; sometimes any pair, to be refused.
        readable = [(b, s) for b in self.state.buffers.by_id.values() if b.sealed
                    for s in self.state.sessions.by_id.values() if s.uid == b.owner_uid]
        if readable and data.draw(st.integers(0, 3)):
            ordered = sorted(readable, key=lambda p: (p[0].buffer_id, p[1].session_id))
            buffer, session = data.draw(st.sampled_from(ordered))
        else:
            session = self.session(data)
            buffer = data.draw(st.sampled_from(sorted(self.state.buffers.by_id.values(), key=lambda b: b.buffer_id)))
        self.attempt(self.state.sealed.attach_reader, session, buffer.name)

    @precondition(lambda self: self.state.sessions.by_id and self.state.buffers.by_id)
    @rule(data=st.data())
    def detach_read_only(self, data):
        session = self.session(data)
        buffer = data.draw(st.sampled_from(sorted(self.state.buffers.by_id.values(), key=lambda b: b.buffer_id)))
        self.attempt(self.state.sealed.detach_reader, session, buffer.buffer_id)

    @precondition(lambda self: self.state.sessions.by_id)
    @rule(data=st.data(), granules=st.integers(1, 3), fail_after=st.none() | st.integers(0, 2))
    def top_up_lease(self, data, granules, fail_after):
        session = self.session(data)
        # A commit of that many granule runs.
        self.state.leases.note_demand(session, [Chunk(0, 0, GRANULE, 0)] * granules)
        self.backend.fail_create_in = fail_after
        self.state.leases.top_up(session)
        self.backend.fail_create_in = None

    @precondition(lambda self: any(b.owner for b in self.state.buffers.by_id.values()))
    @rule(data=st.data(), fraction=st.floats(0, 1), honest=st.integers(0, 3))
    def place_leased_granules(self, data, fraction, honest):
        """What a client sends after mapping leased granules: mostly the right ones, sometimes anything."""
        buffer = self.owned(data)
        session = buffer.owner
        sizes = [old + int((capacity - old) * fraction)
                 for old, capacity in zip(buffer.segment_sizes, buffer.segment_capacities)]
        runs = new_runs(buffer.segment_offsets, buffer.segment_sizes, sizes, GRANULE)
        offsets = [start for begin, end in runs for start in range(begin, end, GRANULE)]
        chunk_ids = sorted(session.lease)[: len(offsets)]
        if not honest:
            offsets = data.draw(st.lists(st.integers(-1, 16).map(lambda g: g * GRANULE), max_size=4))
            chunk_ids = data.draw(st.lists(st.integers(0, 200), min_size=len(offsets), max_size=len(offsets)))
            sizes = data.draw(st.lists(st.integers(-1, 8 * GRANULE),
                                       min_size=buffer.num_segments, max_size=buffer.num_segments))
        self.attempt(self.state.place, session, buffer.buffer_id, sizes, chunk_ids, offsets)

    @precondition(lambda self: any(s.lease for s in self.state.sessions.by_id.values()))
    @rule(data=st.data())
    def return_lease(self, data):
        leased = sorted((s for s in self.state.sessions.by_id.values() if s.lease), key=lambda s: s.session_id)
        session = data.draw(st.sampled_from(leased))
        returned = data.draw(st.lists(st.sampled_from([*sorted(session.lease), 0, 10**9]), max_size=4))
        self.state.leases.given_back(session, returned)

    @precondition(lambda self: self.state.sessions.by_id)
    @rule(data=st.data())
    def ask_back_lease(self, data):
        self.state.leases.ask_back(self.session(data))

    @precondition(lambda self: self.state.sessions.by_id)
    @rule(data=st.data(), capacities=st.lists(st.integers(1, 4 * GRANULE), min_size=1, max_size=3),
          fraction=st.floats(0, 1), split=st.booleans(), kind=st.sampled_from(["anonymous", "persistent", "reader"]),
          honest=st.integers(0, 3))
    def redeclare(self, data, capacities, fraction, split, kind, honest):
        """What a client maps after a cold restart, declared again: mostly a true layout, at times a name
        declared already (a reader joining, or a conflict), at times chunks that do not tile it."""
        session = self.session(data)
        sizes = [int(c * fraction) for c in capacities]
        runs = backed_runs(prefix_offsets(capacities), sizes, GRANULE)
        chunks = [(start, GRANULE) for begin, end in runs for start in range(begin, end, GRANULE)] if split else [
            (start, end - start) for start, end in runs]
        if not honest:
            chunks = [*chunks[1:], (sum(capacities) // GRANULE * GRANULE, GRANULE)]
        named = sorted(b.name for b in self.state.buffers.by_id.values() if b.persistent and b.owner_uid == session.uid)
        name = "" if kind == "anonymous" else data.draw(st.sampled_from([*named, f"b{next(self.names)}"]))
        previous = data.draw(st.sampled_from([0, *sorted(self.state.buffers.by_id)[:3], 10_000]))
        self.attempt(self.state.redeclare, session, previous, capacities, sizes, chunks, name,
                     kind != "anonymous", False,
                     kind == "reader" or (data.draw(st.booleans()) and kind == "persistent"), kind == "reader")

    @invariant()
    def a_sealed_buffer_stays_as_sealed(self):
        # Immutable: its chunks and committed sizes are what they were when it was sealed, until it is dropped.
        for buffer_id, frozen in list(self.frozen.items()):
            buffer = self.state.buffers.by_id.get(buffer_id)
            if buffer is None:
                del self.frozen[buffer_id]
            else:
                assert (list(buffer.segment_sizes), [c.chunk_id for c in buffer.chunks]) == frozen
        for buffer in self.state.buffers.by_id.values():
            if buffer.sealed:
                self.frozen.setdefault(
                    buffer.buffer_id, (list(buffer.segment_sizes), [c.chunk_id for c in buffer.chunks])
                )

    @rule(config=st.sampled_from(CONFIGS))
    def reconfigure(self, config):
        before = snapshot(self.state)
        try:
            self.state.reconfigure(config)
        except ConfigError:
            assert snapshot(self.state) == before

    @precondition(lambda self: any(b.chunks for b in self.state.buffers.by_id.values()))
    @rule(data=st.data(), fail=st.booleans())
    def export(self, data, fail):
        buffer = data.draw(st.sampled_from([b for b in self.state.buffers.by_id.values() if b.chunks]))
        chunk = data.draw(st.sampled_from(buffer.chunks))
        assume(chunk.handle is not None)  # one declared again is never handed out (``check_handed_out``)
        self.backend.fail_export = fail
        try:
            self.state.buffers.export(buffer, chunk)
        except InternalError:
            assert fail
        finally:
            self.backend.fail_export = False

    # promises

    @invariant()
    def invariants_hold(self):
        self.state.check_invariants()

    @invariant()
    def every_chunk_the_backend_holds_is_in_the_state(self):
        held = {c.handle for b in self.state.buffers.by_id.values() for c in (*b.chunks, *b.pending)} - {None}
        held |= {c.handle for s in self.state.sessions.by_id.values() for c in s.lease.values()}
        assert held == self.backend.live
        lease_arena = {self.state.leases.arena} - {None}
        assert {b.arena for b in self.state.buffers.by_id.values()} | lease_arena == self.backend.arenas

    @invariant()
    def the_budget_holds(self):
        # Memory declared again exists already: leases made before it give way (asked back), never buffers.
        declared = any(b.held_elsewhere for b in self.state.buffers.by_id.values())
        assert self.state.tenants.committed_bytes + (0 if declared else self.state.tenants.leased_bytes) <= BUDGET


StateMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestStateMachine = StateMachine.TestCase


def test_check_invariants_notices_counts_that_do_not_add_up():
    state = State(FlakyBackend(), BUDGET)
    session = state.open_session(1, 1000, 100, "w", "")
    buffer = state.buffers.create(session, 8 * GRANULE, 2)
    state.commit(session, buffer.buffer_id, GRANULE)
    state.check_invariants()
    buffer.tenant.used_bytes += 1
    with pytest.raises(AssertionError, match="used by tenants"):
        state.check_invariants()
    buffer.tenant.used_bytes -= 1
    buffer.chunks.append(dataclasses.replace(buffer.chunks[0], chunk_id=999))
    with pytest.raises(AssertionError):
        state.check_invariants()
