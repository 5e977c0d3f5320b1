"""hbmd's vLLM settings as the environment gives them: switches and durations, refused when misspelt.

An operator who wrote a setting meant something by it: a value that is
neither on nor off, or no number of seconds in range, stops the engine at
start rather than running it against their word.
"""

from __future__ import annotations

import os

LOAD_FORMAT = "hbmd"
"""The ``--load-format`` of hbmd's weight loader (:mod:`hbmd.integrations.vllm_weights`)."""
ON = ("1", "true", "yes", "on")
OFF = ("", "0", "false", "no", "off")


def switch(name: str) -> bool:
    """Whether the setting ``name`` is on; ``ValueError`` for a value that is neither on nor off."""
    value = os.environ.get(name, "")
    if value.strip().lower() in ON:
        return True
    if value.strip().lower() in OFF:
        return False
    raise ValueError(f"{name}={value!r}: expected one of {', '.join(ON)} (on) or {', '.join(OFF[1:])} or unset (off)")


def seconds(name: str, default: float, most: float) -> float:
    """The setting ``name`` in seconds, from 0 to ``most``, ``default`` where unset; ``ValueError`` otherwise."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        parsed = float(value)
    except ValueError:
        parsed = -1.0
    if not 0 <= parsed <= most:
        raise ValueError(f"{name}={value!r}: expected seconds from 0 to {most:g}")
    return parsed
