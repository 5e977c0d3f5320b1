"""Model weights in hbmd: loaded once per GPU, then attached read-only by every engine that serves the model.

:func:`store_weights` packs a state dict into one persistent buffer and
seals it; :func:`load_weights` attaches it read-only and returns tensors
that are views of it (no copy), so a restarted or second engine gets its
weights in the time it takes to map them.

Layout of the buffer, from its first byte:

- a 16-byte header: the magic ``b"HBMDWTS1"`` and the manifest's length in
  bytes (unsigned 64-bit little-endian);
- the manifest, UTF-8 JSON: ``{"version": 1, "tensors": [{"name", "dtype",
  "shape", "offset", "nbytes"}, ...]}`` in the state dict's order, ``dtype``
  as torch names it without ``torch.`` (``"bfloat16"``);
- the data, starting at the first 256-byte boundary after the manifest: each
  tensor's bytes (contiguous, row-major) at ``offset`` bytes from that
  boundary, every ``offset`` a multiple of 256.

The manifest sits at the start, not in the last bytes, so a reader finds it
at a fixed place without knowing the buffer's size, and offsets that count
from the data start do not depend on the manifest's own length. 256 bytes is
what CUDA's allocator aligns to, and more than any dtype or vector load needs.
"""

from __future__ import annotations

import ctypes
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hbmd.proto.undo import Undo
from hbmd.proto.units import round_up

from .session import Client
from .tensor import ExtensibleTensor

MAGIC = b"HBMDWTS1"
HEADER = struct.Struct("<8sQ")
ALIGNMENT = 256
MANIFEST_VERSION = 1


@dataclass
class Weights:
    """A sealed weights buffer as one reader maps it."""

    tensors: dict[str, Any]
    """Read-only views of the buffer, by name, in stored order."""
    meta: dict[str, Any]
    """What the storer recorded beside the tensors (``{}`` when nothing)."""
    buffer: ExtensibleTensor
    """The read claim: the views stay valid until it is detached or this session ends."""


def store_weights(
    state_dict: Mapping[str, Any],
    name: str,
    device: Any,
    client: Client | None = None,
    meta: Mapping[str, Any] | None = None,
) -> ExtensibleTensor:
    """Copy ``state_dict``'s tensors into a new persistent buffer ``name`` on ``device``, and seal it.

    ``meta``: JSON-serialisable facts to keep beside the tensors, which every
    reader gets back (:func:`open_weights`). Returns the sealed tensor, owned
    by this session: it stays in the daemon for readers when this process
    detaches or ends, until deleted (``hbmctl delete NAME``). Raises
    ``TypeError`` for a value that is not a dense tensor, ``Conflict`` when
    ``name`` exists; on any failure nothing is left behind. A process killed
    before the seal leaves an unsealed buffer, which no reader can attach.
    """
    plan = _plan(state_dict, meta)
    with Undo() as undo:
        buffer = ExtensibleTensor(plan.size, device, client=client, name=name, persistent=True)
        undo.push(buffer.free)
        _write(buffer, plan)
    return buffer


def write_weights(
    buffer: ExtensibleTensor, state_dict: Mapping[str, Any], meta: Mapping[str, Any] | None = None
) -> None:
    """:func:`store_weights` into ``buffer``, an empty persistent buffer of this session made beforehand (to claim its
    name before the tensors exist, say) with room for them; ``ValueError`` when it has too little."""
    plan = _plan(state_dict, meta)
    if plan.size > buffer.max_num_bytes:
        raise ValueError(f"weights of {plan.size} bytes do not fit buffer {buffer.name!r} of {buffer.max_num_bytes}")
    _write(buffer, plan)


@dataclass
class _Plan:
    """Where each tensor goes in a weights buffer, and the header that says so."""

    header: bytes
    data_start: int
    tensors: list[tuple[dict[str, Any], Any]]
    size: int


def _plan(state_dict: Mapping[str, Any], meta: Mapping[str, Any] | None) -> _Plan:
    import torch

    tensors: list[tuple[dict[str, Any], Any]] = []
    end = 0
    for key, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            raise TypeError(f"{key!r}: only dense tensors can be stored, not {type(tensor).__name__}")
        nbytes = tensor.numel() * tensor.element_size()
        entry = {
            "name": key,
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape),
            "offset": end,
            "nbytes": nbytes,
        }
        if not tensor.is_contiguous() and _dense_order(tensor):
            entry["stride"] = list(tensor.stride())
        tensors.append((entry, tensor))
        end = round_up(end + nbytes, ALIGNMENT)
    contents: dict[str, Any] = {"version": MANIFEST_VERSION, "tensors": [entry for entry, _ in tensors]}
    if meta:
        contents["meta"] = dict(meta)
    manifest = json.dumps(contents).encode()
    header = HEADER.pack(MAGIC, len(manifest)) + manifest
    data_start = round_up(len(header), ALIGNMENT)
    return _Plan(header, data_start, tensors, data_start + end)


def _write(buffer: ExtensibleTensor, plan: _Plan) -> None:
    import torch

    buffer.resize_(plan.size)
    view = buffer.full_view()
    view[: len(plan.header)].copy_(torch.frombuffer(bytearray(plan.header), dtype=torch.uint8))
    for entry, tensor in plan.tensors:
        if entry["nbytes"]:
            start = plan.data_start + entry["offset"]
            view[start : start + entry["nbytes"]].copy_(_memory_order(tensor.detach()).view(torch.uint8))
    buffer.seal()


def load_weights(name: str, device: Any, client: Client | None = None) -> dict[str, Any]:
    """The tensors of the sealed weights buffer ``name``, as read-only views of it on ``device``, in stored order.

    Nothing is copied: the tensors share the daemon's pages with every other
    reader, and a write through one faults (SIGSEGV on the host, an
    illegal-address error on a GPU). The read claim holds until the
    client's session ends. Raises ``NotFound`` for an unknown name,
    ``InvalidRequest`` for a buffer that is not sealed, ``ValueError`` for a
    buffer that holds no weights manifest.
    """
    return open_weights(name, device, client).tensors


def open_weights(name: str, device: Any, client: Client | None = None) -> Weights:
    """:func:`load_weights`, with what the storer recorded beside the tensors and the read claim itself."""
    import torch

    with Undo() as undo:
        buffer = ExtensibleTensor.attach(name, device, client=client, readonly=True)
        undo.push(buffer.detach)
        view = buffer.full_view()
        magic, length = HEADER.unpack(_read(view, 0, HEADER.size))
        if magic != MAGIC or HEADER.size + length > buffer.num_bytes:
            raise ValueError(f"persistent buffer {name!r} holds no hbmd weights manifest")
        manifest = json.loads(_read(view, HEADER.size, length))
        if manifest.get("version") != MANIFEST_VERSION:
            raise ValueError(f"weights {name!r}: manifest version {manifest.get('version')} is not {MANIFEST_VERSION}")
        data_start = round_up(HEADER.size + length, ALIGNMENT)
        weights: dict[str, Any] = {}
        for entry in manifest["tensors"]:
            dtype = getattr(torch, entry["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"weights {name!r}: {entry['name']!r} has unknown dtype {entry['dtype']!r}")
            start = data_start + entry["offset"]
            flat = view[start : start + entry["nbytes"]].view(dtype)
            stride = entry.get("stride")
            if stride is None:
                weights[entry["name"]] = flat.view(entry["shape"])
            else:
                _check_strides(name, entry, flat.numel())
                weights[entry["name"]] = flat.as_strided(entry["shape"], stride)
    return Weights(weights, manifest.get("meta", {}), buffer)


def _check_strides(name: str, entry: dict[str, Any], elements: int) -> None:
    """Refuse strides that would reach outside the entry's own bytes: the manifest is read, not trusted."""
    shape, stride = entry["shape"], entry["stride"]
    last = sum((size - 1) * step for size, step in zip(shape, stride) if size > 0)
    if len(stride) != len(shape) or any(step < 0 for step in stride) or (elements and last >= elements):
        raise ValueError(f"weights {name!r}: {entry['name']!r} has strides {stride} outside its {elements} elements")


def _dense_order(tensor: Any) -> list[int] | None:
    """The order of ``tensor``'s dimensions, outermost first, in which its elements fill one gapless run of memory;
    None when they do not (an expanded or sliced view)."""
    outermost_first = sorted(range(tensor.dim()), key=lambda d: -tensor.stride(d))
    return outermost_first if tensor.permute(outermost_first).is_contiguous() else None


def _memory_order(tensor: Any) -> Any:
    """``tensor``'s elements as one flat run, in the order they lie in memory: its bytes for a dense tensor whatever its
    strides (so that ``as_strided`` with the same strides rebuilds it), and row-major for any other."""
    order = None if tensor.is_contiguous() else _dense_order(tensor)
    return tensor.contiguous().reshape(-1) if order is None else tensor.permute(order).contiguous().reshape(-1)


def _read(view: Any, start: int, size: int) -> bytes:
    """``size`` bytes of ``view`` from ``start``, as ``bytes`` (a small copy through the host for a GPU view)."""
    host = view[start : start + size].cpu()
    return ctypes.string_at(host.data_ptr(), size)
