"""What the uids hold of one resource of the daemon, bounded per uid, in all, and shared fairly.

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


def fair_share(per_uid: int, total: int, floor: int, others: int) -> int:
    """The most one uid may hold while ``others`` other uids hold some: its bound, or the bound in all split among the
    uids holding some and one more, whichever is less; ``floor`` at least."""
    return max(floor, min(per_uid, total // (others + 2)))


def fits(held: int, more: int, in_all: int, others: int, per_uid: int, total: int, floor: int) -> bool:
    """Whether a uid holding ``held`` may hold ``more`` besides, while every uid holds ``in_all`` and ``others`` other
    uids hold some: up to its floor always, past it within its fair share while the bound in all has room."""
    after = held + more
    return after <= floor or (after <= fair_share(per_uid, total, floor, others) and in_all + more <= total)


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
        return fair_share(self.per_uid, self.total, self.floor, self._others(uid))

    def fits(self, uid: int, more: int) -> bool:
        """Whether ``uid`` may hold ``more`` besides what it holds."""
        return fits(self.held(uid), more, self._sum, self._others(uid), self.per_uid, self.total, self.floor)

    def _others(self, uid: int) -> int:
        return len(self._held) - (uid in self._held)

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
