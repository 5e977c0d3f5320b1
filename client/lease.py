"""The granules a daemon leased to this session, imported ahead of use.

The daemon creates and exports granules before they are needed and sends
them on the handle socket (:class:`LeaseGrant`); the client's listener thread
imports each as it arrives. A commit whose new granules the lease covers
takes them from here, tells the daemon where they go (:class:`LeasePlace`,
sent before they are mapped) and maps them: no round trip. Granules the
daemon asks back (:class:`LeaseRevoke`) and has not seen placed are given
back (:class:`LeaseReturn`), as is the whole lease when a commit through the
daemon does not fit without it.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

from hbmd.proto import LeaseGrant, LeaseReturn, LeaseRevoke, Message

from .mapper import Mapper

log = logging.getLogger("hbmd.client")

MAX_UNWANTED = 4096
"""Chunk ids remembered as not wanted before their grant arrives; the oldest are forgotten past this."""


class Lease:
    """Leased granules by chunk id, each imported (:meth:`Mapper.prepare`) and ready to map."""

    def __init__(self, granule: int, mapper: Callable[[], Mapper], send: Callable[[Message], None]) -> None:
        """``mapper`` gives the session's mapper (asked once, at the first grant); ``send`` sends a datagram."""
        self.granule = granule
        self._get_mapper = mapper
        self._mapper_now: Mapper | None = None
        self._send = send
        self._lock = threading.Lock()
        self._ready: dict[int, Any] = {}
        self._unwanted: set[int] = set()
        """Chunk ids to give back when their grant arrives (asked back, or released, before it was read)."""

    def _mapper(self) -> Mapper:
        if self._mapper_now is None:
            self._mapper_now = self._get_mapper()
        return self._mapper_now

    def __len__(self) -> int:
        return len(self._ready)

    def granted(self, grant: LeaseGrant, fds: list[int]) -> None:
        """Import the granted granules, closing their FDs; those already asked back go straight back."""
        back: list[int] = []
        for chunk_id, fd in zip(grant.chunk_ids, fds):
            try:
                with self._lock:
                    unwanted = chunk_id in self._unwanted
                    self._unwanted.discard(chunk_id)
                if unwanted or grant.size != self.granule:
                    back.append(chunk_id)
                    continue
                prepared = self._mapper().prepare(fd)
                with self._lock:
                    self._ready[chunk_id] = prepared
            except Exception as exc:
                log.warning("importing leased chunk %d failed (%s); giving it back", chunk_id, exc)
                back.append(chunk_id)
            finally:
                os.close(fd)
        if back:
            self._send(LeaseReturn(back))

    def revoked(self, revoke: LeaseRevoke) -> None:
        """Give back the granules asked for that are still here; remember the others in case their grant is unread."""
        given = self._drop(revoke.chunk_ids)
        if given:
            self._send(LeaseReturn(given))

    def _drop(self, chunk_ids: list[int]) -> list[int]:
        with self._lock:
            dropped = [(c, self._ready.pop(c)) for c in chunk_ids if c in self._ready]
            self._unwanted.update(set(chunk_ids).difference(c for c, _ in dropped))
            while len(self._unwanted) > MAX_UNWANTED:
                self._unwanted.discard(min(self._unwanted))
        for _, prepared in dropped:
            self._mapper().discard(prepared)
        return [c for c, _ in dropped]

    def give_back(self) -> int:
        """Return every granule here to the daemon (it releases them); how many there were."""
        with self._lock:
            here = list(self._ready)
        given = self._drop(here)
        if given:
            self._send(LeaseReturn(given))
        return len(given)

    def take(self, count: int) -> list[tuple[int, Any]] | None:
        """``count`` granules to place, or None when fewer are here (nothing is taken then)."""
        with self._lock:
            if len(self._ready) < count:
                return None
            return [self._ready.popitem() for _ in range(count)]

    def put_back(self, taken: list[tuple[int, Any]]) -> None:
        """Granules taken but not placed (the placement could not be sent)."""
        with self._lock:
            self._ready.update(taken)

    def close(self) -> None:
        """Let go of every imported granule; the daemon releases them when the session ends."""
        with self._lock:
            ready, self._ready = self._ready, {}
        for prepared in ready.values():
            try:
                self._mapper_now.discard(prepared)
            except Exception as exc:
                log.debug("discarding a leased chunk failed: %s", exc)
