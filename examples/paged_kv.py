"""The engine's paged KV cache in hbmd memory, and the block tables that say which blocks hold a sequence.

One K/V-split buffer per decoder layer, laid out ``(2, num_blocks,
block_size, kv_heads, head_dim)``: the two dimensions before the block
dimension make it a 2-segment buffer (K and V each grow block by block). All
layers' buffers are grouped in one :class:`ExtensibleKVCacheBuffers`, so a
commit, a release or a recommit moves every layer together.

Why one buffer per layer and not one shared by all layers: it is the layout
vLLM gives its extensible KV cache (a tensor per attention layer, each
registered on its own with a KV connector, layers free to differ in shape in
hybrid models), and every layer's view is a plain tensor with the block
dimension second. The price is one daemon request per layer for a commit or
an attach, which the resume timing includes.
"""

from __future__ import annotations

import math

import torch
from decoder import DecoderConfig
from hbmd.client import (
    Client,
    ExtensibleKVCacheBuffers,
    ExtensibleTensor,
    bytes_per_block_per_segment,
    kv_view,
    narrow_blocks,
    num_segments,
)

STRIDE_ORDER = (0, 1, 2, 3, 4)
"""Logical order is physical order: K and V are the outer (segment) dimension."""
BLOCK_DIM = 1


def layer_shape(config: DecoderConfig, num_blocks: int) -> tuple[int, ...]:
    return (2, num_blocks, config.block_size, config.num_kv_heads, config.head_dim)


def buffer_name(engine: str, layer: int) -> str:
    """The persistent buffer of one layer of an engine's cache: what ``attach`` looks for after a crash."""
    return f"{engine}-kv-layer{layer}"


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _layout(config: DecoderConfig, dtype: torch.dtype) -> tuple[int, int]:
    """Segments per layer buffer and bytes one block takes in each segment."""
    shape = layer_shape(config, 1)
    return (
        num_segments(shape, STRIDE_ORDER, BLOCK_DIM),
        bytes_per_block_per_segment(shape, STRIDE_ORDER, BLOCK_DIM, _itemsize(dtype)),
    )


class PagedKVCache:
    """Every layer's KV cache in hbmd buffers; ``layers[i]`` is layer i's full-capacity view.

    The views span the whole reservation and keep their base pointers for the
    cache's life, through growth, release and recommit: a decode step captured
    in a CUDA graph over them stays valid. Only blocks below
    :attr:`num_blocks` are backed; the block tables never point higher.
    """

    def __init__(
        self, config: DecoderConfig, dtype: torch.dtype, tensors: list[ExtensibleTensor], num_blocks_capacity: int
    ) -> None:
        _, per_block = _layout(config, dtype)
        self.config = config
        self.tensors = tensors
        self.layers = [kv_view(t, layer_shape(config, num_blocks_capacity), STRIDE_ORDER, dtype) for t in tensors]
        self.buffers = ExtensibleKVCacheBuffers([(t, per_block) for t in tensors], num_blocks_capacity)

    @staticmethod
    def bytes_per_block(config: DecoderConfig, dtype: torch.dtype) -> int:
        """What one block costs over all layers and segments (known before any buffer exists)."""
        segments, per_block = _layout(config, dtype)
        return config.num_layers * segments * per_block

    @staticmethod
    def blocks_within(config: DecoderConfig, dtype: torch.dtype, num_bytes: int, granularity: int) -> int:
        """The most blocks whose pages fit in ``num_bytes``, once every segment's prefix is rounded up to a granule.

        The daemon backs each segment's committed prefix in whole granules,
        so ``num_bytes // bytes_per_block`` blocks would overshoot by up to a
        granule per segment and the commit be refused.
        """
        segments, per_block = _layout(config, dtype)
        per_segment = num_bytes // (config.num_layers * segments * granularity) * granularity
        return per_segment // per_block

    @staticmethod
    def aligned_capacity(config: DecoderConfig, dtype: torch.dtype, num_blocks: int, granularity: int) -> int:
        """``num_blocks`` rounded up so that each segment spans whole granules.

        Then no granule straddles two segments, and the blocks that
        :meth:`blocks_within` counts are exactly what a commit costs.
        """
        _, per_block = _layout(config, dtype)
        step = math.lcm(per_block, granularity) // per_block
        return -(-num_blocks // step) * step

    @classmethod
    def create(
        cls,
        client: Client,
        config: DecoderConfig,
        dtype: torch.dtype,
        device: torch.device,
        num_blocks_capacity: int,
        name: str | None = None,
    ) -> PagedKVCache:
        """Reserve room for ``num_blocks_capacity`` blocks per layer, nothing committed; ``name`` makes the buffers
        persistent."""
        segments, per_block = _layout(config, dtype)
        tensors: list[ExtensibleTensor] = []
        try:
            for layer in range(config.num_layers):
                tensors.append(
                    ExtensibleTensor(
                        segments * per_block * num_blocks_capacity,
                        str(device),
                        num_segments=segments,
                        client=client,
                        name=buffer_name(name, layer) if name else None,
                        persistent=name is not None,
                    )
                )
        except BaseException:
            for tensor in tensors:
                tensor.free()
            raise
        return cls(config, dtype, tensors, num_blocks_capacity)

    @classmethod
    def attach(
        cls, client: Client, config: DecoderConfig, dtype: torch.dtype, device: torch.device, name: str
    ) -> PagedKVCache:
        """Map engine ``name``'s persistent buffers, with their data, as a dead worker left them.

        Raises ``ValueError`` when the buffers do not have this config's layout.
        The buffers attached before a failure stay with this session (there
        is no detach short of ending it): close the client to orphan them
        again rather than free them, which would delete them.
        """
        segments, per_block = _layout(config, dtype)
        tensors = [
            ExtensibleTensor.attach(buffer_name(name, layer), str(device), client=client)
            for layer in range(config.num_layers)
        ]
        shapes = {(t.num_segments, t.segment_capacity_bytes, t.bytes_per_segment) for t in tensors}
        if len(shapes) != 1:
            raise ValueError(f"the buffers of {name!r} differ in layout: {sorted(shapes)}")
        ((seg_count, seg_capacity, committed),) = shapes
        if seg_count != segments or seg_capacity % per_block or committed % per_block:
            raise ValueError(
                f"the buffers of {name!r} ({seg_count} segments of {seg_capacity} bytes) "
                f"do not hold {config.name!r} blocks of {per_block} bytes per segment"
            )
        return cls(config, dtype, tensors, seg_capacity // per_block)

    # size

    @property
    def num_blocks(self) -> int:
        """Blocks committed (backed by memory) in every layer."""
        return self.buffers.num_blocks_committed

    @property
    def num_blocks_capacity(self) -> int:
        return self.buffers.num_blocks_capacity

    @property
    def physical_bytes(self) -> int:
        return self.buffers.physical_bytes

    @property
    def num_chunks(self) -> int:
        return sum(t.num_chunks for t in self.tensors)

    @property
    def num_segments(self) -> int:
        return sum(t.num_segments for t in self.tensors)

    def committed_views(self) -> list[torch.Tensor]:
        """Each layer's view cut to the committed blocks: what a KV connector would register."""
        return [narrow_blocks(view, BLOCK_DIM, self.num_blocks) for view in self.layers]

    # growth and sleep

    def commit(self, num_blocks: int, defragment: bool = False) -> None:
        """Back ``num_blocks`` blocks per layer (new ones zeroed).

        ``defragment`` then re-backs each segment with one chunk, discarding the data.
        """
        self.buffers.commit(num_blocks, defragment=defragment)

    def release_physical(self, keep: bool = False) -> None:
        """Sleep: every page goes back to the daemon; views and captured graphs stay valid for :meth:`recommit`.
        ``keep``: the blocks' bytes move to the daemon's host tier instead, at the same addresses."""
        self.buffers.release_physical(keep)

    def recommit(self) -> None:
        """Wake: the same number of blocks again, zeroed, or those kept asleep with their bytes."""
        self.buffers.recommit()

    def free(self) -> None:
        """Give everything back, persistent buffers included (the daemon forgets their names)."""
        self.buffers.free()


class BlockTables:
    """Which cache blocks hold each sequence's tokens, in order; a free list hands out the lowest block first.

    Block 0 is never handed out: the decode batch's unused table entries
    point at it, so whatever the padded step writes there is never read
    unmasked.
    """

    NULL_BLOCK = 0

    def __init__(self, block_size: int, num_blocks: int, tables: list[list[int]] | None = None) -> None:
        self.block_size = block_size
        self.num_blocks = 0
        self.tables: list[list[int]] = [list(t) for t in tables or []]
        self._free: list[int] = []  # descending: pop() takes the lowest
        self.grow(num_blocks)

    def grow(self, num_blocks: int) -> None:
        """The cache now holds ``num_blocks`` blocks: the new ones become free."""
        used = {b for table in self.tables for b in table}
        if any(b >= num_blocks for b in used):
            raise ValueError(f"a block table points past the {num_blocks} committed blocks")
        fresh = [b for b in range(num_blocks - 1, max(self.num_blocks, self.NULL_BLOCK + 1) - 1, -1) if b not in used]
        self._free = fresh + self._free
        self.num_blocks = max(self.num_blocks, num_blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def add_sequence(self) -> int:
        self.tables.append([])
        return len(self.tables) - 1

    def reserve(self, seq: int, num_tokens: int) -> None:
        """Make sequence ``seq``'s table cover ``num_tokens`` tokens."""
        table = self.tables[seq]
        while len(table) * self.block_size < num_tokens:
            if not self._free:
                raise RuntimeError(f"the KV cache is full ({self.num_blocks} blocks); this example does not preempt")
            table.append(self._free.pop())

    def slots(self, seq: int, start: int, end: int) -> list[int]:
        """Cache slots (block * block_size + offset) of tokens ``[start, end)`` of sequence ``seq``."""
        table, bs = self.tables[seq], self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def padded(self, batch_size: int, width: int) -> list[list[int]]:
        """``batch_size`` rows of ``width`` entries, padded with the null block (what the decode step reads)."""
        rows = [t + [self.NULL_BLOCK] * (width - len(t)) for t in self.tables]
        return rows + [[self.NULL_BLOCK] * width] * (batch_size - len(rows))

    def clear(self) -> None:
        """Every sequence finished: all blocks but the null block are free again."""
        self.tables = []
        self._free = list(range(self.num_blocks - 1, self.NULL_BLOCK, -1))
