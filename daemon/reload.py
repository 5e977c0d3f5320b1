"""``--config`` reloaded on SIGHUP: new quotas and access rules, every session kept.

The reload runs on a thread of its own that takes the server's lock, so it
lands between two requests, never inside one (a signal handler would run in
the middle of whatever the loop was doing). A config that the running
daemon could not honour is refused whole and the old one stays (the
budget's own rules decide: ``Tenants.reconfigure``).
"""

from __future__ import annotations

import logging
import signal
import threading

from .config import ConfigError, load_config
from .notify import SystemdNotifier
from .state import State

log = logging.getLogger("hbmd.reload")


class ConfigReloader:
    """Reloads ``path`` into ``state`` on SIGHUP; without a path, SIGHUP is logged and ignored."""

    def __init__(self, path: str | None, state: State, lock: threading.Lock, notifier: SystemdNotifier) -> None:
        self.path = path
        self.state = state
        self.lock = lock
        self.notifier = notifier

    def install(self) -> None:
        # SIGHUP's default action ends the process: even without a config it must not.
        signal.signal(
            signal.SIGHUP, lambda *_: threading.Thread(target=self.reload, name="reload", daemon=True).start()
        )

    def reload(self) -> bool:
        """Load and apply the config file; True when it took effect."""
        if self.path is None:
            log.warning("SIGHUP: no --config to reload")
            return False
        self.notifier.reloading()
        try:
            config = load_config(self.path, self.state.backend.total_bytes, self.state.tenants.budget_bytes)
            with self.lock:
                self.state.reconfigure(config)
                self.state.config_load.loaded()
        except ConfigError as exc:
            with self.lock:
                self.state.config_load.failed(str(exc))
            # The file stays as it is: a start that keeps nothing (no FD store, no --takeover) would load it and
            # refuse what clients declare again past its limits, so the operator must hear of it now.
            log.error("SIGHUP: kept the previous config: %s; %s is not in force, and the daemon's next start loads it "
                      "as it is: fix it, or put the one in force back", exc, self.path)
            return False
        finally:
            self.notifier.ready("serving")
        log.info("SIGHUP: reloaded %s: %d tenant limit(s)", self.path, len(config.tenants))
        return True
