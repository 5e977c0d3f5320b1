"""What the daemon records: chunks, tenants, sessions, buffers and reclaim requests.

Plain data. The modules beside this one own the rules that change it:
``tenants`` the budget, ``sessions`` who is connected, ``buffers`` the
buffers and their chunks, ``leases`` the granules made ahead of need.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Generic

from hbmd.proto import MAX_SEGMENTS, TIER_DEVICE, TIER_HOST, BufferInfo, ChunkInfo
from hbmd.proto.errors import InvalidRequest, PermissionDenied
from hbmd.proto.runs import backed_runs, prefix_offsets

from ..backends import A, C
from .writers import Writer

MAX_CAPACITY = 1 << 50
"""1 PiB: more than any device, small enough that offsets never overflow."""


def check_int(name: str, value: int, low: int, high: int) -> None:
    """Refuse ``value`` outside ``[low, high]`` with an ``InvalidRequest`` naming the field."""
    if not low <= value <= high:
        raise InvalidRequest(f"{name} {value} is out of range [{low}, {high}]", field=name, value=str(value))


@dataclasses.dataclass
class ConfigLoad:
    """Where the config in force came from and how its last reload went, as status and metrics report it."""

    path: str = ""
    """The ``--config`` file; empty without one."""
    loaded_at: float = 0.0
    """Unix time the config in force was read: at start, or by the last reload that took effect."""
    failed_at: float = 0.0
    """Unix time of the last reload refused since then (the config in force stayed); 0 for none."""
    error: str = ""
    """Why that reload was refused."""

    def loaded(self) -> None:
        self.loaded_at, self.failed_at, self.error = time.time(), 0.0, ""

    def failed(self, error: str) -> None:
        self.failed_at, self.error = time.time(), error


@dataclasses.dataclass
class Chunk(Generic[C]):
    chunk_id: int
    offset: int
    size: int
    handle: C | None
    """None: the chunk is held only by the processes that map it (declared by its client after a cold restart of
    the daemon, nothing holding its memory): the daemon counts it, but can neither hand it out nor free its memory."""
    live: bool = True
    """False once released: a queued export of it must not happen."""
    tier: str = TIER_DEVICE
    """Where its memory is: the device's, or the host tier's (charged to the host budget)."""

    def info(self) -> ChunkInfo:
        return ChunkInfo(self.chunk_id, self.offset, self.size)


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-uid bounds on what costs the daemon something besides the budget: descriptors, memory, its state
    directory."""

    sessions_per_uid: int = 128
    persistent_buffers_per_uid: int = 64
    buffers_per_uid: int = 1024
    segments_per_uid: int = 1 << 16
    """Buffers cost no budget, but each segment costs the daemon memory to describe, and every listing of the uid's
    buffers bytes to send: 16 buffers of the most segments."""
    sessions: int = 4096
    """Sessions of all uids together (or ``sessions_per_uid``, where more), shared fairly between them
    (:mod:`hbmd.daemon.shares`): per-uid bounds add up with the number of uids in the group."""
    sessions_floor: int = 16
    """Sessions a uid may always open, whatever the others hold."""
    buffers: int = 16384
    """Buffers of all uids together (or ``buffers_per_uid``, where more), shared likewise."""
    buffers_floor: int = 64
    segments: int = 1 << 20
    """Segments of all uids' buffers together (or ``segments_per_uid``, where more), shared likewise."""
    segments_floor: int = MAX_SEGMENTS
    """A buffer of the most segments."""


@dataclasses.dataclass
class Tenant:
    """Whom commits are charged to: a configured or client-declared name, else ``uid:<N>``."""

    name: str
    max_bytes: int | None = None
    guaranteed_bytes: int = 0
    used_bytes: int = 0
    """Committed and leased bytes charged to it."""
    leased_bytes: int = 0
    """The part of ``used_bytes`` its sessions hold as leases (given back under pressure)."""
    host_bytes: int = 0
    """Bytes of its buffers in the host tier: charged to the host budget, not part of ``used_bytes``."""
    holders: int = 0
    """Sessions and buffers charged to it: a tenant nobody configured goes with its last one."""

    @property
    def unmet_guarantee(self) -> int:
        return max(0, self.guaranteed_bytes - self.used_bytes)

    @property
    def committed_bytes(self) -> int:
        """What it holds in buffers: its use less its sessions' leases."""
        return self.used_bytes - self.leased_bytes


@dataclasses.dataclass
class Reclaim:
    """The last request to a session to give memory back, and its outcome."""

    reclaim_id: int
    requested_bytes: int
    reason: str
    asked_at: float
    """When it was asked (the state's monotonic clock)."""
    released_bytes: int | None = None
    told: bool = False
    """A commit refused since its answer came was told it (a demote answered with less than asked: nothing more is
    being demoted there)."""
    demote: bool = False
    """Asked to demote its buffers to the host tier rather than to release memory."""
    reported: bool = False
    """Whether the daemon already logged it as ignored."""

    def outcome(self, now: float, patience_s: float) -> str:
        if self.released_bytes is not None:
            return "answered"
        return "ignored" if now - self.asked_at > patience_s else "pending"


@dataclasses.dataclass
class Answer:
    """A session's last request and what answered it, kept so that the request sent again after a daemon restart is
    answered again rather than done twice."""

    request_id: int
    frames: list[bytes] | None
    """The encoded reply; None for a reply that brought chunks, rebuilt from ``buffer_id`` and ``chunk_ids``."""
    buffer_id: int = 0
    chunk_ids: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Session:
    session_id: int
    token: str
    pid: int
    uid: int
    gid: int
    client_name: str
    tenant: Tenant
    admin: bool = False
    observer: bool = False
    connected_at: float = 0.0
    """When its client connected or came back (the state's monotonic clock, as ``lease_used_at`` and
    ``grown_at``)."""
    buffers: dict[int, Buffer[Any, Any]] = dataclasses.field(default_factory=dict)
    reading: dict[int, Buffer[Any, Any]] = dataclasses.field(default_factory=dict)
    """Sealed buffers this session holds a read claim on (it maps them read-only)."""
    reclaim: Reclaim | None = None
    wants_lease: bool = False
    """The client places leased granules itself (it said so in its hello)."""
    lease: dict[int, Chunk[Any]] = dataclasses.field(default_factory=dict)
    """Granules leased and not placed yet, by chunk id: sent, or queued to be sent."""
    leased_bytes: int = 0
    lease_target: int = 0
    """Granules the daemon keeps leased to it: doubles when a commit found the lease short, 0 under pressure."""
    revoking: set[int] = dataclasses.field(default_factory=set)
    """Leased chunk ids asked back and not returned yet."""
    revoking_since: float = 0.0
    """When the session was asked for the first of ``revoking`` (monotonic)."""
    lease_used_at: float = 0.0
    """When the session last placed leased granules or found its lease short."""
    wants_credit: bool = False
    """The client commits in chunks it makes itself, within a credit (a client of protocol 1.8 that asked for
    leases)."""
    credit: int = 0
    """Bytes granted for chunks its client makes itself and not spent yet (:class:`~hbmd.proto.CreditGrant`): a part
    of ``leased_bytes``."""
    credit_target: int = 0
    """The credit the daemon keeps granted to it: twice the last commit it could have served, 0 under pressure."""
    credit_asked_back: bool = False
    """Its credit was asked back (:class:`~hbmd.proto.CreditRevoke`) and its return not read yet."""
    grown_at: float = 0.0
    """When the session last grew a buffer: one that grew lately is busy, and not asked to demote."""
    demoted_under_pressure: bool = False
    """Its client demoted buffers when asked: they are promoted back once the device has room for them."""
    promote_asked_at: float = 0.0
    """When its client was last told the device has room for them (monotonic)."""
    credential_hash: str = ""
    """SHA-256 of the credential that resumes the session after a daemon restart (the credential itself is never
    kept)."""
    previous_credential_hash: str = ""
    """The one before, good until the client next speaks: the daemon may have gone with the welcome that carried the
    new one still unsent."""
    resume_by: float | None = None
    """Restored after a restart and not resumed yet: the monotonic time by which its client must come back, or the
    session ends as a dead one's does. None for a connected session."""
    answer: Answer | None = None
    last_request_id: int = 0
    """The id of the latest request of the session the daemon took up: an older one that changes state is never done.
    Its client numbers them in order and has one in flight; one older came on a connection the client gave up on (its
    call timed out), read by the daemon only after a later one (issue #61). Not journaled: a restored session starts
    from its ``answer``'s."""
    replaces: tuple[str, int] = ("", 0)
    """The line of daemons and the id of the session this one started over in place of (``("", 0)``: none): whose
    names its process may declare again (:meth:`Credentials.proves_name`)."""
    declaring: bool = False
    """Its process found its session gone after a restart and started over: it may declare again the buffers it
    still maps (:class:`~hbmd.proto.Redeclare`) until it asks for anything else."""

    @property
    def committed_bytes(self) -> int:
        """Device bytes its buffers map (a demoted buffer's are host memory, charged apart)."""
        return sum(b.physical_bytes for b in self.buffers.values() if not b.demoted)


def check_observer(session: Session) -> None:
    """Refuse an observer session anything that holds memory."""
    if session.observer:
        raise PermissionDenied("an observer session holds no memory; connect without observer=True")


@dataclasses.dataclass
class Buffer(Generic[A, C]):
    buffer_id: int
    name: str
    persistent: bool
    shareable: bool
    owner: Session | None
    owner_uid: int
    tenant: Tenant
    capacity: int
    reserved: int
    segment_capacities: list[int]
    arena: A
    segment_sizes: list[int] = dataclasses.field(default_factory=list)
    """Committed bytes of each segment: a prefix of it."""
    segment_offsets: list[int] = dataclasses.field(default_factory=list)
    chunks: list[Chunk[C]] = dataclasses.field(default_factory=list)
    physical_bytes: int = 0
    """Bytes of ``chunks``: what the owner has mapped."""
    pending: list[Chunk[C]] = dataclasses.field(default_factory=list)
    """New chunks of a preserving defragment, until the client confirms its remap."""
    pending_bytes: int = 0
    host_bytes: int = 0
    """Bytes of ``chunks`` and ``pending`` in the host tier."""
    sealed: bool = False
    """Immutable from now on: no commit, release or defragment; sessions of its user may read it at once."""
    readers: dict[int, int] = dataclasses.field(default_factory=dict)
    """Read claims on a sealed buffer: how many read-only attaches each session id holds (never 0)."""
    keep_orphan_s: float = 0.0
    """How long it is kept as an orphan before the daemon frees it; 0: until deleted."""
    orphaned_at: float = 0.0
    """Unix time it last became an orphan; 0 while a session holds it (or where the daemon does not know)."""
    expires_at: float = 0.0
    """Unix time the daemon frees it, an orphan still; 0: never."""
    last_holder: tuple[str, int] = ("", 0)
    """The client name and pid of the session that last held it, once an orphan (``("", 0)``: not known)."""
    unsealed_since: float = 0.0
    """Unix time since which a persistent buffer has held its name unsealed, whichever sessions held it (see
    :meth:`Buffers.create`); 0 once sealed, for an anonymous buffer, or where the daemon does not know."""
    writer: Writer | None = None
    """The process of the session that last held it, an orphan, where it may still map and write it: its session
    ended while it lived (:mod:`.writers`). Not journaled: the daemon's pidfd does not outlive it."""

    def __post_init__(self) -> None:
        self.segment_offsets = prefix_offsets(self.segment_capacities)
        if not self.segment_sizes:
            self.segment_sizes = [0] * len(self.segment_capacities)

    @property
    def num_segments(self) -> int:
        return len(self.segment_capacities)

    @property
    def uniform(self) -> bool:
        """Equal segments: what a client of protocol 1.0 understands."""
        return len(set(self.segment_capacities)) == 1

    @property
    def segment_capacity(self) -> int:
        """The capacity every segment has (the smallest one where they differ)."""
        return min(self.segment_capacities)

    @property
    def bytes_per_segment(self) -> int:
        """The committed prefix every segment has (the smallest one where they differ)."""
        return min(self.segment_sizes)

    def backed_runs(self, sizes: list[int], granule: int) -> list[tuple[int, int]]:
        return backed_runs(self.segment_offsets, sizes, granule)

    @property
    def tier(self) -> str:
        """Where its mapped chunks are: all in one tier (an empty buffer is on the device)."""
        return self.chunks[0].tier if self.chunks else TIER_DEVICE

    @property
    def pending_tier(self) -> str:
        """Where the pending chunks of a defragment or a move are."""
        return self.pending[0].tier if self.pending else TIER_DEVICE

    @property
    def demoted(self) -> bool:
        return self.tier == TIER_HOST

    @property
    def held_elsewhere(self) -> bool:
        """Whether some of its memory is held only by the processes that map it (see :attr:`Chunk.handle`).

        Such chunks come only from a declaration (:class:`Redeclare`, or its
        journal), as the whole of the buffer's chunks then, and a buffer grows
        by chunks the daemon holds, appended: they are a prefix of ``chunks``,
        so the first chunk tells (``check_invariants`` holds the buffer to
        that). Every reply about the buffer carries this: it must not cost a
        pass over its 10,000 chunks.
        """
        return bool(self.chunks) and self.chunks[0].handle is None

    def info(self) -> BufferInfo:
        return BufferInfo(
            buffer_id=self.buffer_id,
            name=self.name,
            persistent=self.persistent,
            session_id=self.owner.session_id if self.owner else 0,
            owner_uid=self.owner_uid,
            capacity_bytes=self.capacity,
            reserved_bytes=self.reserved,
            num_segments=self.num_segments,
            segment_capacity_bytes=self.segment_capacity,
            bytes_per_segment=self.bytes_per_segment,
            physical_bytes=self.physical_bytes,
            num_chunks=len(self.chunks),
            segment_capacities=list(self.segment_capacities),
            segment_sizes=list(self.segment_sizes),
            sealed=self.sealed,
            readers=len(self.readers),
            shareable=self.shareable,
            pending_bytes=self.pending_bytes,
            held_elsewhere=self.held_elsewhere,
            tier=self.tier,
            keep_orphan_s=self.keep_orphan_s,
            orphaned_at=self.orphaned_at,
            expires_at=self.expires_at,
            last_holder=self.last_holder[0],
            last_holder_pid=self.last_holder[1],
            unsealed_since=self.unsealed_since,
        )
