"""KV-cache layout helpers: segment counts from a layout, typed views, committed-block views.

A KV cache has a *logical* shape (say ``(2, num_blocks, block_size, heads,
head_dim)``) and a *physical* stride order: the logical dimensions listed
from outermost (largest stride) to innermost. Every physical dimension
ordered before the block dimension splits the buffer into independent
segments that each grow block by block; their product is the segment count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from hbmd.proto.units import exact_bytes

from .session import Client
from .tensor import ExtensibleTensor


def _check_permutation(shape: Sequence[int], stride_order: Sequence[int]) -> None:
    if sorted(stride_order) != list(range(len(shape))):
        raise ValueError(f"stride order {tuple(stride_order)} is not a permutation of the {len(shape)} dimensions")


def _check_order(shape: Sequence[int], stride_order: Sequence[int], block_dim: int) -> None:
    _check_permutation(shape, stride_order)
    if not 0 <= block_dim < len(shape):
        raise ValueError(f"block dimension {block_dim} is outside a {len(shape)}-dimensional shape")


def num_segments(shape: Sequence[int], stride_order: Sequence[int], block_dim: int) -> int:
    """The product of the physical dimensions ordered before the block dimension.

    ``(2, N, ...)`` in its own order, blocks at 1: 2 (K/V split). ``(N, 2, ...)``
    with blocks at 0: 1 (block-major). ``(2, N, ...)`` with stride order
    ``(1, 0, ...)``, blocks physically outermost: 1.
    """
    _check_order(shape, stride_order, block_dim)
    outer = stride_order[: list(stride_order).index(block_dim)]
    return math.prod(shape[d] for d in outer)


def bytes_per_block_per_segment(
    shape: Sequence[int], stride_order: Sequence[int], block_dim: int, itemsize: int
) -> int:
    """Bytes one block takes in each segment: the physical dimensions after the block dimension."""
    _check_order(shape, stride_order, block_dim)
    inner = stride_order[list(stride_order).index(block_dim) + 1 :]
    return math.prod(shape[d] for d in inner) * itemsize


def kv_view(tensor: ExtensibleTensor, shape: Sequence[int], stride_order: Sequence[int], dtype: Any) -> Any:
    """A view of ``tensor``'s full capacity with the logical ``shape``, laid out in ``stride_order``.

    Its base pointer is the buffer's, so it stays valid as the buffer grows.
    Raises ``ValueError`` when the layout does not fit the capacity.
    """
    import torch

    _check_permutation(shape, stride_order)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    needed = math.prod(shape) * itemsize
    if needed > tensor.max_num_bytes:
        raise ValueError(
            f"layout {tuple(shape)} of {dtype} needs {exact_bytes(needed)}; the buffer holds "
            f"{exact_bytes(tensor.max_num_bytes)}"
        )
    physical = tensor.full_view()[:needed].view(dtype).view([shape[d] for d in stride_order])
    return physical.permute([list(stride_order).index(d) for d in range(len(shape))])


def narrow_blocks(view: Any, block_dim: int, num_blocks: int) -> Any:
    """``view`` cut to its first ``num_blocks`` blocks.

    Same base pointer, same strides: what a KV connector registers.
    """
    return view.narrow(block_dim, 0, num_blocks)


def kv_blocks_that_fit(
    client: Client, bytes_per_block: int, *, margin_bytes: int = 0, margin_fraction: float = 0.0
) -> int:
    """How many KV blocks of ``bytes_per_block`` (summed over buffers and segments) can be committed now.

    Run after warm-up and graph capture: what is left of the budget, capped by
    the device's free memory, less a safety margin of ``margin_bytes`` plus
    ``margin_fraction`` of the device's total.
    """
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    memory = client.device_memory()
    spare = memory.available() - margin_bytes - int(margin_fraction * memory.total)
    return max(0, spare // bytes_per_block)
