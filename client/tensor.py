"""``ExtensibleTensor``: a growable byte buffer whose pages the daemon owns.

The buffer's whole capacity is reserved in this process's address space up
front; commits map more of it, so ``base_ptr`` and every view made from
:meth:`ExtensibleTensor.full_view` stay valid (and CUDA graphs captured over
them stay correct) as the buffer grows.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from hbmd.proto import TIER_HOST, BufferInfo
from hbmd.proto.errors import HbmdError, SessionLost, TensorUnusable
from hbmd.proto.undo import Undo
from hbmd.proto.units import exact_bytes

from .devices import parse_device
from .moves import Moves
from .opening import default_client
from .reservation import Reservation
from .session import Client

EXPORT_POSIX_FD = 0x1
EXPORT_FABRIC = 0x8
"""``export_handle_types`` bits, as the driver and vLLM number them."""

log = logging.getLogger("hbmd.client")


def _capacities(max_num_bytes: int, num_segments: int, segment_capacities: Sequence[int] | None) -> list[int]:
    """The segment capacities, checked as vLLM's class checks them (same order, same words)."""
    if max_num_bytes < 0:
        raise ValueError("max_num_bytes must be non-negative.")
    if segment_capacities is None:
        if num_segments < 1:
            raise ValueError(f"num_segments must be positive, got {num_segments}.")
        if max_num_bytes % num_segments:
            raise ValueError(f"max_num_bytes ({max_num_bytes}) must be divisible by num_segments ({num_segments}).")
        capacities = [max_num_bytes // num_segments] * num_segments
    else:
        capacities = [int(c) for c in segment_capacities]
        if not capacities or min(capacities) <= 0:
            raise ValueError("segment_capacities must be non-empty and positive.")
        if sum(capacities) != max_num_bytes:
            raise ValueError(f"segment_capacities sum to {sum(capacities)}, not max_num_bytes ({max_num_bytes}).")
    if max_num_bytes == 0:
        raise ValueError("max_num_bytes must be positive: an hbmd buffer reserves at least one granule")
    return capacities


def _uniform(values: list[int]) -> int:
    if len(set(values)) != 1:
        raise ValueError(f"Segments differ: {values}.")
    return values[0]


class ExtensibleTensor(Moves):
    """A reserved range of ``max_num_bytes`` in segments laid back to back, each committed as a prefix on demand.

    Stands in for vLLM's ``vllm.utils.extensible_tensor.ExtensibleTensor``
    (0.34) with the same constructor, methods, properties and errors, and
    keeps the earlier snapshot's single-segment API (``resize_`` and
    ``append`` return tensors, ``tensor`` is the committed prefix); the
    pages belong to the hbmd daemon. Segments are ``num_segments`` equal ones
    or ``segment_capacities`` bytes each (their offsets are the running sums,
    not granule-aligned: a granule two segments share is backed once).

    ``export_handle_types``: every hbmd chunk is exportable as a POSIX FD
    (``EXPORT_POSIX_FD``), and a non-zero value asks for RDMA-capable chunks
    where the GPU has them, for KV connectors that register the memory.
    FABRIC handles (``EXPORT_FABRIC``) are not served: the daemon's chunks
    travel as FDs, so the bit is ignored with a warning and the chunks are
    POSIX-FD ones, as vLLM falls back where FABRIC allocation fails.
    ``shareable`` is the older spelling of a non-zero value. A persistent buffer
    left an orphan is freed after ``keep_orphan_s`` seconds unless attached or
    grafted (:meth:`graft`); 0 keeps it until deleted.

    Raises ``ValueError`` as vLLM's class does for a negative size, a
    non-positive segment count, a size not divisible by it, or
    ``segment_capacities`` empty, non-positive or not summing to the size;
    also for a zero size and a device other than ``cpu``/``cuda``.
    """

    def __init__(
        self,
        max_num_bytes: int,
        device: Any = None,
        num_segments: int = 1,
        segment_capacities: Sequence[int] | None = None,
        export_handle_types: int = 0,
        *,
        client: Client | None = None,
        name: str | None = None,
        persistent: bool = False,
        shareable: bool = False,
        keep_orphan_s: float = 0.0,
    ) -> None:
        if not isinstance(max_num_bytes, int) or isinstance(max_num_bytes, bool):
            raise ValueError(f"max_num_bytes must be an int, got {type(max_num_bytes).__name__}")
        capacities = _capacities(max_num_bytes, num_segments, segment_capacities)
        if export_handle_types & EXPORT_FABRIC:
            log.warning("hbmd serves POSIX-FD chunks; FABRIC handles are not supported, the FABRIC bit is ignored")
        self._bind(device, client)
        uneven = segment_capacities is not None and len(set(capacities)) > 1
        with Undo() as undo:
            info = self._client.create_buffer(
                max_num_bytes,
                len(capacities),
                name=name or "",
                persistent=persistent,
                shareable=shareable or bool(export_handle_types),
                segment_capacities=capacities if uneven else None, keep_orphan_s=keep_orphan_s,
            )
            undo.push(self._client.free, info.buffer_id)
            self._adopt(info)

    @classmethod
    def attach(
        cls, name: str, device: Any = None, *, client: Client | None = None, readonly: bool = False
    ) -> ExtensibleTensor:
        """Map this user's persistent buffer ``name`` in this process, with its data and layout, without a copy.

        ``readonly``: read the sealed buffer ``name`` (see :meth:`seal`) beside
        its owner and any other readers; it is mapped read-only, so a write
        through a view faults (SIGSEGV on the host, an illegal-address error
        on a GPU), and only views, :meth:`detach` and :meth:`free` (both let go
        of the read claim, never of the buffer) are allowed.

        Raises ``NotFound`` for an unknown name, ``Conflict`` while another
        live session holds it (read-write), ``InvalidRequest`` for a
        read-only attach of a buffer that is not sealed.
        """
        self = cls.__new__(cls)
        self._readonly = readonly
        self._bind(device, client)
        # On a failure the buffer and its data stay the daemon's: let go of it (never free it) and of what was mapped.
        with Undo() as undo, self._client.attach(name, readonly=readonly) as delivery:
            undo.push(self._client.detach, delivery.reply.buffer.buffer_id, readonly)
            self._adopt(delivery.reply.buffer)
            undo.push(self._drop_mappings)
            self._map_all(delivery)
        return self

    def _bind(self, device: Any, client: Client | None) -> None:
        kind, index = parse_device(device)
        self._client = client if client is not None else default_client(device)
        served = "cpu" if self._client.backend == "host" else "cuda"
        if served != kind:
            raise ValueError(
                f"device {kind!r} cannot be served by instance {self._client.instance!r} "
                f"({self._client.backend} backend)"
            )
        self._device = (kind, index)

    _readonly = False
    """Mapped read-only: a read claim on a sealed buffer, not its ownership."""
    _sizes_before_release: list[int] | None = None
    """What :meth:`recommit` grows the segments back to: their sizes before :meth:`release_physical`."""

    def _adopt(self, info: BufferInfo) -> None:
        self._set_info(info)
        self._mapper = self._client.mapper
        self._view: Any = None
        self._freed = False
        self._unusable: TensorUnusable | None = None
        self._reservation = Reservation(self._mapper, info.reserved_bytes)
        self._base = self._reservation.base
        self._recorded = True
        """Whether the daemon records the buffer (it refused to count it again after a restart that kept nothing)."""
        self._client.holds(self)

    # properties

    @property
    def buffer_id(self) -> int:
        return self._info.buffer_id

    @property
    def name(self) -> str:
        return self._info.name

    @property
    def persistent(self) -> bool:
        return self._info.persistent

    @property
    def sealed(self) -> bool:
        """Immutable: the daemon refuses commit, release and defragment (see :meth:`seal`)."""
        return self._info.sealed

    @property
    def readonly(self) -> bool:
        """Mapped read-only in this process (attached with ``readonly=True``)."""
        return self._readonly

    @property
    def num_segments(self) -> int:
        return len(self._capacities)

    @property
    def segment_capacities(self) -> list[int]:
        return list(self._capacities)

    @property
    def segment_offsets(self) -> list[int]:
        """Where each segment starts: the running sum of the capacities before it."""
        return list(self._offsets)

    @property
    def segment_sizes(self) -> list[int]:
        """Committed bytes of each segment."""
        return list(self._sizes)

    @property
    def segment_capacity_bytes(self) -> int:
        """The capacity all segments share; ``ValueError`` where they differ."""
        return _uniform(self._capacities)

    @property
    def bytes_per_segment(self) -> int:
        """The committed size all segments share; ``ValueError`` where they differ."""
        return _uniform(self._sizes)

    @property
    def num_bytes(self) -> int:
        """Committed bytes, summed over segments."""
        return sum(self._sizes)

    @property
    def max_num_bytes(self) -> int:
        return self._info.capacity_bytes

    @property
    def capacity_bytes(self) -> int:
        """The reservation, rounded up to granules."""
        return self._info.reserved_bytes

    @property
    def physical_bytes(self) -> int:
        """Bytes actually backed by chunks (granule-rounded; a granule two segments share counts once)."""
        return self._physical_bytes

    @property
    def num_chunks(self) -> int:
        return self._num_chunks

    @property
    def tier(self) -> str:
        """Where the pages are: ``"device"``, or ``"host"`` once :meth:`demote` moved them to the daemon's host tier."""
        return self._info.tier

    @property
    def num_physical_chunks(self) -> int:
        """Chunks mapped in this process now."""
        return 0 if self._freed else len(self._reservation.mapped)

    @property
    def granularity(self) -> int:
        return self._client.granularity

    @property
    def base_ptr(self) -> int:
        return self._base

    @property
    def device(self) -> Any:
        kind, index = self._device
        try:
            import torch
        except ImportError:
            return kind if index < 0 else f"{kind}:{index}"
        return torch.device(kind) if index < 0 else torch.device(kind, index)

    @property
    def client(self) -> Client:
        return self._client

    # views

    def full_view(self) -> Any:
        """A ``torch.uint8`` tensor over the whole capacity; its ``data_ptr()`` never changes.

        Bytes outside the committed prefixes are not mapped: touching them faults.
        """
        self._check_live()
        if self._view is None:
            self._view = self._mapper.view(self._base, self._info.capacity_bytes, self._reservation)
        return self._view

    def segment_view(self, index: int) -> Any:
        """A ``torch.uint8`` tensor over segment ``index``'s committed prefix; ``IndexError`` out of range."""
        if not 0 <= index < self.num_segments:
            raise IndexError(f"Segment {index} out of range ({self.num_segments}).")
        start = self._offsets[index]
        return self.full_view()[start : start + self._sizes[index]]

    @property
    def tensor(self) -> Any:
        """The committed prefix (single-segment buffers only)."""
        self._check_single_segment("tensor")
        return self.full_view()[: self.num_bytes]

    def segments_backed_by_one_chunk(self, sizes: Sequence[int]) -> list[bool]:
        """For each segment, whether its first ``sizes[i]`` bytes lie in one chunk (what RDMA registration needs)."""
        if self._freed:
            return [False] * len(sizes)
        return [self._reservation.in_one_chunk(start, size) for start, size in zip(self._offsets, sizes)]

    # growth

    def resize_segments_(self, sizes: Sequence[int], zero_new: bool = False) -> ExtensibleTensor:
        """Grow each segment's committed prefix to ``sizes[i]``; existing bytes are kept.

        With ``zero_new`` exactly the newly committed bytes read as zero.
        Raises ``ValueError`` for a list of the wrong length, when shrinking
        ("grow-only") or beyond a segment's capacity ("exceeds the segment
        capacity"); nothing changes then. The same sizes again are a no-op.
        """
        self._check_writable("resize")
        sizes = [int(n) for n in sizes]
        if len(sizes) != self.num_segments:
            raise ValueError(f"Expected {self.num_segments} sizes, got {len(sizes)}.")
        for new, old, capacity in zip(sizes, self._sizes, self._capacities):
            if new < old:
                raise ValueError(
                    f"ExtensibleTensor is grow-only: cannot resize from {exact_bytes(old)} to {exact_bytes(new)} per "
                    "segment."
                )
            if new > capacity:
                raise ValueError(
                    f"Requested {exact_bytes(new)} per segment exceeds the segment capacity {exact_bytes(capacity)}."
                )
        old_sizes = self._sizes
        if sizes == old_sizes:
            return self
        zero = (lambda new_sizes: self._zero_gained(old_sizes, new_sizes)) if zero_new else None
        if not self._grow_from_lease(sizes, zero):
            self._grow_through_daemon(sizes)
            if zero is not None:
                zero(self._sizes)
        if zero is not None:
            self._mapper.synchronize()
        return self

    def _zero_gained(self, old_sizes: list[int], new_sizes: list[int]) -> None:
        """Queue the zeroing of what each segment gained from ``old_sizes`` to ``new_sizes``; :meth:`Mapper.synchronize`
        waits for it."""
        for offset, old, new in zip(self._offsets, old_sizes, new_sizes):
            if new > old:
                self._mapper.zero(self._base + offset + old, new - old)

    def resize_per_segment_(self, bytes_per_segment: int, zero_new: bool = False) -> ExtensibleTensor:
        """Grow every segment's committed prefix to ``bytes_per_segment`` (see :meth:`resize_segments_`)."""
        return self.resize_segments_([bytes_per_segment] * self.num_segments, zero_new)

    def zero_(self) -> ExtensibleTensor:
        """Zero every committed byte."""
        self._check_writable("zero_")
        for offset, size in zip(self._offsets, self._sizes):
            self._mapper.zero(self._base + offset, size)
        self._mapper.synchronize()
        return self

    def resize_(self, num_bytes: int, zero_new: bool = False) -> Any:
        """Grow a single-segment buffer to ``num_bytes`` committed bytes; returns the committed prefix."""
        self._check_single_segment("resize_")
        self.resize_segments_([num_bytes], zero_new)
        return self.tensor

    def append(self, num_bytes: int, zero_new: bool = False) -> Any:
        """Commit ``num_bytes`` more (single-segment only); returns a view of the new bytes."""
        self._check_single_segment("append")
        start = self.num_bytes
        self.resize_segments_([start + num_bytes], zero_new)
        return self.full_view()[start : start + num_bytes]

    # sharing

    def seal(self) -> ExtensibleTensor:
        """Make this persistent buffer immutable and readable by every session of this user at once.

        What a loader does once the bytes are written (model weights, say):
        any number of processes then ``attach(name, readonly=True)`` it beside
        this one. From here the daemon refuses commit, release and defragment
        of it (``InvalidRequest``); it is charged to this session's tenant
        only, and outlives this session as an orphan its readers keep using.
        This process's mapping turns read-only as well (the readers' are
        read-only from the start): a write after sealing faults here too.
        Sealing twice is a no-op; an anonymous buffer raises ``InvalidRequest``.
        """
        self._check_writable("seal")
        self._mapper.synchronize()
        self._set_info(self._client.seal(self.buffer_id).buffer)
        self._reservation.protect()
        return self

    # sleep and teardown

    def release_physical(self, keep: bool = False) -> None:
        """Drop every page but keep the address range and the views (sleep).

        The mappings go first, then the daemon is told, so no page is freed
        while this process can still reach it. ``keep``: the sleep that keeps
        the data: the pages are demoted to the host tier instead (see
        :meth:`demote`), and :meth:`recommit` promotes them back.
        """
        if keep:
            self.demote()
            return
        self._check_writable("release_physical")
        held = self.segment_sizes
        self._reservation.unmap_all()
        try:
            released = self._client.release(self.buffer_id)
        except HbmdError as exc:
            # Refused: the daemon still holds the chunks, so they are mapped back and the tensor is as it was.
            self._resync(exc)
            raise
        self._set_info(released.buffer)
        self._sizes_before_release = [max(a, b) for a, b in zip(self._sizes_before_release or held, held)]

    def recommit(self) -> ExtensibleTensor:
        """Commit again, with zeroed pages, the segment sizes held before :meth:`release_physical` (wake); a buffer
        demoted by ``release_physical(keep=True)`` is promoted back first, its data kept.

        As :meth:`ExtensibleKVCacheBuffers.recommit` does for its buffers:
        after several releases the largest sizes come back, and a segment
        grown meanwhile is not shrunk. Without a release before (in this
        object: a buffer attached released has no sizes to go back to) it is
        a no-op. Raises as :meth:`resize_segments_` does (``OutOfBudget`` when
        the pages do not fit); the sizes stay remembered for a second try.
        """
        self._check_writable("recommit")
        if self.tier == TIER_HOST:
            self.promote()
        if self._sizes_before_release is not None:
            self.resize_segments_([max(a, b) for a, b in zip(self._sizes, self._sizes_before_release)], zero_new=True)
            self._sizes_before_release = None
        return self

    def free(self) -> None:
        """Drop the pages and the daemon's buffer (a read-only attach: only its read claim). Idempotent.

        The address range goes back once no view of it is left (see
        :class:`Reservation`): touching a view after ``free()`` faults, and
        after ``release_physical()`` it is undefined until the next commit.
        Every method but ``free`` raises ``ValueError`` afterwards.
        """
        if self._freed:
            return
        # The daemon first, so that a refusal (a sealed buffer others still read) leaves this tensor whole and
        # a second free() asks again; the pages it drops stay alive until unmapped just below. A session the
        # daemon ended (it stopped or restarted) has nothing left to free there: only the mappings go.
        if self._recorded and not self._client.closed:
            try:
                if self._readonly:
                    # A reader never owned the buffer: it only lets go of its read claim.
                    self._client.detach(self.buffer_id, readonly=True)
                else:
                    self._client.free(self.buffer_id)
            except SessionLost:
                pass
        self._freed = True
        self._drop_mappings()

    def detach(self) -> None:
        """Let go of this persistent buffer without deleting it: unmap it here, leave it to be attached again.

        What an engine does at shutdown; ``ExtensibleTensor.attach(name)``
        takes it back with its data. The tensor is unusable afterwards, as
        after :meth:`free`.
        """
        self._check_live()
        # This process's writes finish before the daemon lets another attach it; the unmap waits for the
        # daemon's answer, so that a refusal (an anonymous buffer) leaves this tensor usable.
        self._mapper.synchronize()
        self._client.detach(self.buffer_id, readonly=self._readonly)
        self._freed = True
        self._drop_mappings()

    def _drop_mappings(self) -> None:
        """Unmap everything and leave the address range to its :class:`Reservation` to give back."""
        self._client.lets_go(self)
        self._reservation.free()
        self._view = None
        del self._reservation  # the views that are left hold it; the last one gives the range back

    def _check_single_segment(self, what: str) -> None:
        if self.num_segments != 1:
            raise ValueError(f"{what} needs a single-segment buffer; this one has {self.num_segments} segments")

    def __repr__(self) -> str:
        return (
            f"ExtensibleTensor(buffer {self.buffer_id} on {self._client.instance}, "
            f"{self.num_bytes}/{self.max_num_bytes} bytes in {self.num_segments} segments, {self.num_chunks} chunks)"
        )
