"""Buffer messages: create, commit, release, free, attach, detach, graft.

Sizes are bytes. A buffer of ``capacity`` bytes has ``num_segments`` equal
segments, or (protocol 1.1) uneven ones of ``segment_capacities`` bytes, laid
back to back. Committing backs a prefix of each segment: the same
``bytes_per_segment`` of every one (:class:`Commit`), or each its own size
(:class:`CommitSegments`).
"""

from __future__ import annotations

import dataclasses

from .codec import Message, Request, message, record

TIER_DEVICE = "device"
TIER_HOST = "host"
TIERS = (TIER_DEVICE, TIER_HOST)
"""Where a chunk's memory is (1.6): the device's own, or host memory the device reaches (host-NUMA memory on CUDA, a
second memfd pool on the host backend), mapped at the same addresses either way."""

MAX_NAME = 128
"""The most characters of a name a peer gives (a buffer's, a session's client name, a tenant's): the daemon refuses a
longer one."""
MAX_SEGMENTS = 1 << 12
"""The most segments a buffer has, so also the longest list a request carries (a size per segment): a daemon decodes
no longer one, but a declaration's chunks (:data:`MAX_DECLARED_CHUNKS`). Every request on a buffer, and its reply,
costs the daemon's loop time in proportion to the buffer's segments, a commit of them all most: 3-4 ms for 4,096 on
the 2-core CI machine, where 65,536 took 50 ms and every other session waited behind each (SECURITY.md, "Measured";
``tests/test_message_bounds.py``)."""
MAX_DECLARED_CHUNKS = 1 << 16
"""The most chunks one :class:`Redeclare` carries: a buffer grown a granule at a time has a chunk per granule."""


@record
class ChunkInfo:
    """One physical chunk: ``size`` bytes mapped at ``offset`` of the buffer.

    Each chunk is a handle of its own (a CUDA allocation, a memfd), mapped
    from its start: ``handle_offset`` is always 0, and stays on the wire for
    clients of protocol 1.0 to 1.3, which read it.
    """

    chunk_id: int
    offset: int
    size: int
    handle_offset: int = 0


@record
class BufferInfo:
    """What the daemon knows of a buffer (also what ``hbmctl buffers`` prints)."""

    buffer_id: int
    name: str
    persistent: bool
    session_id: int
    owner_uid: int
    capacity_bytes: int
    reserved_bytes: int
    num_segments: int
    segment_capacity_bytes: int
    bytes_per_segment: int
    physical_bytes: int
    num_chunks: int
    segment_capacities: list[int] = dataclasses.field(default_factory=list)
    """Each segment's capacity (1.1); with equal segments every entry is ``segment_capacity_bytes``."""
    segment_sizes: list[int] = dataclasses.field(default_factory=list)
    """Each segment's committed prefix (1.1); ``bytes_per_segment`` is the smallest of them."""
    sealed: bool = False
    """Immutable, readable by several sessions at once (1.2)."""
    readers: int = 0
    """Sessions holding a read-only attach of this sealed buffer (1.2)."""
    shareable: bool = False
    """Backed by RDMA-capable chunks where the device has them (1.3): such a buffer grows through the daemon, never from
    a lease."""
    pending_bytes: int = 0
    """New chunks of a preserving defragment until the owner confirms its remap: committed and charged beside
    ``physical_bytes``. Needs no new minor: a peer that does not know it reads 0, as between defragments."""
    held_elsewhere: bool = False
    """Some of its memory is held only by the processes that map it (1.5): declared again by its client after the
    daemon restarted cold (:class:`Redeclare`). It is counted, but cannot be attached by another process."""
    tier: str = TIER_DEVICE
    """Where its mapped chunks are (1.6): :data:`TIER_DEVICE`, or :data:`TIER_HOST` once demoted (:class:`Move`)."""
    keep_orphan_s: float = 0.0
    """How long the daemon keeps it once no session holds it, then frees it (1.11); 0: until deleted."""
    orphaned_at: float = 0.0
    """Unix time it last became an orphan (1.11); 0 while a session holds it."""
    expires_at: float = 0.0
    """Unix time the daemon frees it, an orphan nobody attached or grafted by then (1.11); 0: never."""
    last_holder: str = ""
    """The client name of the session that last held it, an orphan (1.11); "" where the daemon does not know."""
    last_holder_pid: int = 0
    """That session's pid (1.11); 0 where the daemon does not know."""
    name_proof: str = ""
    """In a reply to the session that holds this persistent buffer, and only there (1.13): the proof that it held
    ``name``, which its process gives should it declare the buffer again after a cold restart
    (:attr:`Redeclare.name_proof`); empty elsewhere."""
    unsealed_since: float = 0.0
    """Unix time since which a persistent buffer of this user has held ``name`` unsealed (1.14), whichever sessions
    held it, and across a delete and a new buffer of the name soon after; 0 once sealed, for an anonymous buffer, or
    where the daemon does not know. What an engine waiting for a seal bounds its wait by: a holder could otherwise
    look new through each new session it hands the name to."""


@message("buffer.created")
class BufferCreated(Message):
    buffer: BufferInfo


@message("buffer.committed")
class Committed(Message):
    """Reply to commit, attach, graft and defragment: the buffer and the chunks to map now.

    Their FDs arrive in ``fd_batches`` :class:`FdBatch` datagrams.
    """

    buffer: BufferInfo
    chunks: list[ChunkInfo]
    fd_batches: int


@message("buffer.released")
class Released(Message):
    buffer: BufferInfo
    freed_bytes: int


@message("buffer.detached")
class Detached(Message):
    """Reply to :class:`Detach`: the buffer, now an orphan, and the bytes of an unfinished defragment's new chunks
    dropped."""

    buffer: BufferInfo
    freed_bytes: int


@message("buffer.sealed")
class Sealed(Message):
    """Reply to :class:`Seal`: the buffer, now immutable."""

    buffer: BufferInfo


@message("buffer.freed")
class Freed(Message):
    buffer_id: int
    freed_bytes: int


@message("buffer.create")
class CreateBuffer(Request[BufferCreated]):
    """Reserve a buffer of ``capacity`` bytes in ``num_segments`` segments; nothing is committed.

    ``shareable`` asks for RDMA-capable chunks where the backend has them.
    """

    capacity: int
    num_segments: int = 1
    name: str = ""
    persistent: bool = False
    shareable: bool = False
    segment_capacities: list[int] = dataclasses.field(default_factory=list)
    """Uneven segments (1.1): positive, summing to ``capacity``; ``num_segments`` is then ignored."""
    keep_orphan_s: float = 0.0
    """A persistent buffer's grace period as an orphan (1.11): the daemon frees it this many seconds after its
    session ends or detaches it, unless attached or grafted meanwhile; 0: kept until deleted."""


@message("buffer.redeclare")
class Redeclare(Request[BufferCreated]):
    """Declare again a buffer this process still maps, after its daemon restarted with nothing to keep its memory (1.5).

    A daemon restarted cold (no service manager's FD store, no
    ``--takeover``) knows no session or buffer of the one before; the memory
    lives on in the processes that map it. A client that finds its session
    gone opens a new one and declares each buffer it maps: its layout
    (``capacity``, ``segment_capacities``, ``segment_sizes``) and the chunks
    mapped (``chunks``: offset and size; ids are the daemon's to give).
    The daemon admits the bytes as it would a commit of them, charged to this
    session's tenant, and records the buffer as held elsewhere
    (:attr:`BufferInfo.held_elsewhere`): it grows, releases and defragments
    as any other, but cannot be attached by another process.

    ``readonly``: this process reads the sealed persistent buffer ``name`` of
    its user; the claim joins the buffer already declared under that name, or
    declares it, an orphan, for the owner to join.
    """

    max_list_items = MAX_DECLARED_CHUNKS

    capacity: int
    segment_capacities: list[int]
    segment_sizes: list[int]
    chunks: list[ChunkInfo]
    buffer_id: int = 0
    """The id the buffer had: kept where no buffer has it now, so that calls the client built before it started over
    still find it. Declared highest first, ids that have to change then move above every id the client had."""
    name: str = ""
    persistent: bool = False
    shareable: bool = False
    sealed: bool = False
    readonly: bool = False
    tier: str = TIER_DEVICE
    """Where the chunks are (1.6): a demoted buffer's are declared in the host tier, charged to the host budget."""
    name_proof: str = ""
    """The proof the buffer's last reply carried (:attr:`BufferInfo.name_proof`, 1.13) that the session this
    process starts over held ``name``: a persistent buffer of its own is declared again under its name only with it
    (a process that held a session of the uid could otherwise take the names of another's buffers first)."""


@message("buffer.commit")
class Commit(Request[Committed]):
    """Grow every segment's committed prefix to ``bytes_per_segment`` (grow-only).

    The new chunks' FDs arrive on the handle plane, in ``FdBatch`` datagrams
    tagged with this request's id, before the reply.
    """

    buffer_id: int
    bytes_per_segment: int


@message("buffer.commit_segments")
class CommitSegments(Request[Committed]):
    """Grow each segment's committed prefix to its own ``sizes[i]`` (grow-only, one size per segment; 1.1)."""

    buffer_id: int
    sizes: list[int]


@message("buffer.remap")
class Remap(Request[Committed]):
    """Send every chunk of the session's buffer again, to map: how a client whose mapping failed midway
    gets back to the daemon's record of the buffer (1.1)."""

    buffer_id: int


@message("buffer.release")
class Release(Request[Released]):
    """Drop every chunk of the buffer, keep the reservation (sleep)."""

    buffer_id: int


@message("buffer.free")
class Free(Request[Freed]):
    """Drop the buffer entirely."""

    buffer_id: int


@message("buffer.attach")
class Attach(Request[Committed]):
    """Take over an orphaned persistent buffer of this user by ``name``; every chunk comes back to map.

    ``readonly`` (1.2): instead, read a sealed buffer beside its owner and its
    other readers; the client maps it read-only. Readers are not charged for
    the memory; a read claim ends with :class:`Detach` (``readonly``) or the
    session. An unsealed buffer is refused.
    """

    name: str
    readonly: bool = False


@message("buffer.graft")
class Graft(Request[Committed]):
    """Take every chunk of this user's orphaned persistent buffer ``name``, with its data, into this session's buffer
    ``buffer_id``, each at the same offset of its segment (1.11); every chunk comes back to map.

    How a restarted engine adopts the memory its predecessor left: it made
    its own buffer first (the address its CUDA graphs captured), let go of
    every page of it, and maps the orphan's chunks in its place, without a
    copy. The two buffers have as many segments and the same ``shareable``;
    where their segment capacities differ (a restarted vLLM's reservation is
    a few blocks longer or shorter), each chunk must lie within its segment
    in both and the segments start on granules (hbmd 0.3.0 and older refuse any
    other capacities); ``buffer_id`` has nothing committed and is not sealed;
    the orphan is not sealed, on the device (not demoted) and not
    mid-defragment. Its bytes, charged already, are charged to this session's
    tenant from now on (its maximum and others' guarantees hold); its record
    and name are gone. Refused, with nothing changed: ``InvalidRequest``
    (layouts, a committed target, a sealed, demoted or busy orphan),
    ``NotFound`` (no such orphan of this user), ``Conflict`` (a live session
    holds it), ``OutOfBudget``.
    """

    buffer_id: int
    name: str


@message("buffer.detach")
class Detach(Request[Detached]):
    """Let go of this session's persistent buffer without deleting it (the opposite of :class:`Attach`).

    The buffer keeps its chunks and their data as an orphan that any session
    of this user attaches again by name. Anonymous buffers cannot be
    detached. Mid-defragment, the old chunks (the ones holding the data) stay
    and the new ones are dropped. The client unmaps the buffer first.

    ``readonly`` (1.2): drop one read claim on a sealed buffer instead.
    """

    buffer_id: int
    readonly: bool = False


@message("buffer.delete")
class Delete(Request[Freed]):
    """Free an orphaned persistent buffer by ``name``: this user's, or with ``owner_uid`` (protocol 1.2) that user's.

    Another user's buffer may be deleted by an admin only (root, the daemon's
    user, ``admin_uids``); ``owner_uid`` -1 means this user. A sealed buffer
    that sessions still read is refused (``Conflict`` naming them): their
    mappings would keep its pages alive outside the budget.
    """

    name: str
    owner_uid: int = -1


@message("buffer.seal")
class Seal(Request[Sealed]):
    """Make this session's persistent buffer immutable (1.2): commit, release and defragment are refused from now on,
    and any session of this user may attach it read-only, several at once. Sealing twice changes nothing."""

    buffer_id: int


@message("buffer.defragment")
class Defragment(Request[Committed]):
    """Re-back each committed run with one chunk.

    ``preserve``: the new chunks come beside the old ones; the client copies
    the data over, remaps, and sends :class:`FinishDefragment`. Otherwise the
    client has already unmapped the old chunks and their data is dropped.
    """

    buffer_id: int
    preserve: bool = True


@message("buffer.finish_defragment")
class FinishDefragment(Request[Released]):
    """The client remapped onto the new chunks of a preserving defragment or a :class:`Move` (``keep_new``) or gave
    up; the daemon drops the others."""

    buffer_id: int
    keep_new: bool = True


@message("buffer.move")
class Move(Request[Committed]):
    """Re-back the buffer's committed bytes with chunks in ``tier`` (1.6): demote to host memory, promote back.

    As a preserving defragment: the new chunks come beside the old ones,
    charged to ``tier``'s budget; the client copies the data over, remaps
    them at the same addresses, and sends :class:`FinishDefragment`, at which
    the daemon frees the old ones. Moving to the tier the buffer is in
    changes nothing and brings no chunks. A sealed buffer does not move: its
    readers map it too.
    """

    buffer_id: int
    tier: str
