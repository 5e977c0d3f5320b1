"""The handle socket's two readers, interleaved every way hypothesis finds: each datagram reaches the reader it is for.

A real ``SOCK_SEQPACKET`` pair stands in for the session: its far end plays
the daemon, sending a request's FD batches (the reply riding with the
first) among the datagrams nobody asked for (reclaim, demote and promote
requests, lease grants with their FDs, revokes, credit, garbage). The
near end is read through one :class:`Inbox` by the caller (its reply, then
its batches, in order) and by the listener (polls and drains), in whatever
order hypothesis picks, a caller asleep on the socket while the listener
files its batch included. Every FD is one end of a pipe, so each is known
by its pipe, and a pipe whose every copy was closed reads EOF: at the end
none may be left open.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
from hbmd import proto
from hbmd.client.inbox import Inbox
from hbmd.proto.errors import DaemonUnavailable
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

pytestmark = pytest.mark.unit

BUFFER = proto.BufferInfo(1, "", False, 1, 0, 8 << 20, 8 << 20, 1, 8 << 20, 0, 0, 0)
UNASKED = ("reclaim", "demote", "promote", "grant", "revoke", "credit", "credit_revoke", "garbage")


class Pipes:
    """Pipes whose write ends travel as chunk FDs: each received FD is known by its pipe's inode."""

    def __init__(self) -> None:
        self.read_ends: list[int] = []

    def make(self, count: int) -> tuple[list[int], list[int]]:
        """``count`` write ends to send (closed by the sender once sent) and their pipes' inodes."""
        writes, inodes = [], []
        for _ in range(count):
            read_end, write_end = os.pipe()
            os.set_blocking(read_end, False)
            self.read_ends.append(read_end)
            writes.append(write_end)
            inodes.append(os.fstat(read_end).st_ino)
        return writes, inodes

    def left_open(self) -> int:
        """Pipes some copy of whose write end is still open somewhere in this process (or in flight)."""
        count = 0
        for read_end in self.read_ends:
            try:
                count += os.read(read_end, 1) != b""
            except BlockingIOError:
                count += 1
        return count

    def close(self) -> None:
        for read_end in self.read_ends:
            os.close(read_end)


class TwoReaders(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.daemon, near = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.inbox = Inbox(near, "the test's socket pair")
        self.pipes = Pipes()
        self.request_id = 1
        self.batches = 0
        """The current request's FD batches, all told (the daemon's reply says so)."""
        self.sent: list[list[int]] = []
        """The inodes of each batch of the current request sent so far."""
        self.taken = 0
        self.reply = proto.Committed(BUFFER, [], 0)
        self.unasked: dict[str, list[object]] = {kind: [] for kind in UNASKED}
        """What was sent unasked, by the queue it belongs in, in order, not yet served."""
        self.grant_inodes: list[list[int]] = []

    def send(self, msg: proto.Message | bytes, fds: list[int] = ()) -> None:
        data = msg if isinstance(msg, bytes) else proto.encode_datagram(msg)
        if fds:
            socket.send_fds(self.daemon, [data], fds)
            for fd in fds:
                os.close(fd)
        else:
            self.daemon.send(data)

    # the daemon

    @precondition(lambda self: self.batches == 0)
    @rule(batches=st.integers(1, 3))
    def a_request_is_answered(self, batches: int) -> None:
        self.batches = batches

    @precondition(lambda self: 0 < self.batches and len(self.sent) < self.batches)
    @rule(chunks=st.integers(0, 3))
    def the_daemon_sends_the_next_batch(self, chunks: int) -> None:
        index = len(self.sent)
        writes, inodes = self.pipes.make(chunks)
        batch = proto.FdBatch(self.request_id, list(range(chunks)), index, self.batches,
                              reply=self.reply if index == 0 else None)
        self.send(batch, writes)
        self.sent.append(inodes)

    @rule(kind=st.sampled_from(UNASKED))
    def the_daemon_sends_something_unasked(self, kind: str) -> None:
        if kind == "grant":
            writes, inodes = self.pipes.make(2)
            msg: proto.Message | bytes = proto.LeaseGrant([7, 8], 2 << 20)
            self.send(msg, writes)
            self.grant_inodes.append(inodes)
            self.unasked["grant"].append(msg)
            return
        msg = {
            "reclaim": proto.ReclaimRequest(len(self.unasked["reclaim"]), 1 << 20, "asked"),
            "demote": proto.ReclaimRequest(len(self.unasked["demote"]), 1 << 20, "pressure", demote=True),
            "promote": proto.PromoteRequest(1 << 20),
            "revoke": proto.LeaseRevoke([len(self.unasked["revoke"])]),
            "credit": proto.CreditGrant(1 << 20),
            "credit_revoke": proto.CreditRevoke(),
            "garbage": b"\x93not a datagram",
        }[kind]
        if kind == "garbage":
            writes, _ = self.pipes.make(1)  # FDs on a datagram nobody reads are closed all the same
            self.send(msg, writes)
            return
        self.send(msg)
        self.unasked[kind].append(msg)

    # the listener

    @rule()
    def the_listener_polls(self) -> None:
        assert self.inbox.poll(0)

    @rule()
    def the_listener_drains(self) -> None:
        self.inbox.drain()

    @rule()
    def the_listener_serves_its_queues(self) -> None:
        inbox = self.inbox
        served: dict[str, list[object]] = {
            "reclaim": list(inbox.reclaims),
            "demote": [m for m in inbox.demotes if isinstance(m, proto.ReclaimRequest)],
            "promote": [m for m in inbox.demotes if isinstance(m, proto.PromoteRequest)],
            "revoke": list(inbox.revokes),
            "credit": [m for m in inbox.credits if isinstance(m, proto.CreditGrant)],
            "credit_revoke": [m for m in inbox.credits if isinstance(m, proto.CreditRevoke)],
            "grant": [grant for grant, _ in inbox.grants],
        }
        for kind, messages in served.items():
            # In the order sent, nothing skipped: what is still in the socket comes later.
            assert messages == self.unasked[kind][:len(messages)], kind
            del self.unasked[kind][:len(messages)]
        for (_, fds), inodes in zip(inbox.grants, self.grant_inodes):
            assert [os.fstat(fd).st_ino for fd in fds] == inodes
            for fd in fds:
                os.close(fd)
        del self.grant_inodes[:len(inbox.grants)]
        for queue in (inbox.reclaims, inbox.demotes, inbox.revokes, inbox.credits, inbox.grants):
            queue.clear()

    # the caller

    @precondition(lambda self: self.batches > 0 and self.taken == 0)
    @rule()
    def the_caller_looks_for_its_reply(self) -> None:
        """Before it takes the first batch: the reply comes with it, wherever it was filed."""
        reply = self.inbox.reply_to(self.request_id)
        assert reply == (self.reply if self.sent else None)

    @precondition(lambda self: self.taken < len(self.sent))
    @rule()
    def the_caller_takes_its_next_batch(self) -> None:
        batch, fds = self.inbox.receive_fds(self.request_id, time.monotonic() + 5)
        self.check_taken(batch, fds)

    @precondition(lambda self: self.taken == len(self.sent) and len(self.sent) < self.batches)
    @rule()
    def the_caller_finds_no_batch_yet(self) -> None:
        with pytest.raises(DaemonUnavailable):
            self.inbox.receive_fds(self.request_id, time.monotonic())

    @precondition(lambda self: self.taken == len(self.sent) and len(self.sent) < self.batches)
    @rule(chunks=st.integers(0, 2), listener_first=st.booleans())
    def the_caller_sleeps_while_the_listener_files_its_batch(self, chunks: int, listener_first: bool) -> None:
        got: list[tuple[proto.FdBatch, list[int]] | BaseException] = []

        def wait() -> None:
            try:
                got.append(self.inbox.receive_fds(self.request_id, time.monotonic() + 5))
            except BaseException as exc:
                got.append(exc)

        caller = threading.Thread(target=wait)
        if not listener_first:
            caller.start()
            time.sleep(0.002)
        self.the_daemon_sends_the_next_batch(chunks)
        self.inbox.poll(0)  # the listener may take it first, or find it gone
        if listener_first:
            caller.start()
        caller.join(5)
        assert not caller.is_alive(), "the caller slept through the batch the listener filed"
        assert not isinstance(got[0], BaseException), got[0]
        self.check_taken(*got[0])

    @precondition(lambda self: self.batches > 0)
    @rule(done=st.booleans())
    def the_caller_moves_on(self, done: bool) -> None:
        """The next request; ``done`` False: this one's batches are given up (a timed-out call) and must be closed."""
        if done:
            while self.taken < len(self.sent):
                self.the_caller_takes_its_next_batch()
        self.request_id += 1
        self.batches, self.sent, self.taken = 0, [], 0

    def check_taken(self, batch: proto.FdBatch, fds: list[int]) -> None:
        assert (batch.request_id, batch.batch) == (self.request_id, self.taken)
        assert batch.reply == (self.reply if self.taken == 0 else None)
        assert [os.fstat(fd).st_ino for fd in fds] == self.sent[self.taken]
        for fd in fds:
            os.close(fd)
        self.taken += 1

    @invariant()
    def the_eventfd_and_socket_stay_open(self) -> None:
        assert self.inbox.filed >= 0 and self.inbox.sock.fileno() >= 0

    def teardown(self) -> None:
        try:
            self.inbox.drain()
            self.the_listener_serves_its_queues()
            assert all(not left for left in self.unasked.values()), self.unasked
            self.inbox.close()
            self.inbox.sock.close()
            self.daemon.close()
            assert self.pipes.left_open() == 0, "an FD that came on the socket was never closed"
        finally:
            self.pipes.close()


TwoReaders.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_the_two_readers_each_get_what_is_theirs = TwoReaders.TestCase
