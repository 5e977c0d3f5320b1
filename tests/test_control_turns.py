"""Control requests take turns by peer, not by connection: uids in turn, and within a uid its processes; a process
with too many requests waiting has the next refused, retryably, with one warning in the log.

The timing promise under a flood of 64 connections is in test_flood.py.
"""

from __future__ import annotations

import os

import pytest
import zmq
from hbmd import proto
from hbmd.daemon.server.control import MAX_QUEUED_PER_PEER, ControlQueue, Peer, leading_request_id


def queue_of(*requests: tuple[Peer, bytes]) -> ControlQueue:
    queue = ControlQueue()
    for peer, name in requests:
        queue.add(peer, b"connection", [name])
    return queue


def order(queue: ControlQueue) -> list[bytes]:
    taken = []
    while queue:
        _, (name,) = queue.take()
        taken.append(name)
    return taken


@pytest.mark.unit
def test_the_processes_of_one_uid_share_its_turn_among_other_uids():
    flooder, forked, engine = Peer(1000, 10), Peer(1000, 11), Peer(0, 20)
    queue = queue_of(*[(flooder, b"flood")] * 4, *[(forked, b"fork")] * 2, (engine, b"status"), (engine, b"commit"))
    assert (len(queue), queue.peers) == (8, 3)
    assert order(queue) == [b"status", b"fork", b"commit", b"flood", b"fork", b"flood", b"flood", b"flood"]
    assert queue.peers == 0


@pytest.mark.unit
def test_a_peer_with_nothing_waiting_takes_the_next_turn_and_a_flood_never_does():
    flooder, engine, operator = Peer(0, 10), Peer(0, 20), Peer(1000, 30)
    queue = queue_of(*[(flooder, b"flood")] * 3)
    queue.take()
    queue.add(engine, b"connection", [b"status"])
    assert order(queue) == [b"status", b"flood", b"flood"]
    queue = queue_of(*[(flooder, b"flood")] * 3, (engine, b"status"))
    queue.add(operator, b"connection", [b"hbmctl"])
    queue.add(flooder, b"connection", [b"flood"])  # behind its others: it has some waiting
    assert order(queue) == [b"hbmctl", b"status", b"flood", b"flood", b"flood", b"flood"]


@pytest.mark.unit
def test_a_queue_counts_each_peers_requests_and_forgets_them_all_at_once():
    engine = Peer(0, 20)
    queue = queue_of((engine, b"a"), (engine, b"b"), (Peer(1, 1), b"c"))
    assert queue.waiting(engine) == 2 and queue.waiting(Peer(0, 21)) == 0
    queue.clear()
    assert not queue and queue.peers == 0
    with pytest.raises(IndexError):
        queue.take()


@pytest.mark.unit
def test_a_refusal_finds_the_request_id_in_the_first_bytes_only():
    commit = proto.encode_frames(proto.CommitSegments(1, [4096] * 60_000), 77, "t" * 32)
    assert leading_request_id(commit[1]) == 77
    assert leading_request_id(proto.encode_frames(proto.Status(), 2**40)[1]) == 2**40
    for garbage in (b"", b"\xc1", b"\x92\x01\x02", b"\x81\xa2id\xa1x", b"\x81\xa2id\xff"):
        assert leading_request_id(garbage) == 0


@pytest.mark.ipc
def test_a_process_with_too_many_requests_waiting_has_the_next_refused_and_every_one_answered(daemon, client):
    """8 connections of one process send 16 requests each at once: the daemon reads one of each connection a turn and
    answers one a turn for the process, so its queue fills and the rest are refused, each answered all the same."""
    token = client._core.control.token
    dealers = []
    for _ in range(8):
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(client._core.control.endpoint)
        dealers.append(dealer)
    try:
        for request_id in range(1, 129):
            dealers[request_id % 8].send_multipart(proto.encode_frames(proto.Status(), request_id, token))
        poller = zmq.Poller()
        for dealer in dealers:
            poller.register(dealer, zmq.POLLIN)
        replies: dict[int, proto.Message] = {}
        while len(replies) < 128:
            ready = dict(poller.poll(30_000))
            assert ready, f"{128 - len(replies)} requests unanswered"
            for dealer in ready:
                envelope = proto.decode_frames(dealer.recv_multipart())
                assert envelope.request_id not in replies
                replies[envelope.request_id] = envelope.body
    finally:
        for dealer in dealers:
            dealer.close(linger=0)
    refused = [reply for reply in replies.values() if isinstance(reply, proto.ErrorReply)]
    assert refused and len(refused) < 128 - MAX_QUEUED_PER_PEER
    assert {(r.code, r.retryable, r.details["waiting"]) for r in refused} == {("conflict", True, MAX_QUEUED_PER_PEER)}
    assert f"pid {os.getpid()} has {MAX_QUEUED_PER_PEER} control requests waiting already" in refused[0].message
    assert len(refused) + sum(isinstance(reply, proto.StatusReply) for reply in replies.values()) == 128
    warnings = [line for line in daemon.log().splitlines() if "control requests waiting" in line]
    assert len(warnings) == 1 and f"pid {os.getpid()} (uid {os.getuid()})" in warnings[0]
    assert client.status().num_sessions == 1  # its own calls go on once its queue has room


@pytest.mark.unit
def test_peers_whose_pid_reads_0_are_told_apart_by_their_connections():
    flood, other = Peer(1000, 0, b"flood"), Peer(1000, 0, b"other")
    queue = queue_of(*[(flood, b"flood")] * MAX_QUEUED_PER_PEER)
    assert (queue.waiting(flood), queue.waiting(other), queue.peers) == (MAX_QUEUED_PER_PEER, 0, 1)
    assert str(other) == "a connection whose process the daemon cannot see" and str(Peer(1000, 7)) == "pid 7"
