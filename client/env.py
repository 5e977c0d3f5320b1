"""The client's settings that an operator gives through the environment, for engines whose code it does not write."""

from __future__ import annotations

import os

from .transport import SPIN_S

RESUME_TIMEOUT_S = 30.0
"""How long a client waits by default for its daemon to come back after it went away (``HBMD_RESUME_TIMEOUT``)."""
TENANT_ENV = "HBMD_TENANT"
"""The tenant a client declares where its code names none: how an operator sets it for an engine it does not write
(vLLM's workers, say)."""


def resume_timeout_from_env() -> float:
    """``HBMD_RESUME_TIMEOUT`` in seconds (default :data:`RESUME_TIMEOUT_S`; 0: never wait)."""
    return _number_from_env("HBMD_RESUME_TIMEOUT", RESUME_TIMEOUT_S, "seconds")


def spin_from_env() -> float:
    """``HBMD_SPIN_US``, in seconds: how long a call polls for its reply before it sleeps (default
    :data:`~hbmd.client.transport.SPIN_S`; 0: never poll)."""
    return _number_from_env("HBMD_SPIN_US", SPIN_S * 1e6, "microseconds") / 1e6


def tenant_from_env() -> str:
    """``HBMD_TENANT``: the tenant of a session whose code names none ("": none, the session is charged to its uid)."""
    return os.environ.get(TENANT_ENV, "")


def _number_from_env(name: str, default: float, unit: str) -> float:
    """``$name``, a number of ``unit``, 0 or more (``default`` where unset); ``ValueError`` naming it otherwise."""
    text = os.environ.get(name, "")
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (0 <= value < float("inf")):
        raise ValueError(f"{name}={text!r} is not a number of {unit}, 0 or more")
    return value
