"""``--config`` reloaded on SIGHUP: new quotas and access rules, every session kept.

The reload runs on a thread of its own that takes the server's lock, so it
lands between two requests, never inside one (a signal handler would run in
the middle of whatever the loop was doing). A config that the running
daemon could not honour is refused whole and the old one stays.
"""

from __future__ import annotations

import logging
import signal
import threading

from hbmd.proto.units import format_bytes

from .config import Config, ConfigError, load_config
from .notify import SystemdNotifier
from .state import State, Tenant

log = logging.getLogger("hbmd.reload")


def check_honourable(state: State, config: Config) -> None:
    """Raise :class:`ConfigError` if ``config`` breaks what the daemon has already admitted.

    A tenant's new maximum must hold what it has committed, and every
    guaranteed minimum must still fit beside the memory already committed:
    the daemon does not take memory back from a session to make a new
    promise true. Leased granules do not count: they are asked back.
    """
    for limits in config.tenants:
        tenant = state.tenants.get(limits.name)
        held = state.committed_by(tenant) if tenant else 0
        if limits.max_bytes is not None and held > limits.max_bytes:
            raise ConfigError(
                f"tenant {limits.name!r} holds {format_bytes(held)}, over its new max of {format_bytes(limits.max_bytes)}"
            )
    unmet = sum(
        max(0, limits.guaranteed_bytes - (state.committed_by(state.tenants[limits.name]) if limits.name in state.tenants else 0))
        for limits in config.tenants
    )
    if state.committed_bytes + unmet > state.budget_bytes:
        raise ConfigError(
            f"the guaranteed minimums need {format_bytes(unmet)} more, but only "
            f"{format_bytes(state.budget_bytes - state.committed_bytes)} of the budget is uncommitted"
        )


def apply_config(state: State, config: Config) -> None:
    """Make ``config`` the daemon's: sessions keep their tenants, whose limits change in place."""
    check_honourable(state, config)
    by_name = {limits.name: limits for limits in config.tenants}
    for name, tenant in state.tenants.items():
        limits = by_name.get(name)
        tenant.max_bytes = limits.max_bytes if limits else None
        tenant.guaranteed_bytes = limits.guaranteed_bytes if limits else 0
    for name, limits in by_name.items():
        state.tenants.setdefault(name, Tenant(name, limits.max_bytes, limits.guaranteed_bytes))
    state.config = config
    state.ask_back_all_leases()  # granted under the old limits


class ConfigReloader:
    """Reloads ``path`` into ``state`` on SIGHUP; without a path, SIGHUP is logged and ignored."""

    def __init__(self, path: str | None, state: State, lock: threading.Lock, notifier: SystemdNotifier) -> None:
        self.path = path
        self.state = state
        self.lock = lock
        self.notifier = notifier

    def install(self) -> None:
        # SIGHUP's default action ends the process: even without a config it must not.
        signal.signal(signal.SIGHUP, lambda *_: threading.Thread(target=self.reload, name="reload", daemon=True).start())

    def reload(self) -> bool:
        """Load and apply the config file; True when it took effect."""
        if self.path is None:
            log.warning("SIGHUP: no --config to reload")
            return False
        self.notifier.reloading()
        try:
            config = load_config(self.path, self.state.backend.total_bytes, self.state.budget_bytes)
            with self.lock:
                apply_config(self.state, config)
        except ConfigError as exc:
            log.error("SIGHUP: kept the previous config: %s", exc)
            return False
        finally:
            self.notifier.ready("serving")
        log.info("SIGHUP: reloaded %s: %d tenant limit(s)", self.path, len(config.tenants))
        return True
