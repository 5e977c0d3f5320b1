"""Session messages: the handshake on the handle plane and the FD batch header.

The handshake travels on the session's Unix ``SOCK_SEQPACKET`` connection, the
one the daemon identifies with ``SO_PEERCRED``; the token it returns must
accompany every control-plane request of that session.
"""

from __future__ import annotations

import dataclasses

from .buffers import Committed
from .codec import Message, Request, message


@message("session.hello")
class Hello(Message):
    """Client → daemon, first datagram on a new handle connection.

    ``version`` is ``[major, minor]``; a different major is refused.
    ``client_name`` labels the session in ``hbmctl``; ``tenant`` is the
    client-declared tenant name used for quotas (empty: keyed by uid).
    ``observer`` marks a tool that only looks (``hbmctl``): it holds no
    memory and is not counted or listed among the sessions. ``lease``
    (1.3): the client places leased granules itself (see :class:`LeaseGrant`).

    ``resume_session`` and ``resume_credential`` (1.4): take back session
    ``resume_session`` after the daemon restarted, proving it with the
    credential of its last :class:`Welcome`. Only the process that opened the
    session (its uid and pid) may, once per credential; the other fields
    but ``replies_with_fds`` are then ignored. Refused with ``session_lost``
    where the daemon does not know the session (it restarted with nothing to
    keep it, or its window to resume had passed).

    ``start_over`` (1.12): where the daemon does not know ``resume_session``,
    open a new session in its place, on which this process declares again
    what it still maps (:class:`~hbmd.proto.Redeclare`), instead of the
    ``session_lost`` refusal; the hello's other fields describe the new
    session. Only a credential that a daemon of this instance issued, in
    an earlier run, to that session of the peer's uid starts one over, once:
    the client library keeps it, and nobody else has it.

    ``replies_with_fds`` (1.7): this connection reads its handle socket for
    replies too; a :class:`Committed` reply then rides in the first
    :class:`FdBatch` of its request (see there) instead of on the control
    socket, so that its reader wakes once, for both.
    """

    version: list[int]
    pid: int
    client_name: str = ""
    tenant: str = ""
    observer: bool = False
    lease: bool = False
    resume_session: int = 0
    resume_credential: str = ""
    replies_with_fds: bool = False
    start_over: bool = False


@message("session.welcome")
class Welcome(Message):
    """Daemon → client, the answer to :class:`Hello`.

    ``token`` is the session's random capability for control requests;
    ``granularity`` is the granule in bytes; ``device_uuid``/``device_index``
    are empty/-1 on the host backend.
    """

    token: str
    session_id: int
    instance: str
    backend: str
    granularity: int
    version: list[int]
    daemon_version: str
    device_uuid: str = ""
    device_index: int = -1
    lease_bytes: int = 0
    """The most this session may be leased (1.3); 0: no leases (the daemon's ``--lease 0``, or not asked for)."""
    resume_credential: str = ""
    """What takes this session back after a daemon restart (1.4): good once, for this process only; empty for an
    observer and where the daemon keeps nothing across a restart. Not the token: it never travels with a request."""
    lease_chunk_ids: list[int] = dataclasses.field(default_factory=list)
    """On a resume, the granules the daemon records as leased to the session and not placed."""
    credit_bytes: int = 0
    """The most credit this session may hold (1.8): bytes its client may commit in chunks it makes itself
    (:class:`CreditGrant`); 0: none (the daemon's ``--credit 0``, no lease asked for, or a backend that cannot check
    a client's chunk)."""
    tenant: str = ""
    """The tenant the session's memory is charged to (1.9): the one its hello declared, or its uid's entry."""
    tenant_note: str = ""
    """Why ``tenant`` may not be what the client meant (1.9): a declared name the daemon's config does not have (a
    typo is charged elsewhere, or is a tenant of no limits); empty where nothing is amiss."""
    started_over: bool = False
    """A new session in place of the one the hello asked to resume (1.12, :attr:`Hello.start_over`): its process may
    declare what it still maps, before any other request."""


@message("session.refused")
class Refused(Message):
    """Daemon → client instead of :class:`Welcome`; ``code`` is an error-table wire name."""

    code: str
    message: str


@message("session.fds")
class FdBatch(Message):
    """Daemon → client header of a datagram carrying FDs with ``SCM_RIGHTS``.

    The i-th FD attached belongs to ``chunk_ids[i]``; the batches of one
    request are numbered ``batch`` = 0 .. ``batches`` - 1. A batch whose
    chunks could not be exported carries no FDs and a non-empty ``error``.

    ``reply`` (1.7): the request's reply, in batch 0, for a connection whose
    hello asked for it (:attr:`Hello.replies_with_fds`) where the reply is
    small (:data:`MAX_SEGMENTS_WITH_FDS` segments, one batch of chunks at
    most); the control socket carries no reply to the request then. Errors
    always come on the control socket.
    """

    request_id: int
    chunk_ids: list[int]
    batch: int
    batches: int
    error: str = ""
    reply: Committed | None = None


MAX_SEGMENTS_WITH_FDS = 1024
"""The most segments a buffer may have for a reply about it to ride with FDs: it keeps the datagram far below the
64 KiB a client reads (two lists of 1,024 sizes and 250 chunk descriptions take under 30 KiB)."""


@message("session.ack")
class Ack(Message):
    """An empty success reply."""


@message("session.reclaim_request")
class ReclaimRequest(Message):
    """Daemon → client on the handle plane: please give back ``bytes`` (why: ``reason``).

    The client's registered callback decides what to release and the client
    answers with :class:`ReclaimDone`; nothing is taken by force.
    """

    reclaim_id: int
    bytes: int
    reason: str
    demote: bool = False
    """Demote instead (1.6): the client library itself moves this many bytes of its buffers to the host tier, at the
    same addresses, and answers with the bytes moved; the daemon asks only sessions of tenants its config marks
    ``demote``, idle for a while, and never a client of an earlier minor."""


@message("session.reclaim_done")
class ReclaimDone(Request[Ack]):
    """Client → daemon: the outcome of a :class:`ReclaimRequest`."""

    reclaim_id: int
    released_bytes: int


# Leases (1.3): granules created and exported ahead of need, placed by the client itself.

MAX_PLACED_GRANULES = 8
"""The most granules a client places from its lease for one commit, each a run of one granule (a longer run
is one chunk from the daemon, as without leases). Each placed granule is mapped and given access on its own,
so beyond this the daemon's round trip is faster; and a commit the lease is not meant for does not make the
daemon lease more."""
MAX_PLACED_SEGMENTS = 1024
"""The most segments of a buffer that grows from a lease. A placement carries a size per segment, and the daemon
works out the granules the growth needs from all of them before it can refuse a wrong one, in time that grows with
the segments. Engines' buffers (a segment per layer, or two)
stay far below; a buffer of more segments grows through the daemon."""


@message("session.lease_grant")
class LeaseGrant(Message):
    """Daemon → client on the handle plane, with one FD per chunk (``SCM_RIGHTS``): granules leased to the session.

    Each is one granule, charged to the session's tenant from now on. The
    client places them in its buffers itself and tells the daemon with
    :class:`LeasePlace`; until then they are the session's lease, shown apart
    from committed bytes, and go back when the session ends.
    """

    chunk_ids: list[int]
    size: int


@message("session.promote_request")
class PromoteRequest(Message):
    """Daemon → client on the handle plane (1.6): the device has room again for the ``bytes`` of buffers this
    session's client demoted when asked (:attr:`ReclaimRequest.demote`); the client promotes them back by itself."""

    bytes: int


@message("session.lease_revoke")
class LeaseRevoke(Message):
    """Daemon → client: give back the leased ``chunk_ids`` not placed yet (:class:`LeaseReturn`); budget pressure."""

    chunk_ids: list[int]


@message("session.lease_bind")  # the wire name of protocol 1.3, kept
class LeasePlace(Message):
    """Client → daemon on the handle plane: leased granules now back a buffer.

    The segments of ``buffer_id`` grow to ``sizes`` (as a commit would), and
    the granule at ``offsets[i]`` is the leased chunk ``chunk_ids[i]``: one per
    granule the growth needs, exactly. The client sends this before it maps
    the granules and the daemon reads every such datagram before it answers
    another request of the session or ends it, so the daemon's record of the
    buffer is never behind what the client mapped.
    """

    buffer_id: int
    sizes: list[int]
    chunk_ids: list[int]
    offsets: list[int]


@message("session.lease_return")
class LeaseReturn(Message):
    """Client → daemon: these leased chunks are not placed and will not be; the daemon releases them."""

    chunk_ids: list[int]


# Credit (1.8): bytes a client commits in chunks it makes itself, within what the daemon granted.

MAX_OWN_CHUNKS = 16
"""The most chunks one :class:`OwnChunks` carries (one FD each); a growth of more runs goes through the daemon."""


@message("session.credit_grant")
class CreditGrant(Message):
    """Daemon → client on the handle plane: ``bytes`` more of credit, charged to the session's tenant from now on.

    Within its credit a client commits without a round trip: it makes each
    run's chunk itself, sends it with :class:`OwnChunks`, and maps it. The
    credit is the session's lease in bytes: shown as leased, asked back
    under pressure or when idle (:class:`CreditRevoke`), gone with the
    session.
    """

    bytes: int


@message("session.credit_revoke")
class CreditRevoke(Message):
    """Daemon → client: give back the credit not spent yet (:class:`CreditReturn`); budget pressure or idleness."""


@message("session.own_chunks")
class OwnChunks(Message):
    """Client → daemon on the handle plane, with one FD per chunk (``SCM_RIGHTS``): chunks the client made now back
    a buffer, paid for from its credit.

    The segments of ``buffer_id`` grow to ``sizes`` (as a commit would), and
    the run of the growth at ``offsets[i]`` is the chunk of ``chunk_sizes[i]``
    bytes whose FD is the i-th attached: one chunk per run, exactly, as the
    daemon itself backs a commit. The daemon checks each chunk (this device,
    plain device memory of exactly that size; on the host backend a sealed
    memfd of that size) and keeps its FD: from then on the chunk is the
    daemon's, as if it had made it, and outlives the client. As for
    :class:`LeasePlace`, the client sends this before it maps the chunks and
    the daemon reads it before it answers another request of the session.
    """

    buffer_id: int
    sizes: list[int]
    offsets: list[int]
    chunk_sizes: list[int]


@message("session.credit_return")
class CreditReturn(Message):
    """Client → daemon: all the credit not spent is given back (``bytes``, what this client had); the daemon drops
    whatever it records as unspent, having read every bind sent before. A client answers each
    :class:`CreditRevoke` so, and gives back its credit so when its own commit was refused or its session resumed
    on a restarted daemon (which may record a grant the client never read)."""

    bytes: int
