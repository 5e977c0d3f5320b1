"""The control requests between the ROUTER and their answers: read, queued by the peer that sent them, taken in turns.

A ROUTER hands over its connections' requests in turn, one per connection:
a process that opened 64 control connections and kept costly requests in
flight on each had 63 of them answered before a peer with one connection
had its next (``tests/test_flood.py``, "commits on 64 connections", times an
engine's calls meanwhile; SECURITY.md has the figures). So the loop reads what waits on the ROUTER into a queue per
peer, the process at the other end of the connection as the kernel names it
(``SO_PEERCRED``, which libzmq hands on as a message's ``Peer-Address``,
``…:uid:gid:pid``), and answers in turns: the uids with requests waiting take
turns, and within a uid its processes; a process that had none waiting goes
first. However many connections, sessions or tokens a process uses, it has
one request answered per round of turns; however many processes a uid runs,
they share one turn among other uids.

A pid is a name only where the daemon sees the process: in its own pid
namespace (a container's daemon, clients outside it) the kernel reports pid
0 for every peer, and a queue per pid would be one queue per uid, 32
requests for all its processes. Such a peer is its connection instead,
which the kernel keeps apart in every namespace: its processes are told
apart, and one of them opening many connections has as many turns within
its uid's (other uids' turns are untouched). ``tests/test_pid_namespace.py``
runs a daemon under ``unshare --pid``.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import NamedTuple, cast

import msgpack
import zmq
from hbmd.proto import ErrorReply, encode_frames
from hbmd.proto.errors import Conflict

from .ratelimit import RateLimitedLog

log = logging.getLogger("hbmd.server")

MAX_QUEUED_PER_PEER = 32
"""Control requests one process may have read and waiting for their turn; more are refused at once with a retryable
``conflict``. A client has one request in flight, so a process reaches it only with 32 clients of one daemon calling
at once: a flood's requests are refused, and cost the daemon no more memory than this many."""
UNREAD_PER_CONNECTION = 8
"""Requests ZeroMQ reads ahead on one control connection (the ROUTER's ``RCVHWM``; libzmq's default is 1000): past
them it leaves the connection's socket unread and the sender waits. A flood of 60,000-segment commits on 64
connections takes the daemon's RSS to gigabytes with the default, not with this (``tests/test_flood.py`` prints
its peak)."""
READ_PER_TURN_S = 0.02
"""Seconds spent reading the ROUTER in one turn of the loop at most (one request at least). A turn reads a request of
each connection that has one, as the ROUTER hands them over, and stops when a connection comes round again: a turn
over a 64-connection flood of the largest commits stays well within it, so this bounds only floods of some hundreds of
connections."""


Requests = collections.deque[tuple[bytes, list[bytes]]]
"""One peer's requests waiting: ``(identity of the connection, frames)`` each, the oldest first."""


class Peer(NamedTuple):
    """Who sent a control request, as the kernel names the process that opened its connection; where it names none
    (pid 0: a process outside the daemon's pid namespace), the connection itself."""

    uid: int
    pid: int
    connection: bytes = b""
    """The connection's routing identity where ``pid`` names no process; empty where it does."""

    @property
    def process(self) -> tuple[int, bytes]:
        """What tells the peer from the others of its uid: its pid, or its connection where the pid is not one."""
        return self.pid, self.connection

    def __str__(self) -> str:
        if self.connection:
            return "a connection whose process the daemon cannot see"
        return f"pid {self.pid}"


def peer_of(identity: zmq.Frame) -> Peer:
    """The process at the other end of the connection a message came on, from its first frame's ``Peer-Address``;
    its connection where the kernel names no process (another pid namespace, or not an ``ipc://`` connection)."""
    try:
        _, uid, _, pid = str(identity.get("Peer-Address")).rsplit(":", 3)
        peer = Peer(int(uid), int(pid))
    except (zmq.ZMQError, ValueError):
        peer = Peer(-1, -1)
    return peer if peer.pid > 0 else peer._replace(connection=identity.bytes)


def leading_request_id(payload: bytes) -> int:
    """The id of a request refused unread, where the client's codec writes it: the payload map's first entry; 0 where
    it is not there.

    ``hbmd.proto.peek_request_id`` skips every other entry to honour an id
    repeated after the body, which costs in proportion to the body (a
    commit of many segments): a refusal of a flood's request reads 16 bytes
    instead.
    """
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(payload[:16])
    try:
        if not (unpacker.read_map_header() and unpacker.unpack() == "id"):
            return 0
        request_id = unpacker.unpack()
    except (ValueError, msgpack.UnpackException):  # garbage, or cut short: no id to answer with
        return 0
    return request_id if type(request_id) is int and 0 <= request_id < 2**63 else 0


class ControlQueue:
    """Control requests read from the ROUTER and waiting for their turn, by uid and, within it, by process."""

    def __init__(self) -> None:
        self._uids: collections.OrderedDict[int, collections.OrderedDict[tuple[int, bytes], Requests]] = (
            collections.OrderedDict()
        )
        """The requests waiting, by uid and :attr:`Peer.process`: each in the order of the turns, the next first."""
        self._count = 0
        self.peers = 0
        """How many processes have requests waiting."""
        self._warnings = RateLimitedLog(log)

    def __len__(self) -> int:
        return self._count

    def read(self, router: zmq.Socket) -> None:
        """Move a request of each connection that has one on ``router`` into its peer's queue, for
        :data:`READ_PER_TURN_S` at most; one whose peer has :data:`MAX_QUEUED_PER_PEER` waiting already is refused
        instead.

        The ROUTER hands over a request of each connection in turn: once a
        connection comes round again, every other has had one read, a request
        just sent beside a flood's among them.
        """
        ends = time.perf_counter() + READ_PER_TURN_S
        seen: set[bytes] = set()
        # The poll saw a request: the first is read at once. After each the socket is asked whether another waits
        # rather than read: a read of an empty socket raises zmq.Again, dearer than asking.
        while True:
            try:
                # The first frame uncopied, for its peer's credentials; the rest of a message comes with it.
                first = router.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity: bytes = first.bytes
            body = router.recv_multipart(zmq.NOBLOCK)
            peer = peer_of(first)
            if self.waiting(peer) < MAX_QUEUED_PER_PEER:
                self.add(peer, identity, body)
            else:
                self._refuse(router, peer, identity, body)
            # pyzmq types every option's value int | bytes; ZMQ_EVENTS is an int.
            if (identity in seen or time.perf_counter() >= ends
                    or not cast(int, router.get(zmq.EVENTS)) & zmq.POLLIN):
                return
            seen.add(identity)

    def waiting(self, peer: Peer) -> int:
        """How many requests of ``peer`` wait."""
        processes = self._uids.get(peer.uid)
        return len(processes.get(peer.process, ())) if processes else 0

    def add(self, peer: Peer, identity: bytes, body: list[bytes]) -> None:
        """Queue a request of ``peer`` (``identity``: its connection's) behind its others.

        A peer that had none waiting takes the next turn, and so does its uid:
        a client with one call in flight is answered before a flood's next
        request, not after, and a flood, which always has one waiting, never
        takes a turn that way. Every peer waiting still has one answered each
        round of turns.
        """
        processes = self._uids.get(peer.uid)
        if processes is None:
            processes = self._uids[peer.uid] = collections.OrderedDict()
            self._uids.move_to_end(peer.uid, last=False)
        waiting = processes.get(peer.process)
        if waiting is None:
            waiting = processes[peer.process] = collections.deque()
            processes.move_to_end(peer.process, last=False)
            self.peers += 1
        waiting.append((identity, body))
        self._count += 1

    def take(self) -> tuple[bytes, list[bytes]]:
        """The next request to answer, ``(identity, frames)``: the first of the process whose turn it is in the uid
        whose turn it is. Both go to the back of their turns; ``IndexError`` when none waits."""
        if not self._count:
            raise IndexError("no control request waits")
        uid, processes = self._uids.popitem(last=False)
        process, waiting = processes.popitem(last=False)
        request = waiting.popleft()
        self._count -= 1
        if waiting:
            processes[process] = waiting
        else:
            self.peers -= 1
        if processes:
            self._uids[uid] = processes
        return request

    def clear(self) -> None:
        """Forget every request waiting (the sockets are let go: their clients send them again once resumed)."""
        self._uids.clear()
        self._count = self.peers = 0

    def _refuse(self, router: zmq.Socket, peer: Peer, identity: bytes, body: list[bytes]) -> None:
        self._warnings.warning(
            f"queued-{peer.uid}", "%s (uid %d) has %d control requests waiting, the most one process may: "
            "refusing more until they are answered", peer, peer.uid, MAX_QUEUED_PER_PEER,
        )
        refusal = Conflict(
            f"{peer} has {MAX_QUEUED_PER_PEER} control requests waiting already, the most one process may "
            "have: retry once they are answered", pid=peer.pid, waiting=MAX_QUEUED_PER_PEER,
        )
        request_id = leading_request_id(body[1]) if len(body) == 2 else 0
        try:
            router.send_multipart([identity, *encode_frames(ErrorReply.of(refusal), request_id)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("refusal dropped: %s", exc)
