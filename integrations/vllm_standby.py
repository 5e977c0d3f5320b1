"""A warm standby of a vLLM engine: ``HBMD_VLLM_STANDBY=1`` beside ``HBMD_VLLM_KEEP_KV=1``.

A standby is a second engine of the same ``HBMD_VLLM_ENGINE`` name on the
same GPU. It starts as any keeping engine does (weights, profiling, warm-up,
CUDA graphs, all against its own KV buffer) and stops at vLLM's measure
after warm-up, the one point where the size of its cache is still open:

- there it gives its KV pages back (its CUDA graphs keep the addresses, which
  stay reserved) and the PyTorch allocator's cache, so that while it waits it
  holds in hbmd nothing but an empty buffer;
- it takes the head of the engine's standby line (a lock in the index
  folder: of several standbys one waits at the head, the others behind it);
- it waits for the active engine's session, the one whose buffer the rank's
  note names, to end (where none runs, it does not wait: of a pair started
  together, the first at the head of the line serves). The wait is woken by the kernel (a pidfd of the
  session's process as the daemon recorded it), not by polling, and
  rechecked with the daemon, which orphans the buffer when it reads the
  hang-up;
- then it goes on as a successor does (:mod:`hbmd.integrations.vllm_keep`):
  vLLM measures, the predecessor's pages are grafted under the standby's
  addresses, the note becomes the standby's and the line moves on to the
  next standby, which now stands by for this one. The scheduler seeds the
  prefix cache from the index at its first step.

An engine alive but hung is waited for, whatever it takes: its pages stay
its own until its process ends (the operator fences it by ending it). A
standby whose vLLM configuration, environment or weights differ from what
the active engine's index is bound to refuses to start, naming the fields.
"""

from __future__ import annotations

import fcntl
import logging
import os
import select
import sys
import time
from typing import Any

from hbmd.proto.units import format_bytes

from . import vllm_keep
from .kv_index import NotAnIndex, read_header
from .vllm_keep import Donor, KeepingOff, KeptRank, Scope, read_note
from .vllm_prefix import shared_fields

log = logging.getLogger("vllm.hbmd")

READY_TIMEOUT = "VLLM_ENGINE_READY_TIMEOUT_S"
NO_LIMIT_S = -1
"""How long vLLM's front end waits for a standby's engine core to be ready, which is not until it took over, and
may be never: vLLM polls for it with pyzmq for this many seconds times 1,000, and pyzmq reads a negative wait as no
limit (a long one overflows the C int it is passed as: 24.8 days at most)."""
SETTLE_S = (0.002, 0.25)
"""A session whose process ended is ended by the daemon as soon as it reads the hang-up: looked at again after the
first, up to the second, doubling (a forked child may hold the session's socket on)."""
LET_GO_S = 0.25
"""How often a standby asks the daemon whether the active engine let go of its cache (a clean stop does, before its
process ends; a death is told at once by the pidfd)."""
SHARED_FIELDS = ("config.", "env.", "weights.")
"""The fields of a kept index's key a standby can tell at its start, before its scheduler exists."""


class StandbyRefused(RuntimeError):
    """This standby can never take over the engine it was started beside: it stops, saying why."""


def patch_front_end() -> None:
    """vLLM's front end waits ``VLLM_ENGINE_READY_TIMEOUT_S`` for its engine core, and a standby's is not ready
    until it takes over: unless the operator set that wait, it has no limit. The module's name is changed, not the
    environment, which vLLM's compile factors (and so the kept index's key) include."""
    if os.environ.get(READY_TIMEOUT):
        return
    from vllm.v1.engine import core_client

    core_client.VLLM_ENGINE_READY_TIMEOUT_S = NO_LIMIT_S


def waiting(measure: Any) -> Any:
    """Wrap vLLM's measure after warm-up so that a standby waits in it for its takeover, then measures."""

    def measured(kv_cache: Any, *args: Any, **kwargs: Any) -> int:
        rank = vllm_keep._rank
        client = getattr(kv_cache.buffer, "client", None)
        if rank is not None and rank.standing_by and client is not None:
            stand_by(client, kv_cache, rank, args[0] if args else kwargs.get("vllm_config"))
        return measure(kv_cache, *args, **kwargs)

    measured.__wrapped__ = measure  # type: ignore[attr-defined]
    return measured


def stand_by(client: Any, kv_cache: Any, rank: KeptRank, config: Any) -> None:
    """Hold little, take the head of the line, wait for the active engine's end, and find the cache it left.
    ``config``: the engine's ``VllmConfig``, as vLLM's measure is given it (None: nothing is checked against it)."""
    if config is not None and config.parallel_config.world_size > 1:
        raise StandbyRefused("a standby serves one GPU: tensor and pipeline parallel engines cannot stand by "
                             f"({vllm_keep.STANDBY})")
    kv_cache.buffer.release_physical()  # warm-up's scratch; the addresses, which CUDA graphs hold, stay reserved
    kv_cache.num_committed_blocks = 0
    release_allocator_cache()
    rank.line = take_line(rank.scope)
    log.info("hbmd: this engine stands by for engine %s (at the head of its standby line), holding %s in hbmd",
             rank.scope.engine, format_bytes(kv_cache.buffer.physical_bytes))
    active = active_buffer(client, rank)
    if config is not None:
        refuse_unlike(config, rank.scope)
    if active is not None and active[1] != 0:
        name, session = active
        log.info("hbmd: standing by for %s (session %d)", name, session)
        until_ended(client, name, session)
        log.info("hbmd: the active engine's session %d ended: taking over its KV cache %s", session, name)
    else:
        log.info("hbmd: no engine %s runs: this standby takes over at once", rank.scope.engine)
    rank.donor = left_donor(client, rank)


def release_allocator_cache() -> None:
    """Give the PyTorch allocator's cached device memory (the warm-up's activations) back while standing by."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def take_line(scope: Scope) -> int:
    """Wait for the head of the engine's standby line: an exclusive lock on a file in the index folder, which the
    kernel hands on when its holder ends or takes over (:meth:`~hbmd.integrations.vllm_keep.KeptRank.leave_line`)."""
    path = vllm_keep.index_dir() / f"{scope.files()}.standby"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("hbmd: another standby of engine %s is at the head of the line: this one waits behind it",
                     scope.engine)
            fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


def active_buffer(client: Any, rank: KeptRank) -> tuple[str, int] | None:
    """The buffer the rank's note names (the active engine's) and the session holding it (0: none, it is an
    orphan), or None where there is no such buffer (no engine of this name ran, or its cache is gone)."""
    note = read_note(rank.scope.note_path(rank.rank))
    name = note.get("buffer") if note is not None else None
    if not isinstance(name, str) or not rank.scope.kept_name(rank.rank, name) or name == rank.name:
        return None
    listed = client.buffers(name=name, owner_uid=os.getuid())
    return (name, listed[0].session_id) if listed else None


def until_ended(client: Any, name: str, session: int) -> None:
    """Block until ``session`` no longer holds ``name``: asleep on a pidfd of the session's process, which the kernel
    makes readable the moment the process ends, and asking the daemon every :data:`LET_GO_S` meanwhile (a clean stop
    lets go of the cache before its process ends; a pid reused before the pidfd was opened is never waited on)."""
    pidfd = process_of(client, session)
    settle = SETTLE_S[0]
    try:
        while holds(client, name, session):
            ready, _, _ = select.select([pidfd] if pidfd is not None else [], [], [], LET_GO_S)
            if ready:  # the process ended: the daemon ends its session as soon as it reads the hang-up
                time.sleep(settle)
                settle = min(settle * 2, SETTLE_S[1])
    finally:
        if pidfd is not None:
            os.close(pidfd)


def holds(client: Any, name: str, session: int) -> bool:
    listed = client.buffers(name=name, owner_uid=os.getuid())
    return bool(listed) and listed[0].session_id == session


def process_of(client: Any, session: int) -> int | None:
    """A pidfd of the process that opened ``session``, or None where it cannot be had (the process ended, or the
    daemon does not say)."""
    pids = [info.pid for info in client.sessions(session)]
    if not pids or pids[0] <= 0:
        return None
    try:
        return os.pidfd_open(pids[0])
    except OSError:
        return None


def refuse_unlike(config: Any, scope: Scope) -> None:
    """:class:`StandbyRefused` where the active engine's index is bound to another configuration, environment or
    weights than this standby's (another model, its settings or another vLLM: it could never adopt what the active
    engine keeps). Nothing is said where the index cannot be read: the takeover then decides, as a restart does."""
    try:
        theirs = read_header(scope.index_path()).get("key", {})
        mine = shared_fields(config)
    except (OSError, NotAnIndex, KeepingOff):
        return
    changed = sorted(field for field in set(mine) | {f for f in theirs if f.startswith(SHARED_FIELDS)}
                     if mine.get(field) != theirs.get(field))
    if changed:
        raise StandbyRefused(f"this standby cannot take over engine {scope.engine}: its configuration differs in "
                             f"{', '.join(changed[:6])}{' and more' if len(changed) > 6 else ''}")


def left_donor(client: Any, rank: KeptRank) -> Donor | None:
    """The cache the index says the active engine left, where the daemon still lists it (a session that still holds
    it is waited for as for any successor's donor: ``vllm_keep.settle_donor``)."""
    expected, why = vllm_keep.expected_donor(rank.scope, rank.rank, rank.gpu)
    listed = client.buffers(name=expected, owner_uid=os.getuid()) if expected is not None else []
    if expected is not None and not listed:
        why = vllm_keep.donor_gone(expected)
    if not listed:
        rank.why_cold = why
        log.warning("hbmd: taking over without the active engine's KV cache: %s", why)
        return None
    return Donor.listed(listed[0])
