"""Journaled sessions and buffers read back as types, each checked whole before anything of it is restored.

A record comes from the journal (or a handover) of this daemon or an older
one. It is trusted as written, but a damaged one must cost its own session
or buffer and nothing else: so every field is read with its type and range,
and a buffer's layout is held to what ``check_invariants`` holds a live
buffer to. Whatever does not hold raises ``ValueError`` naming it, before the
restore has taken anything.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hbmd.proto import TIER_DEVICE, TIER_HOST
from hbmd.proto.buffers import MAX_NAME
from hbmd.proto.runs import backed_runs, merge_runs, prefix_offsets
from hbmd.proto.units import round_up

from ..state.invariants import check_chunk_layout
from ..state.records import MAX_CAPACITY, Answer, Chunk

MAX_ID = (1 << 63) - 1
MAX_UID = (1 << 32) - 1
REQUIRED: Any = object()
"""The default of a field a record must have."""


def _value(record: dict[str, Any], key: str, default: Any) -> Any:
    value = record.get(key, default)
    if value is REQUIRED:
        raise ValueError(f"it has no {key}")
    return value


def whole(record: dict[str, Any], key: str, low: int, high: int, default: Any = REQUIRED) -> int:
    """The integer field ``key``, in ``[low, high]``."""
    value = _value(record, key, default)
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"its {key} {value!r} is not an integer in [{low}, {high}]")
    return value


def flag(record: dict[str, Any], key: str, default: Any = REQUIRED) -> bool:
    value = _value(record, key, default)
    if type(value) is not bool:
        raise ValueError(f"its {key} {value!r} is not true or false")
    return value


def text(record: dict[str, Any], key: str, longest: int, default: Any = REQUIRED) -> str:
    value = _value(record, key, default)
    if not isinstance(value, str) or len(value) > longest:
        raise ValueError(f"its {key} {value!r:.40} is not a string of at most {longest} characters")
    return value


def rows(record: dict[str, Any], key: str, width: tuple[int, ...], default: Any = REQUIRED) -> list[tuple[int, ...]]:
    """The field ``key``, a list of lists of non-negative integers, each of one of the lengths ``width``."""
    value = _value(record, key, default)
    if not isinstance(value, list) or not all(
        isinstance(row, list) and len(row) in width and all(type(n) is int and 0 <= n <= MAX_ID for n in row)
        for row in value
    ):
        raise ValueError(f"its {key} {value!r:.60} is not a list of {' or '.join(map(str, width))} integers each")
    return [tuple(row) for row in value]


def numbers(record: dict[str, Any], key: str, high: int, default: Any = REQUIRED) -> list[int]:
    value = _value(record, key, default)
    if not isinstance(value, list) or not all(type(n) is int and 0 <= n <= high for n in value):
        raise ValueError(f"its {key} {value!r:.60} is not a list of integers in [0, {high}]")
    return value


@dataclasses.dataclass(frozen=True)
class JournaledSession:
    """A session as journaled: what the restore takes back (``_restore_session``, :mod:`.restore`)."""

    session_id: int
    pid: int
    uid: int
    gid: int
    name: str
    tenant: str
    admin: bool
    wants_lease: bool
    wants_credit: bool
    credential: str
    previous_credential: str
    lease: list[int]
    """Ids of its leased granules."""
    credit: int
    demoted: bool
    answer: Answer | None
    holds: frozenset[int] | None
    """Ids of the buffers it owns or reads (version 7 on; None before)."""


def session_of(record: Any, granule: int, budget: int) -> JournaledSession:
    """Read a journaled session; raises ``ValueError`` naming what does not hold."""
    if not isinstance(record, dict):
        raise ValueError("its record is not a map")
    lease = rows(record, "lease", (2,))
    if any(size != granule for _, size in lease):
        raise ValueError(f"its lease holds a granule that is not of {granule} bytes")
    credit = whole(record, "credit", 0, budget, 0)
    wants_credit, wants_lease = flag(record, "wants_credit", False), flag(record, "wants_lease")
    if credit % granule or (credit and not wants_credit) or (lease and not wants_lease):
        raise ValueError(f"it holds a lease or credit ({credit} bytes) it cannot hold")
    return JournaledSession(
        session_id=whole(record, "id", 1, MAX_ID), pid=whole(record, "pid", 0, MAX_UID),
        uid=whole(record, "uid", 0, MAX_UID), gid=whole(record, "gid", 0, MAX_UID),
        name=text(record, "name", 1024), tenant=text(record, "tenant", MAX_NAME), admin=flag(record, "admin"),
        wants_lease=wants_lease, wants_credit=wants_credit, credential=text(record, "credential", 128),
        previous_credential=text(record, "previous_credential", 128, ""), lease=[chunk_id for chunk_id, _ in lease],
        credit=credit, demoted=flag(record, "demoted", False), answer=_answer(record.get("answer", REQUIRED)),
        holds=frozenset(numbers(record, "holds", MAX_ID)) if "holds" in record else None,
    )


def _answer(answer: Any) -> Answer | None:
    if answer is None:
        return None
    if (
        not isinstance(answer, list) or len(answer) != 4 or type(answer[0]) is not int or type(answer[2]) is not int
        or not (answer[1] is None or (isinstance(answer[1], list) and all(isinstance(f, bytes) for f in answer[1])))
        or not isinstance(answer[3], list) or not all(type(n) is int for n in answer[3])
    ):
        raise ValueError(f"its last answer {answer!r:.60} is not [request id, frames, buffer id, chunk ids]")
    return Answer(answer[0], answer[1], answer[2], list(answer[3]))


@dataclasses.dataclass(frozen=True)
class JournaledBuffer:
    """A buffer as journaled: what :func:`~.restore.rebuild_buffer` takes back, its chunks not adopted yet."""

    buffer_id: int
    name: str
    persistent: bool
    shareable: bool
    owner: int
    """Its session's id; 0 for an orphan."""
    uid: int
    tenant: str
    capacity: int
    capacities: list[int]
    sizes: list[int]
    sealed: bool
    readers: dict[int, int]
    chunks: list[Chunk[Any]]
    pending: list[Chunk[Any]]
    """Without handles yet; ``handle is None`` marks none, held only by their mappers: see :attr:`held`."""
    held: frozenset[int]
    """Ids of its chunks held only by the processes that map them (nothing parked for them)."""
    orphan: tuple[float, float, float, tuple[str, int]] = (0.0, 0.0, 0.0, ("", 0))
    """Its grace period as an orphan, when it became one, when it is due to be freed (Unix times) and who held it
    last (``daemon/state/orphans.py``); a buffer journaled without them is kept until deleted."""
    unsealed_since: float = 0.0
    """Unix time since which it has held its name unsealed (:attr:`Buffer.unsealed_since`); 0 where the journal does
    not say."""


def buffer_of(record: Any, granule: int) -> JournaledBuffer:
    """Read a journaled buffer, of any version; raises ``ValueError`` naming what does not hold."""
    if not isinstance(record, dict):
        raise ValueError("its record is not a map")
    capacity = whole(record, "capacity", 1, MAX_CAPACITY)
    capacities, sizes = _segments(record, capacity)
    host = set(numbers(record, "host", MAX_ID, []))
    held = frozenset(numbers(record, "held", MAX_ID, []))
    parts: dict[str, list[Chunk[Any]]] = {}
    for part in ("chunks", "pending"):
        journaled = rows(record, part, (3, 4), [] if part == "pending" else REQUIRED)
        # Versions 1 and 2 wrote a fourth field, 0 but where version 1's host backend parked the whole arena
        # (``tests/data/journals/v1``): no later daemon adopts that.
        if any(row[3:] not in ((), (0,)) for row in journaled):
            raise ValueError(f"its {part} are not [id, offset, size] each")
        parts[part] = [Chunk(row[0], row[1], row[2], None, tier=TIER_HOST if row[0] in host else TIER_DEVICE)
                       for row in journaled]
    buffer = JournaledBuffer(
        buffer_id=whole(record, "id", 1, MAX_ID), name=text(record, "name", MAX_NAME),
        persistent=flag(record, "persistent"), shareable=flag(record, "shareable", False),
        owner=whole(record, "owner", 0, MAX_ID), uid=whole(record, "uid", 0, MAX_UID),
        tenant=text(record, "tenant", MAX_NAME, ""), capacity=capacity, capacities=capacities, sizes=sizes,
        sealed=flag(record, "sealed", False), readers={s: n for s, n in rows(record, "readers", (2,), [])},
        chunks=parts["chunks"], pending=parts["pending"], held=held, orphan=_orphan(record),
        unsealed_since=_unix_time(record, "unsealed_since"),
    )
    _check_layout(buffer, granule)
    return buffer


MAX_SECONDS = float(1 << 40)
"""Past any grace period or Unix time a daemon writes: a larger one is damage."""


def _orphan(record: dict[str, Any]) -> tuple[float, float, float, tuple[str, int]]:
    """A record's grace period as an orphan, when it became one, its deadline and who held it last."""
    value = record.get("orphan", [0.0, 0.0, 0.0, "", 0])
    if not (isinstance(value, list) and len(value) == 5
            and all(type(t) in (int, float) and 0 <= t <= MAX_SECONDS for t in value[:3])
            and isinstance(value[3], str) and len(value[3]) <= MAX_NAME and type(value[4]) is int
            and 0 <= value[4] <= MAX_UID):
        raise ValueError(f"its orphan's grace {value!r:.80} is not [keep, since, until, holder, pid]")
    return float(value[0]), float(value[1]), float(value[2]), (value[3], value[4])


def _unix_time(record: dict[str, Any], key: str) -> float:
    """A record's Unix time ``key``; 0.0 where the record has none."""
    value = record.get(key, 0.0)
    if not (type(value) in (int, float) and 0 <= value <= MAX_SECONDS):
        raise ValueError(f"its {key} {value!r:.40} is not a Unix time")
    return float(value)


def _segments(record: dict[str, Any], capacity: int) -> tuple[list[int], list[int]]:
    """A record's segment capacities and committed sizes, from any journal version; each size within its segment,
    the capacities adding up to the buffer's."""
    if "capacities" in record or "segment_capacities" in record:
        new = "capacities" in record
        capacities = numbers(record, "capacities" if new else "segment_capacities", MAX_CAPACITY)
        sizes = numbers(record, "sizes" if new else "segment_sizes", MAX_CAPACITY)
    else:  # version 1: equal segments
        count = whole(record, "num_segments", 1, MAX_CAPACITY)
        capacities = [capacity // count] * count
        sizes = [whole(record, "bytes_per_segment", 0, capacity // count)] * count
    if not capacities or sum(capacities) != capacity or len(sizes) != len(capacities) or 0 in capacities:
        raise ValueError(f"its segments {capacities!r:.60} do not make up its capacity {capacity}")
    if any(size > room for size, room in zip(sizes, capacities)):
        raise ValueError(f"its committed sizes {sizes!r:.60} overflow their segments")
    return capacities, sizes


def _check_layout(buffer: JournaledBuffer, granule: int) -> None:
    """Hold the buffer to what ``check_invariants`` holds a live one to, but for its links to sessions."""
    reserved = round_up(buffer.capacity, granule)
    wanted = backed_runs(prefix_offsets(buffer.capacities), buffer.sizes, granule)
    ids: set[int] = set()
    for part, chunks in (("chunks", buffer.chunks), ("pending chunks", buffer.pending)):
        try:
            check_chunk_layout(f"its {part}", chunks, reserved, granule, ids)
        except AssertionError as exc:
            raise ValueError(str(exc)) from None
        covered = merge_runs((c.offset, c.offset + c.size) for c in chunks)
        if (chunks or part == "chunks") and covered != wanted:
            raise ValueError(f"its {part} cover {covered!r:.60}, not its committed prefixes {wanted!r:.60}")
        if len({c.tier for c in chunks}) > 1:
            raise ValueError(f"its {part} lie in two tiers")
    held = [c.chunk_id in buffer.held for c in buffer.chunks]
    if held != sorted(held, reverse=True) or not buffer.held <= {c.chunk_id for c in buffer.chunks}:
        raise ValueError("its chunks held only by their mappers are not a prefix of its chunks")
    if buffer.sealed and (not buffer.persistent or buffer.pending):
        raise ValueError("it is sealed but anonymous or mid-defragment")
    if (buffer.readers and not buffer.sealed) or any(n <= 0 for n in buffer.readers.values()):
        raise ValueError(f"its readers {buffer.readers!r:.60} cannot read it")
    if not buffer.owner and not buffer.persistent:
        raise ValueError("it is anonymous and held by no session")
