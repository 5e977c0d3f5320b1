"""``ExtensibleTensor``: a growable byte buffer whose pages the daemon owns.

The buffer's whole capacity is reserved in this process's address space up
front; commits map more of it, so ``base_ptr`` and every view made from
:meth:`ExtensibleTensor.full_view` stay valid (and CUDA graphs captured over
them stay correct) as the buffer grows.
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import Any, Sequence

from hbmd.proto import BufferInfo, ChunkInfo

from .devices import parse_device
from .session import Client, default_client

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


class ExtensibleTensor:
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
    ``shareable`` is the older spelling of a non-zero value.

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
    ) -> None:
        if not isinstance(max_num_bytes, int) or isinstance(max_num_bytes, bool):
            raise ValueError(f"max_num_bytes must be an int, got {type(max_num_bytes).__name__}")
        capacities = _capacities(max_num_bytes, num_segments, segment_capacities)
        if export_handle_types & EXPORT_FABRIC:
            log.warning("hbmd serves POSIX-FD chunks; FABRIC handles are not supported, the FABRIC bit is ignored")
        self._bind(device, client)
        uneven = segment_capacities is not None and len(set(capacities)) > 1
        info = self._client.create_buffer(
            max_num_bytes,
            len(capacities),
            name=name or "",
            persistent=persistent,
            shareable=shareable or bool(export_handle_types),
            segment_capacities=capacities if uneven else None,
        )
        self._adopt(info)

    @classmethod
    def attach(cls, name: str, device: Any = None, *, client: Client | None = None) -> "ExtensibleTensor":
        """Map this user's persistent buffer ``name`` in this process, with its data and layout, without a copy.

        Raises ``NotFound`` for an unknown name and ``Conflict`` while another
        live session holds it.
        """
        self = cls.__new__(cls)
        self._bind(device, client)
        self._client.attach(name, self._map_chunk, on_reply=lambda reply: self._adopt(reply.buffer))
        return self

    def _bind(self, device: Any, client: Client | None) -> None:
        kind, index = parse_device(device)
        self._client = client if client is not None else default_client(device)
        served = "cpu" if self._client.backend == "host" else "cuda"
        if served != kind:
            raise ValueError(
                f"device {kind!r} cannot be served by instance {self._client.instance!r} ({self._client.backend} backend)"
            )
        self._device = (kind, index)

    def _adopt(self, info: BufferInfo) -> None:
        self._set_info(info)
        self._mapper = self._client.mapper
        try:
            self._base = self._mapper.reserve(info.reserved_bytes)
        except BaseException:
            self._client.free(info.buffer_id)
            raise
        self._mapped: list[tuple[int, int]] = []
        self._view: Any = None
        self._freed = False

    def _set_info(self, info: BufferInfo) -> None:
        """Take the daemon's view of the buffer (a daemon of protocol 1.0 sends no per-segment lists)."""
        self._info = info
        self._capacities = list(info.segment_capacities) or [info.segment_capacity_bytes] * info.num_segments
        self._sizes = list(info.segment_sizes) or [info.bytes_per_segment] * info.num_segments
        self._offsets = list(itertools.accumulate(self._capacities, initial=0))[:-1]

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
        return self._info.physical_bytes

    @property
    def num_chunks(self) -> int:
        return self._info.num_chunks

    @property
    def num_physical_chunks(self) -> int:
        """Chunks mapped in this process now."""
        return len(self._mapped)

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
            self._view = self._mapper.view(self._base, self._info.capacity_bytes)
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
        """For each segment, whether its first ``sizes[i]`` bytes lie inside one chunk (what RDMA registration needs)."""
        return [
            any(offset <= start and start + size <= offset + length for offset, length in self._mapped)
            for start, size in zip(self._offsets, sizes)
        ]

    # growth

    def resize_segments_(self, sizes: Sequence[int], zero_new: bool = False) -> "ExtensibleTensor":
        """Grow each segment's committed prefix to ``sizes[i]``; existing bytes are kept.

        With ``zero_new`` exactly the newly committed bytes read as zero.
        Raises ``ValueError`` for a list of the wrong length, when shrinking
        ("grow-only") or beyond a segment's capacity ("exceeds the segment
        capacity"); nothing changes then. The same sizes again are a no-op.
        """
        self._check_live()
        sizes = [int(n) for n in sizes]
        if len(sizes) != self.num_segments:
            raise ValueError(f"Expected {self.num_segments} sizes, got {len(sizes)}.")
        for new, old, capacity in zip(sizes, self._sizes, self._capacities):
            if new < old:
                raise ValueError(f"ExtensibleTensor is grow-only: cannot resize from {old} to {new} bytes per segment.")
            if new > capacity:
                raise ValueError(f"Requested {new} bytes per segment exceeds the segment capacity {capacity}.")
        old_sizes = self._sizes
        if sizes == old_sizes:
            return self
        if len(set(sizes)) == 1:
            reply = self._client.commit(self.buffer_id, sizes[0], self._map_chunk)
        else:
            reply = self._client.commit_segments(self.buffer_id, sizes, self._map_chunk)
        self._set_info(reply.buffer)
        if zero_new:
            for offset, old, new in zip(self._offsets, old_sizes, self._sizes):
                if new > old:
                    self._mapper.zero(self._base + offset + old, new - old)
            self._mapper.synchronize()
        return self

    def resize_per_segment_(self, bytes_per_segment: int, zero_new: bool = False) -> "ExtensibleTensor":
        """Grow every segment's committed prefix to ``bytes_per_segment`` (see :meth:`resize_segments_`)."""
        return self.resize_segments_([bytes_per_segment] * self.num_segments, zero_new)

    def zero_(self) -> "ExtensibleTensor":
        """Zero every committed byte."""
        self._check_live()
        for offset, size in zip(self._offsets, self._sizes):
            self._mapper.zero(self._base + offset, size)
        self._mapper.synchronize()
        return self

    def _map_chunk(self, chunk: ChunkInfo, fd: int) -> None:
        self._mapper.map(self._base + chunk.offset, chunk, fd)
        self._mapped.append((chunk.offset, chunk.size))

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

    # defragment

    def defragment(self, preserve: bool = True) -> "ExtensibleTensor":
        """Re-back each segment's committed prefix with one chunk, at the same addresses.

        ``preserve``: each new chunk is mapped at a temporary address, the data
        copied into it, then mapped in place of the old chunks; the daemon
        drops the old chunks only once told the remap is done, so a worker
        killed mid-way loses nothing (this needs budget for both at once).
        Otherwise the old chunks go first and the contents are undefined:
        what an engine does right after warm-up, before RDMA registration.
        """
        self._check_live()
        if not preserve:
            self._unmap_all()
            self._set_info(self._client.defragment(self.buffer_id, False, self._map_chunk).buffer)
            return self
        fresh: list[tuple[ChunkInfo, int]] = []
        try:
            self._client.defragment(self.buffer_id, True, lambda chunk, fd: fresh.append((chunk, os.dup(fd))))
            if fresh:
                self._move_into(fresh)
        finally:
            for _, fd in fresh:
                os.close(fd)
        return self

    def _move_into(self, fresh: list[tuple[ChunkInfo, int]]) -> None:
        """Copy the data into the new chunks, remap them in place of the old, and confirm."""
        try:
            for chunk, fd in fresh:
                scratch = self._mapper.reserve(chunk.size)
                try:
                    self._mapper.map(scratch, chunk, fd)
                    self._mapper.synchronize()
                    self._mapper.copy(scratch, self._base + chunk.offset, chunk.size)
                    self._mapper.unmap(scratch, chunk.size)
                finally:
                    self._mapper.unreserve(scratch, chunk.size)
        except BaseException:
            self._client.finish_defragment(self.buffer_id, keep_new=False)
            raise
        # From here the new chunks hold the data: the daemon keeps them whatever happens next.
        try:
            self._unmap_all()
            for chunk, fd in fresh:
                self._map_chunk(chunk, fd)
        finally:
            self._set_info(self._client.finish_defragment(self.buffer_id, keep_new=True).buffer)

    # sleep and teardown

    def release_physical(self) -> None:
        """Drop every page but keep the address range and the views (sleep).

        The mappings go first, then the daemon is told, so no page is freed
        while this process can still reach it.
        """
        self._check_live()
        self._unmap_all()
        self._set_info(self._client.release(self.buffer_id).buffer)

    def free(self) -> None:
        """Drop the pages, the daemon's buffer and the address range. Idempotent."""
        if self._freed:
            return
        self._freed = True
        self._unmap_all()
        self._view = None
        self._mapper.unreserve(self._base, self._info.reserved_bytes)
        if not self._client.closed:
            self._client.free(self.buffer_id)

    def _unmap_all(self) -> None:
        self._mapper.synchronize()
        for offset, size in self._mapped:
            self._mapper.unmap(self._base + offset, size)
        self._mapped = []

    def _check_live(self) -> None:
        if self._freed:
            raise ValueError("this ExtensibleTensor was freed")

    def _check_single_segment(self, what: str) -> None:
        if self.num_segments != 1:
            raise ValueError(f"{what} needs a single-segment buffer; this one has {self.num_segments} segments")

    def __repr__(self) -> str:
        return (
            f"ExtensibleTensor(buffer {self.buffer_id} on {self._client.instance}, "
            f"{self.num_bytes}/{self.max_num_bytes} bytes in {self.num_segments} segments, {self.num_chunks} chunks)"
        )
