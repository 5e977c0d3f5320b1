"""The daemon's time: one object every deadline reads, so that a test moves time without waiting."""

from __future__ import annotations

import time


class Clock:
    """Time as the daemon reads it: what it is built with, handed to each part that keeps a deadline.

    ``monotonic`` keeps what lasts within a run: leases' idleness, sessions'
    resume windows, reclaims' patience, demotes and promotes, the host pool's
    quiet time, hellos. ``unix`` keeps what outlives a run: an orphan's
    grace period is journaled as a Unix time, so the time the daemon was down
    counts.
    """

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (``time.monotonic``)."""
        return time.monotonic()

    def unix(self) -> float:
        """Seconds since the Unix epoch (``time.time``)."""
        return time.time()
