"""What ``hbmctl`` prints: its exit codes, what a command found, and that as a table, JSON or csv."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import unicodedata
from collections.abc import Callable
from operator import itemgetter
from typing import Any

from hbmd.proto.text import shown
from hbmd.proto.units import format_bytes

EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE, EXIT_REFUSED, EXIT_UNANSWERED = 0, 1, 2, 3, 4


def duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
"""How a cell starts that a spreadsheet opening the csv would run as a formula (OWASP's list)."""


def _shown_cell(value: Any) -> Any:
    """A csv cell: text shown safely (names come from peers, and a daemon older than the hello's check passes any
    on), and text a spreadsheet would take for a formula quoted with a leading apostrophe, as spreadsheets quote."""
    if not isinstance(value, str):
        return value
    text = shown(value)
    return "'" + text if _runs_as_formula(text) else text


def _runs_as_formula(text: str) -> bool:
    """Whether a spreadsheet may take ``text`` for a formula: it starts with one of :data:`FORMULA_STARTS`, after
    spaces (which spreadsheets skip), or with a character that reads as one once its compatibility form is taken
    (a fullwidth equals or at sign, U+FF1D or U+FF20, which some spreadsheets turn into ``=`` and ``@``)."""
    stripped = text.lstrip()
    return text.startswith(FORMULA_STARTS) or unicodedata.normalize("NFKC", stripped[:1]).startswith(FORMULA_STARTS)


def render_table(headers: list[str], rows: list[list[Any]], with_headers: bool = True) -> str:
    """Columns padded to their widest cell; numbers right-aligned, text left-aligned."""
    cells = [[shown(str(c)) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [
        all(isinstance(row[i], (int, float)) or _looks_numeric(str(row[i])) for row in rows)
        for i in range(len(headers))
    ]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    return "\n".join(([line(headers)] if with_headers else []) + [line(r) for r in cells])


def _looks_numeric(text: str) -> bool:
    return bool(text) and (text[0].isdigit() or text == "-")


def as_dict(obj: Any) -> dict[str, Any]:
    return dataclasses.asdict(obj)


class UsageError(Exception):
    """The command line is ambiguous or contradictory; hbmctl exits 2."""


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of a listing.

    Its header, its cell for people, its cell for csv, and whether only ``-o wide`` shows it.
    """

    header: str
    human: Callable[[Any], Any]
    raw: Callable[[Any], Any]
    wide: bool = False


@dataclasses.dataclass
class Output:
    """What a command found: ``data`` for JSON; ``text``, or rows of ``items`` under ``columns``, for people and csv."""

    data: dict[str, Any]
    text: str = ""
    columns: list[Column] = dataclasses.field(default_factory=list)
    items: list[Any] = dataclasses.field(default_factory=list)
    empty: str = ""
    """What the table says when there are no rows."""
    complaint: str = ""
    """Said on stderr after the output, where ``exit_code`` is not 0."""
    exit_code: int = EXIT_OK


def render(output: Output, fmt: str, with_headers: bool) -> str:
    """``output`` as ``fmt`` (table, wide, json or csv) says."""
    if fmt == "json":
        return json.dumps(output.data, indent=2, sort_keys=True)
    columns = output.columns or [Column(key, itemgetter(key), itemgetter(key)) for key in output.data]
    items = output.items if output.columns else [output.data]
    if fmt == "csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        if with_headers:
            writer.writerow([c.header.lower() for c in columns])
        writer.writerows([[_shown_cell(c.raw(item)) for c in columns] for item in items])
        return buffer.getvalue().rstrip("\n")
    if output.columns and (fmt == "wide" or not output.text):
        listed = [c for c in columns if fmt == "wide" or not c.wide]
        if not items:
            return output.empty
        return render_table(
            [c.header for c in listed], [[c.human(item) for c in listed] for item in items], with_headers
        )
    return "\n".join(shown(line) for line in output.text.split("\n"))


def bytes_column(header: str, key: str, wide: bool = False) -> Column:
    """Bytes as ``1.5 GiB`` for people and as a plain integer for csv; "-" where the figure is missing."""
    return Column(
        header,
        lambda r: "-" if r.get(key) is None else format_bytes(r[key]),
        lambda r: "" if r.get(key) is None else r[key],
        wide,
    )


def constant(value: Any) -> Callable[[Any], Any]:
    """A cell that is ``value`` in every row."""
    return lambda _row: value


def plain_column(header: str, key: str, wide: bool = False, human: Callable[[Any], Any] | None = None) -> Column:
    return Column(
        header,
        lambda r: "-" if r.get(key) in (None, "") else (human or str)(r[key]),
        lambda r: "" if r.get(key) is None else r[key],
        wide,
    )


def none_for_empty(record: dict[str, Any], *keys: str) -> dict[str, Any]:
    """``record`` with each of ``keys`` whose wire value is empty ("" or 0: nothing of the kind) set to None."""
    for key in keys:
        if not record[key]:
            record[key] = None
    return record


def none_for_negative(record: dict[str, Any], *keys: str) -> dict[str, Any]:
    """``record`` with each of ``keys`` whose wire value is -1 ("none" or "unknown") set to None: JSON's null."""
    for key in keys:
        if record[key] is not None and record[key] < 0:
            record[key] = None
    return record
