"""``ExtensibleKVCacheBuffers``: the KV-cache buffers of an engine, grown block by block together."""

from __future__ import annotations

from hbmd.proto import TIER_HOST
from hbmd.proto.units import exact_bytes

from .tensor import ExtensibleTensor


class ExtensibleKVCacheBuffers:
    """Several :class:`ExtensibleTensor` sized in KV blocks, committed in lockstep.

    ``buffers`` is a list of ``(tensor, bytes_per_block_per_segment)``,
    the second an int for every segment alike or a list with one stride per
    segment (uneven segments, one per layer); nothing is committed at
    construction. Over attached buffers, which arrive committed,
    ``num_blocks_committed`` starts at the blocks every buffer already holds.
    """

    def __init__(self, buffers: list[tuple[ExtensibleTensor, int | list[int]]], num_blocks_capacity: int) -> None:
        if num_blocks_capacity < 0:
            raise ValueError(f"num_blocks_capacity {num_blocks_capacity} is negative")
        for tensor, per_block in buffers:
            for stride, capacity in zip(_strides(tensor, per_block), tensor.segment_capacities):
                if stride <= 0:
                    raise ValueError(f"bytes per block per segment must be positive, got {stride}")
                if stride * num_blocks_capacity > capacity:
                    raise ValueError(
                        f"{num_blocks_capacity} blocks of {exact_bytes(stride)} exceed the segment capacity of "
                        f"{exact_bytes(capacity)}"
                    )
        self.buffers = buffers
        self.num_blocks_capacity = num_blocks_capacity
        self.num_blocks_committed = min(
            (
                size // stride
                for t, per_block in buffers
                for size, stride in zip(t.segment_sizes, _strides(t, per_block))
            ),
            default=0,
        )
        self._blocks_before_release = 0

    def commit(self, num_blocks: int, defragment: bool = False, preserve: bool = False) -> None:
        """Grow every buffer to hold ``num_blocks`` blocks (new blocks read as zero); a smaller request is ignored.

        ``defragment`` then re-backs each segment prefix with one chunk: by
        default discarding the data (the blocks read as zero again), as meant
        for right after warm-up; with ``preserve`` keeping it.
        """
        if num_blocks > self.num_blocks_capacity:
            raise ValueError(f"{num_blocks} blocks exceed the capacity of {self.num_blocks_capacity} blocks")
        if num_blocks > self.num_blocks_committed:
            for tensor, per_block in self.buffers:
                tensor.resize_segments_([num_blocks * stride for stride in _strides(tensor, per_block)], zero_new=True)
            self.num_blocks_committed = num_blocks
        if defragment:
            for tensor, _ in self.buffers:
                tensor.defragment(preserve=preserve)
                if not preserve:
                    tensor.zero_()

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block costs across every buffer and segment (what sizing divides by)."""
        return sum(sum(_strides(tensor, per_block)) for tensor, per_block in self.buffers)

    @property
    def physical_bytes(self) -> int:
        return sum(tensor.physical_bytes for tensor, _ in self.buffers)

    def release_physical(self, keep: bool = False) -> None:
        """Drop every buffer's pages, keep the address ranges; :meth:`recommit` restores the size.

        ``keep``: demote the pages to the daemon's host tier instead, with
        their data (:meth:`ExtensibleTensor.demote`); the blocks stay committed.
        """
        for tensor, _ in self.buffers:
            tensor.release_physical(keep)
        if keep:
            return
        self._blocks_before_release = max(self._blocks_before_release, self.num_blocks_committed)
        self.num_blocks_committed = 0

    def recommit(self) -> None:
        """Commit again the block count held before :meth:`release_physical`, with zeroed pages; buffers demoted by
        ``release_physical(keep=True)`` come back to the device with their data."""
        for tensor, _ in self.buffers:
            if tensor.tier == TIER_HOST:
                tensor.promote()
        self.commit(self._blocks_before_release)
        self._blocks_before_release = 0

    def free(self) -> None:
        for tensor, _ in self.buffers:
            tensor.free()
        self.num_blocks_committed = 0


def _strides(tensor: ExtensibleTensor, per_block: int | list[int]) -> list[int]:
    """Bytes one block takes in each of ``tensor``'s segments."""
    if isinstance(per_block, int):
        return [per_block] * tensor.num_segments
    if len(per_block) != tensor.num_segments:
        raise ValueError(f"{len(per_block)} block strides for {tensor.num_segments} segments")
    return list(per_block)
