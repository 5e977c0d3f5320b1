"""How long a persistent buffer's name has been held unsealed, across the sessions and buffers that held it."""

from __future__ import annotations

from typing import Any

from .records import Buffer

UNSEALED_NAME_KEPT_S = 60.0
"""How long a name dropped unsealed keeps its age for a persistent buffer made again under it: far longer than an
engine waiting for a seal takes to look again (``integrations/vllm_weights.py``, 0.2 s), so a holder that deletes the
name and makes it again at once does not look new to it."""


class UnsealedNames:
    """How long each user's names dropped unsealed lately had been held unsealed (:attr:`Buffer.unsealed_since`).

    An engine waits for another's seal of a weights name only while the name
    has been unsealed for less than it waits (``wait_s``), which a holder
    could reset by handing the name to each new session it opens; the age
    is the buffer's, so an attach keeps it, and a name deleted and made
    again within :data:`UNSEALED_NAME_KEPT_S` keeps it too. Each user's
    names are kept up to ``per_uid``, the youngest claim forgotten first:
    forgetting an old one takes as many names held unsealed longer. Not
    journaled: a restart within the minute forgets them.
    """

    def __init__(self, per_uid: int) -> None:
        self.per_uid = per_uid
        self.dropped: dict[int, dict[str, tuple[float, float]]] = {}
        """By uid, then name: since when it had been unsealed and when it was dropped (Unix times)."""

    def since(self, uid: int, name: str, now: float) -> float:
        """Since when a persistent buffer ``name`` of ``uid`` made at ``now`` holds its name unsealed."""
        self.forget_older(now)
        names = self.dropped.get(uid)
        kept = names.pop(name, None) if names is not None else None
        if names is not None and not names:
            del self.dropped[uid]
        return kept[0] if kept is not None else now

    def dropped_unsealed(self, buffer: Buffer[Any, Any], now: float) -> None:
        """The persistent buffer was dropped, its name unsealed: a buffer made under it soon keeps its age."""
        names = self.dropped.setdefault(buffer.owner_uid, {})
        names[buffer.name] = (buffer.unsealed_since, now)
        if len(names) > self.per_uid:
            del names[max(names, key=lambda name: names[name][0])]

    def forget_older(self, now: float) -> None:
        """Forget the names dropped more than :data:`UNSEALED_NAME_KEPT_S` before ``now``."""
        for uid, names in list(self.dropped.items()):
            for name in [n for n, (_, dropped_at) in names.items() if now - dropped_at > UNSEALED_NAME_KEPT_S]:
                del names[name]
            if not names:
                del self.dropped[uid]
