"""Byte sizes as people write them (``96MiB``, ``120GiB``, ``90%``) and as tools print them."""

from __future__ import annotations

import re
from fractions import Fraction

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 1000,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 1000**2,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 1000**3,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 1000**4,
    "p": 1 << 50,
    "pib": 1 << 50,
    "pb": 1000**5,
}
MAX_DIGITS = 64
"""Digits of a size's number: a PiB has 16, and Python refuses to read an integer of more than 4,300."""
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*|%)\s*$")


def parse_size(text: str, total: int | None = None) -> int:
    """Parse ``"96MiB"``, ``"1.5GiB"``, ``"4096"`` or, given ``total``, ``"90%"``; rounded down to whole bytes.

    Exact however many digits (no float rounds or overflows). Raises
    ``ValueError`` with the accepted forms on anything else, a fraction of
    a byte included (``"1.5"`` is no size: ``1.5GiB`` is).
    """
    match = _SIZE.match(text)
    if not match:
        raise ValueError(
            f"bad size {text!r}: expected a number with an optional unit "
            "(B, KiB, MiB, GiB, TiB, PiB, KB, MB, GB, TB, PB) or a percentage"
        )
    if len(match.group(1)) > MAX_DIGITS:
        raise ValueError(f"bad size {text[:MAX_DIGITS]!r}...: {len(match.group(1))} digits, more than any size needs")
    number, unit = Fraction(match.group(1)), match.group(2).lower()
    if unit == "%":
        if total is None:
            raise ValueError(f"bad size {text!r}: a percentage needs a known total")
        if not 0 < number <= 100:
            raise ValueError(f"bad size {text!r}: a percentage must be in (0, 100]")
        return int(total * number / 100)
    if unit not in _UNITS:
        raise ValueError(f"bad size {text!r}: unknown unit {match.group(2)!r}")
    if _UNITS[unit] == 1 and number.denominator != 1:
        raise ValueError(f"bad size {text!r}: a fraction of a byte; give whole bytes, or a unit (1.5GiB)")
    return int(number * _UNITS[unit])


def format_bytes(n: int) -> str:
    """``format_bytes(3 << 30) == '3.0 GiB'``; exact bytes below 1 KiB."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def exact_bytes(n: int) -> str:
    """``n`` as :func:`format_bytes` writes it, with the exact count beside it where that rounds: ``'64.0 MiB'``,
    ``'64.0 MiB (67108865 B)'``. For messages about one request, where the byte that went over must show."""
    shown = format_bytes(n)
    if n < 1024 or parse_size(shown.replace(" ", "")) == n:
        return shown
    return f"{shown} ({n} B)"


def round_up(n: int, granule: int) -> int:
    """``n`` rounded up to a whole number of ``granule``s (the driver's and every chunk's unit)."""
    return -(-n // granule) * granule
