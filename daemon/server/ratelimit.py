"""Warnings (and refusals) a peer can provoke at will, logged at most once per interval so it cannot flood the log."""

from __future__ import annotations

import logging
import time

WARNING_INTERVAL_S = 10.0


class RateLimitedLog:
    """Warnings of one kind at most once per interval, with a count of those held back."""

    def __init__(self, logger: logging.Logger, interval_s: float = WARNING_INTERVAL_S) -> None:
        self._log = logger
        self._interval_s = interval_s
        self._last: dict[str, tuple[float, int]] = {}

    def warning(self, kind: str, message: str, *args: object) -> None:
        """Log ``message % args`` unless a warning of ``kind`` went out less than an interval ago."""
        self.log(logging.WARNING, kind, message, *args)

    def log(self, level: int, kind: str, message: str, *args: object) -> None:
        """The same at ``level``."""
        now = time.monotonic()
        last, held_back = self._last.get(kind, (-self._interval_s, 0))
        if now - last < self._interval_s:
            self._last[kind] = (last, held_back + 1)
            return
        self._last[kind] = (now, 0)
        suffix = f" ({held_back} more like it in the last {self._interval_s:.0f} s)" if held_back else ""
        self._log.log(level, message + suffix, *args)
