"""The control requests between the control socket and their answers: read, queued by the peer that sent them, taken
in turns.

A ROUTER handed over its connections' requests in turn, one per connection:
a process that opened 64 control connections and kept costly requests in
flight on each had 63 of them answered before a peer with one connection
had its next (``tests/test_flood.py``, "commits on 64 connections", times an
engine's calls meanwhile; SECURITY.md has the figures). So the loop reads a request of each connection a turn, as the
ROUTER did, into a queue per peer, the process at the other end of the connection as the kernel names it
(``SO_PEERCRED``), and answers in turns: the uids with requests waiting take
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
from collections.abc import Iterable
from typing import NamedTuple, Protocol

import msgpack
from hbmd.proto import MAX_FRAME_BYTES, ErrorReply, encode_frames
from hbmd.proto.errors import Conflict

from ..shares import Shares
from .ratelimit import RateLimitedLog

log = logging.getLogger("hbmd.server")

MAX_QUEUED_PER_PEER = 32
"""Control requests one process may have read and waiting for their turn; more are refused at once with a retryable
``conflict``. A client has one request in flight, so a process reaches it only with 32 clients of one daemon calling
at once: a flood's requests are refused, and cost the daemon no more memory than this many."""
MAX_WAITING_BYTES_PER_UID = 64 << 20
"""Bytes of the control requests of one uid read and waiting for their turn; a request that would take its uid past
it, or past its fair share of :data:`MAX_WAITING_BYTES` (:class:`~..shares.Shares`), is refused with a retryable
``conflict``. Honest requests are under 1 MiB, one in flight per client."""
MAX_WAITING_BYTES = 96 << 20
"""The same for all uids together, shared fairly; a uid may always have :data:`MIN_WAITING_BYTES_PER_UID` waiting."""
MIN_WAITING_BYTES_PER_UID = MAX_FRAME_BYTES + 4096
"""One request of the largest a message carries."""
READ_PER_TURN_S = 0.02
"""Seconds spent reading the control connections in one turn of the loop at most, refusals included (one
connection at least). A turn reads one request at most of each connection, uids in turn, and leaves the rest
unread: in the kernel, or unparsed. Before, a turn read on until it completed a request, refusing in the same read
every request past 32 read ahead: one read of 16 KiB completed 8,192 empty messages (issue #61)."""


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


class Connections(Protocol):
    """What the queue needs of the control socket (``control_socket.ControlSocket``): the requests its connections
    completed, and a way to answer."""

    def read(self, until: float) -> Iterable[tuple[Peer, bytes, list[bytes]]]:
        """``(peer, identity of its connection, frames)`` of each request completed by ``until``
        (``time.perf_counter``), one of a connection at most."""
        ...

    def send(self, identity: bytes, frames: list[bytes]) -> None:
        """Send ``frames`` on the connection ``identity``, never waiting."""
        ...


class ControlQueue:
    """Control requests read from the control socket and waiting for their turn, by uid and, within it, by process."""

    def __init__(self) -> None:
        self._uids: collections.OrderedDict[int, collections.OrderedDict[tuple[int, bytes], Requests]] = (
            collections.OrderedDict()
        )
        """The requests waiting, by uid and :attr:`Peer.process`: each in the order of the turns, the next first."""
        self._bytes = Shares(MAX_WAITING_BYTES_PER_UID, MAX_WAITING_BYTES, MIN_WAITING_BYTES_PER_UID)
        """The bytes of each uid's requests waiting."""
        self._count = 0
        self.peers = 0
        """How many processes have requests waiting."""
        self._warnings = RateLimitedLog(log)

    def __len__(self) -> int:
        """How many requests wait."""
        return self._count

    def read(self, control: Connections) -> None:
        """Read what waits on ``control``, for :data:`READ_PER_TURN_S` at most, and queue each request completed for
        its turn; one whose process has :data:`MAX_QUEUED_PER_PEER` waiting already, or that would take its uid past
        :data:`MAX_WAITING_BYTES_PER_UID`, is refused.

        ``control`` reads one request of each connection at most, connections of the uids in turn (a ROUTER handed
        over one request of each connection in turn): a request just sent beside a flood's joins its queue before
        the flood's next.
        """
        for peer, identity, body in control.read(time.perf_counter() + READ_PER_TURN_S):
            size = sum(map(len, body))
            if self.waiting(peer) >= MAX_QUEUED_PER_PEER:
                self._refuse(control, peer, identity, body, "queued", f"has {MAX_QUEUED_PER_PEER} control requests "
                             "waiting already, the most one process may have", waiting=MAX_QUEUED_PER_PEER)
            elif not self._bytes.fits(peer.uid, size):
                share = self._bytes.share(peer.uid)
                self._refuse(control, peer, identity, body, "bytes", f"takes its uid's control requests waiting past "
                             f"{share >> 20} MiB, the most one uid may have now ({MAX_WAITING_BYTES >> 20} MiB in all)",
                             waiting_bytes=share)
            else:
                self.add(peer, identity, body)

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
        self._bytes.add(peer.uid, sum(map(len, body)))

    def take(self) -> tuple[bytes, list[bytes]]:
        """The next request to answer, ``(identity, frames)``: the first of the process whose turn it is in the uid
        whose turn it is. Both go to the back of their turns; ``IndexError`` when none waits."""
        if not self._count:
            raise IndexError("no control request waits")
        uid, processes = self._uids.popitem(last=False)
        process, waiting = processes.popitem(last=False)
        request = waiting.popleft()
        self._count -= 1
        self._bytes.add(uid, -sum(map(len, request[1])))
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
        self._bytes.clear()
        self._count = self.peers = 0

    def _refuse(self, control: Connections, peer: Peer, identity: bytes, body: list[bytes], kind: str, what: str,
                **details: int) -> None:
        """Answer a request of ``peer`` with a retryable ``conflict``: it ``what``; logged once per ``kind`` and uid
        per interval."""
        self._warnings.warning(f"{kind}-{peer.uid}", "%s (uid %d) %s: refusing more until they are answered", peer,
                               peer.uid, what)
        refusal = Conflict(f"{peer} {what}: retry once they are answered", pid=peer.pid, **details)
        request_id = leading_request_id(body[1]) if len(body) == 2 else 0
        control.send(identity, encode_frames(ErrorReply.of(refusal), request_id))
