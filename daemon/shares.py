"""What the uids hold of one resource of the control plane, bounded per uid, in all, and shared fairly.

Bounds per uid add up: four uids each at their bounds took the daemon to
500 MiB, about eight past the DaemonSet's 1 GiB (issue #61). So each
resource also has a bound in all, and a uid may always hold its *floor*,
one message's worth, whatever the others hold: an honest client, which
needs no more, is never refused for what others took. Past its floor a uid
grows only while the bound in all has room, and to a fair share of it at
most: the bound split among the uids holding some and one more, so that one
uid alone takes half of it, and each uid that comes later less. The bound in
all is passed only by the floors of the uids that hold no more than theirs.
"""

from __future__ import annotations


class Shares:
    """One resource's holdings by uid: ``per_uid`` each at most, ``total`` in all, ``floor`` always."""

    __slots__ = ("_held", "_sum", "floor", "per_uid", "total")

    def __init__(self, per_uid: int, total: int, floor: int) -> None:
        self.per_uid = per_uid
        self.total = total
        self.floor = floor
        self._held: dict[int, int] = {}
        self._sum = 0

    def held(self, uid: int) -> int:
        """What ``uid`` holds."""
        return self._held.get(uid, 0)

    @property
    def in_all(self) -> int:
        """What every uid holds together."""
        return self._sum

    def share(self, uid: int) -> int:
        """The most ``uid`` may hold now: its bound, or its fair share of the bound in all, whichever is less (the
        floor at least)."""
        others = len(self._held) - (uid in self._held)
        return max(self.floor, min(self.per_uid, self.total // (others + 2)))

    def fits(self, uid: int, more: int) -> bool:
        """Whether ``uid`` may hold ``more`` besides what it holds."""
        after = self.held(uid) + more
        return after <= self.floor or (after <= self.share(uid) and self._sum + more <= self.total)

    def over(self, uid: int) -> bool:
        """Whether ``uid`` holds more than it may (what it took before finding out: a message's bytes as they came)."""
        held = self.held(uid)
        return held > self.floor and (held > self.share(uid) or self._sum > self.total)

    def add(self, uid: int, amount: int) -> None:
        """``uid`` holds ``amount`` more (less, where negative)."""
        held = self._held.get(uid, 0) + amount
        self._sum += amount
        if held > 0:
            self._held[uid] = held
        else:
            self._held.pop(uid, None)

    def clear(self) -> None:
        self._held.clear()
        self._sum = 0
