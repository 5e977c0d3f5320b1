"""One way to undo a multi-step operation that fails part way.

Each step registers its undo right after it succeeded; when a later step
raises, the undos run in reverse order and the error goes on. A step that
failed registered nothing, so nothing of it is undone twice or by guess::

    with Undo() as undo:
        handle = create()
        undo.push(release, handle)
        fd = export(handle)
        undo.push(os.close, fd)
        send(fd)        # raises: fd is closed, then the handle released

An undo that itself fails is logged and the others still run: the caller
sees the error that started the unwinding, not one of its consequences.
Daemon and client both use it, so it lives beside the protocol (standard
library only).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("hbmd.undo")


class Undo:
    """A stack of undos for the steps done so far.

    As a context manager: run in reverse when the block raises, forgotten
    when it ends normally.
    """

    def __init__(self) -> None:
        self._undos: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

    def push(self, undo: Callable[..., Any], *args: Any) -> None:
        """Register ``undo(*args)`` for the step that just succeeded."""
        self._undos.append((undo, args))

    def commit(self) -> None:
        """Every step is done: forget the undos."""
        self._undos.clear()

    def rollback(self) -> None:
        """Run the undos registered so far, last first, and forget them."""
        while self._undos:
            undo, args = self._undos.pop()
            try:
                undo(*args)
            except Exception:
                log.exception("undoing a step with %s failed", getattr(undo, "__qualname__", undo))

    def __enter__(self) -> Undo:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None:
            self.rollback()
        else:
            self.commit()
