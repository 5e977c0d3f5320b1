"""Small helpers shared by the test modules."""

from __future__ import annotations

import time

MiB = 1 << 20
GRANULE = 2 * MiB


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.02):
    """Poll ``predicate`` until it returns a truthy value; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")
