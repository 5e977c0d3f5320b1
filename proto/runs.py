"""Granule runs: which byte ranges of a buffer must be backed for given segment sizes.

The daemon decides a commit's new chunks with these, and a client placing
leased granules or making chunks on credit computes the same ranges from the
same inputs, so both sides agree on them without a round trip.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from .units import round_up


def prefix_offsets(capacities: list[int]) -> list[int]:
    """Where each segment starts: segments lie back to back, each where the one before ends."""
    return list(itertools.accumulate(capacities, initial=0))[:-1]


def merge_runs(runs: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge half-open ``(start, end)`` runs into sorted, disjoint, non-touching runs."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(r for r in runs if r[0] < r[1]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def subtract_runs(runs: list[tuple[int, int]], taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of sorted disjoint ``runs`` not covered by sorted disjoint ``taken``."""
    out: list[tuple[int, int]] = []
    j = 0
    for start, end in runs:
        while j < len(taken) and taken[j][1] <= start:
            j += 1
        k = j
        while start < end:
            if k == len(taken) or taken[k][0] >= end:
                out.append((start, end))
                break
            if taken[k][0] > start:
                out.append((start, taken[k][0]))
            start = max(start, taken[k][1])
            k += 1
    return out


def backed_runs(offsets: list[int], sizes: list[int], granule: int) -> list[tuple[int, int]]:
    """Byte runs (granule-aligned, merged) that must be backed to hold ``sizes[i]`` bytes of the segment at
    ``offsets[i]``.

    A granule straddling two segments appears once: the runs are merged.
    """
    return merge_runs(
        (offset // granule * granule, round_up(offset + size, granule)) for offset, size in zip(offsets, sizes) if size
    )


def new_runs(offsets: list[int], old_sizes: list[int], new_sizes: list[int], granule: int) -> list[tuple[int, int]]:
    """The runs (granule-aligned, merged) that growing the segments at ``offsets`` from ``old_sizes`` to
    ``new_sizes`` must back: one new chunk each, as the daemon makes them.

    Where every segment starts on a granule no granule is shared by two
    segments, and each segment's new granules follow its old ones: the
    common case (a commit on a client's critical path) takes that short way.
    """
    if any(offset % granule for offset in offsets):
        return subtract_runs(backed_runs(offsets, new_sizes, granule), backed_runs(offsets, old_sizes, granule))
    return merge_runs(
        (round_up(offset + old, granule), round_up(offset + new, granule))
        for offset, old, new in zip(offsets, old_sizes, new_sizes)
        if new > old
    )

