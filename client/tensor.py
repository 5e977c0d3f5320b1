"""``ExtensibleTensor``: a growable byte buffer whose pages the daemon owns.

The buffer's whole capacity is reserved in this process's address space up
front; commits map more of it, so ``base_ptr`` and every view made from
:meth:`ExtensibleTensor.full_view` stay valid (and CUDA graphs captured over
them stay correct) as the buffer grows.
"""

from __future__ import annotations

import os
from typing import Any

from hbmd.proto import BufferInfo, ChunkInfo

from .devices import parse_device
from .session import Client, default_client


class ExtensibleTensor:
    """A reserved range of ``max_num_bytes`` in ``num_segments`` equal segments, committed on demand.

    Drop-in for the in-process class of the same name: segments grow in
    lockstep (:meth:`resize_per_segment_`), pages can be dropped and the
    range kept (:meth:`release_physical`), and :meth:`free` returns
    everything. Raises ``ValueError`` for a negative or zero size, a
    non-positive segment count, a size not divisible by the segment count,
    or a device other than ``cpu``/``cuda``.
    """

    def __init__(
        self,
        max_num_bytes: int,
        device: Any = None,
        num_segments: int = 1,
        shareable: bool = False,
        *,
        client: Client | None = None,
        name: str | None = None,
        persistent: bool = False,
    ) -> None:
        if not isinstance(max_num_bytes, int) or isinstance(max_num_bytes, bool):
            raise ValueError(f"max_num_bytes must be an int, got {type(max_num_bytes).__name__}")
        if max_num_bytes <= 0:
            raise ValueError(f"max_num_bytes must be positive, got {max_num_bytes}")
        if not isinstance(num_segments, int) or num_segments <= 0:
            raise ValueError(f"num_segments must be a positive int, got {num_segments!r}")
        if max_num_bytes % num_segments:
            raise ValueError(f"max_num_bytes {max_num_bytes} is not divisible by num_segments {num_segments}")
        self._bind(device, client)
        info = self._client.create_buffer(
            max_num_bytes, num_segments, name=name or "", persistent=persistent, shareable=shareable
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
        self._info = info
        self._mapper = self._client.mapper
        try:
            self._base = self._mapper.reserve(info.reserved_bytes)
        except BaseException:
            self._client.free(info.buffer_id)
            raise
        self._mapped: list[tuple[int, int]] = []
        self._view: Any = None
        self._freed = False

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
        return self._info.num_segments

    @property
    def segment_capacity_bytes(self) -> int:
        return self._info.segment_capacity_bytes

    @property
    def bytes_per_segment(self) -> int:
        return self._info.bytes_per_segment

    @property
    def num_bytes(self) -> int:
        """Committed bytes, summed over segments."""
        return self._info.bytes_per_segment * self._info.num_segments

    @property
    def max_num_bytes(self) -> int:
        return self._info.capacity_bytes

    @property
    def capacity_bytes(self) -> int:
        """The reservation, rounded up to granules."""
        return self._info.reserved_bytes

    @property
    def physical_bytes(self) -> int:
        """Bytes actually backed by chunks (granule-rounded)."""
        return self._info.physical_bytes

    @property
    def num_chunks(self) -> int:
        return self._info.num_chunks

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

    @property
    def tensor(self) -> Any:
        """The committed prefix (single-segment buffers only)."""
        self._check_single_segment("tensor")
        return self.full_view()[: self.num_bytes]

    # growth

    def resize_per_segment_(self, bytes_per_segment: int, zero_new: bool = False) -> "ExtensibleTensor":
        """Grow every segment's committed prefix to ``bytes_per_segment``; existing bytes are kept.

        With ``zero_new`` the newly committed bytes read as zero. Raises
        ``ValueError`` when shrinking ("grow-only") or beyond the segment
        capacity ("exceeds the segment capacity").
        """
        self._check_live()
        old = self._info.bytes_per_segment
        if bytes_per_segment == old:
            return self
        reply = self._client.commit(self.buffer_id, bytes_per_segment, self._map_chunk)
        self._info = reply.buffer
        if zero_new:
            self._zero_prefixes(old)
        return self

    def _zero_prefixes(self, start: int) -> None:
        """Zero bytes ``[start, bytes_per_segment)`` of every segment."""
        seg, end = self._info.segment_capacity_bytes, self._info.bytes_per_segment
        for i in range(self.num_segments):
            self._mapper.zero(self._base + i * seg + start, end - start)
        self._mapper.synchronize()

    def zero_(self) -> "ExtensibleTensor":
        """Zero every committed byte."""
        self._check_live()
        self._zero_prefixes(0)
        return self

    def _map_chunk(self, chunk: ChunkInfo, fd: int) -> None:
        self._mapper.map(self._base + chunk.offset, chunk, fd)
        self._mapped.append((chunk.offset, chunk.size))

    def resize_(self, num_bytes: int, zero_new: bool = False) -> "ExtensibleTensor":
        """Grow a single-segment buffer to ``num_bytes`` committed bytes."""
        self._check_single_segment("resize_")
        return self.resize_per_segment_(num_bytes, zero_new)

    def append(self, num_bytes: int, zero_new: bool = False) -> Any:
        """Commit ``num_bytes`` more (single-segment only); returns a view of the new bytes."""
        self._check_single_segment("append")
        start = self.num_bytes
        self.resize_per_segment_(start + num_bytes, zero_new)
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
            self._info = self._client.defragment(self.buffer_id, False, self._map_chunk).buffer
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
            self._info = self._client.finish_defragment(self.buffer_id, keep_new=True).buffer

    # sleep and teardown

    def release_physical(self) -> None:
        """Drop every page but keep the address range and the views (sleep).

        The mappings go first, then the daemon is told, so no page is freed
        while this process can still reach it.
        """
        self._check_live()
        self._unmap_all()
        self._info = self._client.release(self.buffer_id).buffer

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
            f"{self.bytes_per_segment}/{self.segment_capacity_bytes} bytes x {self.num_segments} segments, "
            f"{self.num_chunks} chunks)"
        )
