"""What more a session may commit, as the daemon's admission counts it.

The daemon decides what a commit is admitted for (its budget, the tenant's
maximum, other tenants' guaranteed minimums, the leases) and says it for the
asking session in ``StatusReply.admissible_bytes``; the client does not
redo that arithmetic. Only a daemon too old to send the figure (protocol
1.0, which sends -1) gets a fallback, here and nowhere else.
"""

from __future__ import annotations

import dataclasses

from hbmd.proto import StatusReply


def budget_left(status: StatusReply) -> int:
    """What more the daemon would admit for the session that asked for ``status``, in bytes."""
    if status.admissible_bytes >= 0:
        return status.admissible_bytes
    # A protocol 1.0 daemon: its budget is all that can be counted from here.
    return max(0, status.budget_bytes - status.committed_bytes - status.leased_bytes)


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """What an engine sizes its KV cache from after warm-up, in bytes (see :meth:`Client.device_memory`)."""

    total: int
    free: int
    committed: int
    budget: int
    budget_left: int

    @classmethod
    def of(cls, status: StatusReply) -> DeviceMemory:
        """The figures of a status reply, the budget left as :func:`budget_left` counts it."""
        return cls(
            total=status.total_bytes,
            free=status.device_free_bytes,
            committed=status.committed_bytes,
            budget=status.budget_bytes,
            budget_left=budget_left(status),
        )

    def available(self) -> int:
        """What a commit can take now: the budget left, capped by the device's free memory where known."""
        return self.budget_left if self.free < 0 else min(self.budget_left, self.free)
