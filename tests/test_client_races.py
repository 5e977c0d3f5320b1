"""The client's two threads, the listener and the one that commits, never lose what the daemon sent or asked.

A granule asked back is returned whatever it was doing when the revoke came (being imported, taken for a
placement), a reclaim request filed while the engine reads the pending ones is not dropped, and a thread
waiting for its chunk FDs does not hold up the other thread's datagrams.
"""

from __future__ import annotations

import collections
import contextlib
import os
import select
import threading
import time
import types

import pytest
from hbmd import proto
from hbmd.client import inbox as inbox_module
from hbmd.client import lease as lease_module
from hbmd.client.lease import Lease
from hbmd.proto.errors import SessionLost
from helpers import GRANULE

CHUNK = 7


class ImportingMapper:
    """A mapper double whose imports wait for ``go`` once ``importing`` is set: the window a revoke may fall in."""

    def __init__(self) -> None:
        self.importing = threading.Event()
        self.go = threading.Event()
        self.go.set()
        self.discarded: list[int] = []

    def prepare(self, fd: int) -> int:
        self.importing.set()
        assert self.go.wait(10)
        return os.dup(fd)

    def discard(self, prepared: int) -> None:
        self.discarded.append(prepared)
        os.close(prepared)

    def beside_capture(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def lease_with(mapper: ImportingMapper) -> tuple[Lease, list[proto.Message]]:
    sent: list[proto.Message] = []
    return Lease(GRANULE, lambda: mapper, sent.append), sent


def grant(lease: Lease, chunk_id: int) -> None:
    read_end, write_end = os.pipe()
    os.close(write_end)
    lease.granted(proto.LeaseGrant([chunk_id], GRANULE), [read_end])


def returned(sent: list[proto.Message]) -> list[int]:
    return [c for msg in sent if isinstance(msg, proto.LeaseReturn) for c in msg.chunk_ids]


@pytest.mark.unit
def test_a_granule_asked_back_while_it_is_imported_goes_back() -> None:
    mapper = ImportingMapper()
    mapper.go.clear()
    lease, sent = lease_with(mapper)
    listener = threading.Thread(target=grant, args=(lease, CHUNK))
    listener.start()
    assert mapper.importing.wait(10)
    lease.revoked(proto.LeaseRevoke([CHUNK]))  # the committing thread serves the revoke meanwhile
    mapper.go.set()
    listener.join(10)
    assert returned(sent) == [CHUNK], "the daemon would keep the granule revoking, and lease this session no more"
    assert len(lease) == 0 and lease.take(1) is None
    assert len(mapper.discarded) == 1


@pytest.mark.unit
def test_a_granule_asked_back_while_a_commit_holds_it_goes_back_when_put_back() -> None:
    mapper = ImportingMapper()
    lease, sent = lease_with(mapper)
    grant(lease, CHUNK)
    taken = lease.take(1)
    lease.revoked(proto.LeaseRevoke([CHUNK]))
    assert returned(sent) == []  # in the commit's hands: it may still be placed
    lease.put_back(taken)  # the placement could not be sent
    assert returned(sent) == [CHUNK]
    assert len(lease) == 0 and len(mapper.discarded) == 1


@pytest.mark.unit
def test_a_granule_asked_back_and_then_placed_stays_placed() -> None:
    mapper = ImportingMapper()
    lease, sent = lease_with(mapper)
    grant(lease, CHUNK)
    taken = lease.take(1)
    lease.revoked(proto.LeaseRevoke([CHUNK]))
    lease.placed(taken)  # the daemon reads the placement and forgets the revoke
    grant(lease, CHUNK + 1)
    assert returned(sent) == [] and len(lease) == 1
    for granule in taken:
        mapper.discard(granule.prepared)


@pytest.mark.unit
def test_a_commit_short_of_granules_waits_for_the_one_being_imported(monkeypatch) -> None:
    monkeypatch.setattr(lease_module, "IMPORT_WAIT_S", 10.0)
    mapper = ImportingMapper()
    mapper.go.clear()
    lease, sent = lease_with(mapper)
    listener = threading.Thread(target=grant, args=(lease, CHUNK))
    listener.start()
    assert mapper.importing.wait(10)
    threading.Timer(0.05, mapper.go.set).start()
    taken = lease.take(1)  # without the wait: None, and the commit would go to the daemon
    listener.join(10)
    assert taken is not None and [g.chunk_id for g in taken] == [CHUNK] and returned(sent) == []
    lease.placed(taken)
    mapper.discard(taken[0].prepared)


@pytest.mark.unit
def test_a_granule_asked_back_before_its_grant_is_read_goes_back_on_arrival() -> None:
    mapper = ImportingMapper()
    lease, sent = lease_with(mapper)
    lease.revoked(proto.LeaseRevoke([CHUNK]))
    grant(lease, CHUNK)
    assert returned(sent) == [CHUNK] and len(lease) == 0 and mapper.discarded == []


class ListenerFilesDuringTheRead(collections.deque):
    """Reclaim requests where the listener thread files one more right after the engine's thread starts reading."""

    def __init__(self, first: proto.ReclaimRequest, late: proto.ReclaimRequest) -> None:
        super().__init__([first])
        self._late: proto.ReclaimRequest | None = late

    def _listener_files(self) -> None:
        if self._late is not None:
            self.append(self._late)
            self._late = None

    def __iter__(self):
        items = list(super().__iter__())
        self._listener_files()
        return iter(items)

    def popleft(self):
        item = super().popleft()
        self._listener_files()
        return item


@pytest.mark.ipc
def test_a_reclaim_request_filed_while_the_pending_ones_are_read_is_not_lost(client) -> None:
    first, late = proto.ReclaimRequest(1, GRANULE, "first"), proto.ReclaimRequest(2, GRANULE, "late")
    client._core.handles.inbox.reclaims = ListenerFilesDuringTheRead(first, late)
    pending = client.pending_reclaims() + client.pending_reclaims()
    assert pending == [first, late]


@pytest.mark.ipc
def test_a_thread_waiting_for_chunk_fds_does_not_hold_up_the_other_threads_sends(daemon, monkeypatch) -> None:
    client = daemon.connect(lease=False)  # nothing comes on the socket unasked
    handles = client._core.handles
    waited: list[BaseException] = []
    waiting = threading.Event()

    def select_telling_it_waits(*args):
        if threading.current_thread() is receiver:
            waiting.set()
        return select.select(*args)

    monkeypatch.setattr(inbox_module, "select", types.SimpleNamespace(select=select_telling_it_waits))

    def wait_for_a_batch_that_never_comes() -> None:
        try:
            handles.inbox.receive_fds(10**6, time.monotonic() + 5)
        except BaseException as exc:
            waited.append(exc)

    receiver = threading.Thread(target=wait_for_a_batch_that_never_comes)
    receiver.start()
    assert waiting.wait(10)  # the receiver let go of the socket's lock and waits for the batch
    started = time.monotonic()
    handles.send(proto.LeaseReturn([10**9]))  # what the listener sends for a revoke; the daemon ignores this id
    sent_after = time.monotonic() - started
    handles.shut()  # wakes the receiver: the session is over
    receiver.join(10)
    client.close()
    assert sent_after < 1, f"the send waited {sent_after:.1f}s for the receiver's lock"
    assert len(waited) == 1 and isinstance(waited[0], SessionLost)


@pytest.mark.unit
def test_a_lease_larger_than_a_message_carries_goes_back_in_several() -> None:
    """A daemon decodes no list longer than a buffer's segments: every granule of a larger lease still goes back."""
    lease, sent = lease_with(ImportingMapper())
    recorded = set(range(1, 2 * proto.MAX_SEGMENTS + 2))
    lease.resumed(recorded)  # the restarted daemon records granules this process never imported: all go back
    assert set(returned(sent)) == recorded
    for msg in sent:
        assert proto.decode_datagram(proto.encode_datagram(msg), proto.MAX_SEGMENTS) == msg
