"""Which daemon instance serves a device, as torch or a user names it."""

from __future__ import annotations

from typing import Any


def parse_device(device: Any) -> tuple[str, int]:
    """The device ``device`` names, as ``("cpu", -1)`` or ``("cuda", index)``.

    ``device`` is ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``1``, a ``torch.device`` or ``None``.
    ``None`` means the current CUDA device where torch sees one, else the host.
    Anything else raises ``ValueError``.
    """
    if device is None:
        try:
            import torch
        except ImportError:
            return "cpu", -1
        return ("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else ("cpu", -1)
    if isinstance(device, bool):
        raise ValueError(f"unsupported device {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device index {device} is negative")
        return "cuda", device
    text = str(device)
    kind, _, index = text.partition(":")
    if kind == "cpu" and index in ("", "0"):
        return "cpu", -1
    if kind == "cuda":
        if not index:
            return "cuda", _current_cuda_index()
        if index.isdigit():
            return "cuda", int(index)
    raise ValueError(f"unsupported device {text!r}: hbmd serves 'cpu' (host backend) and 'cuda[:N]'")


def _current_cuda_index() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.current_device() if torch.cuda.is_available() else 0
