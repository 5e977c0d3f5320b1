"""The daemon's log on stderr, shaped for whoever reads it (``--log-format``).

- ``text``, for a terminal or a file: ``2026-12-03 16:09:01,123 INFO hbmd.server: ...``.
- ``journal``, where stderr is systemd's journal (``JOURNAL_STREAM`` names it,
  as systemd.exec(5) says to check): each line starts with its syslog
  priority, ``<6>hbmd.server: ...`` (sd-daemon(3)), and carries no time,
  which journald stamps itself. Every line of a record does, a traceback's
  too, so ``journalctl -p warning`` shows all of a warning and nothing of an
  info.
- ``json``, for log shippers: one object per record and line, ``time`` (Unix
  seconds), ``level``, ``logger``, ``message`` and, for a failure, ``exception``.

``auto`` (the default) is ``journal`` where stderr is the journal, else ``text``.
Each component logs under its own name (``hbmd.server.handles``,
``hbmd.persist``, ``hbmd.takeover``, ...), which all three show.
"""

from __future__ import annotations

import json
import logging
import os
import sys

from hbmd.proto.text import shown

FORMATS = ("auto", "text", "journal", "json")

SYSLOG_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}
"""Python's levels as syslog priorities (debug, info, warning, err, crit): what journald files each line under."""


def stderr_is_journal() -> bool:
    """Whether stderr is the stream systemd connected to the journal: ``JOURNAL_STREAM`` is ``device:inode`` of it,
    and is inherited by children whose stderr may be something else, so both are compared."""
    device, _, inode = os.environ.get("JOURNAL_STREAM", "").partition(":")
    try:
        st = os.fstat(sys.stderr.fileno())
        return (st.st_dev, st.st_ino) == (int(device), int(inode))
    except (ValueError, OSError):
        return False


class EscapedFormatter(logging.Formatter):
    """Each record's message on one line, its control characters escaped: a name or a reason a peer chose can neither
    forge a line of the log nor reach the terminal of whoever reads it. A traceback follows on lines of its own."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return shown(super().formatMessage(record))


class JournalFormatter(EscapedFormatter):
    """``<N>logger: message``, every line prefixed with the record's priority."""

    def __init__(self) -> None:
        super().__init__("%(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{SYSLOG_PRIORITY.get(record.levelno, 6)}>"
        return "\n".join(prefix + line for line in super().format(record).split("\n"))


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (a traceback is a field, its newlines escaped)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": shown(record.getMessage()),  # as the other formats show it, whatever reads the JSON
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def formatter(log_format: str) -> logging.Formatter:
    """The formatter ``--log-format`` names (``auto`` resolved against stderr)."""
    if log_format == "auto":
        log_format = "journal" if stderr_is_journal() else "text"
    if log_format == "journal":
        return JournalFormatter()
    if log_format == "json":
        return JsonFormatter()
    return EscapedFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s")


def configure(level: str, log_format: str) -> None:
    """Send every record of ``level`` and above to stderr in ``log_format``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(log_format))
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler])
