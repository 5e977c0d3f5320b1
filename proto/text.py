"""Text that may come from a peer (names, reasons, refusals), as a terminal or a log may show it."""

from __future__ import annotations


def shown(text: str) -> str:
    """``text`` with each non-printable character escaped as ``repr`` writes it (``\\x1b``, ``\\r``, ``\\n``).

    Printed raw, a control character could clear an operator's screen,
    retitle the terminal, or forge a row of a table or a line of a log.
    """
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
