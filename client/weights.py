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
from typing import Any, Mapping

from hbmd.proto.undo import Undo
from hbmd.proto.units import round_up

from .session import Client
from .tensor import ExtensibleTensor

MAGIC = b"HBMDWTS1"
HEADER = struct.Struct("<8sQ")
ALIGNMENT = 256
MANIFEST_VERSION = 1


def store_weights(state_dict: Mapping[str, Any], name: str, device: Any, client: Client | None = None) -> ExtensibleTensor:
    """Copy ``state_dict``'s tensors into a new persistent buffer ``name`` on ``device``, and seal it.

    Returns the sealed tensor, owned by this session: it stays in the daemon
    for readers when this process detaches or ends, until deleted
    (``hbmctl delete NAME``). Raises ``TypeError`` for a value that is not a
    dense tensor, ``Conflict`` when ``name`` exists; on any failure nothing
    is left behind.
    """
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
        tensors.append((entry, tensor))
        end = round_up(end + nbytes, ALIGNMENT)
    manifest = json.dumps({"version": MANIFEST_VERSION, "tensors": [entry for entry, _ in tensors]}).encode()
    header = HEADER.pack(MAGIC, len(manifest)) + manifest
    data_start = round_up(len(header), ALIGNMENT)

    with Undo() as undo:
        buffer = ExtensibleTensor(data_start + end, device, client=client, name=name, persistent=True)
        undo.push(buffer.free)
        buffer.resize_(data_start + end)
        view = buffer.full_view()
        view[: len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        for entry, tensor in tensors:
            if entry["nbytes"]:
                start = data_start + entry["offset"]
                source = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
                view[start : start + entry["nbytes"]].copy_(source)
        buffer.seal()
    return buffer


def load_weights(name: str, device: Any, client: Client | None = None) -> dict[str, Any]:
    """The tensors of the sealed weights buffer ``name``, as read-only views of it on ``device``, in stored order.

    Nothing is copied: the tensors share the daemon's pages with every other
    reader, and a write through one faults (SIGSEGV on the host, an
    illegal-address error on a GPU). The read claim holds until the
    client's session ends. Raises ``NotFound`` for an unknown name,
    ``InvalidRequest`` for a buffer that is not sealed, ``ValueError`` for a
    buffer that holds no weights manifest.
    """
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
            weights[entry["name"]] = view[start : start + entry["nbytes"]].view(dtype).view(entry["shape"])
    return weights


def _read(view: Any, start: int, size: int) -> bytes:
    """``size`` bytes of ``view`` from ``start``, as ``bytes`` (a small copy through the host for a GPU view)."""
    host = view[start : start + size].cpu()
    return ctypes.string_at(host.data_ptr(), size)
