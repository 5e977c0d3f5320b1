"""A prefix cache that outlives the vLLM engine: ``HBMD_VLLM_KEEP_KV=1``.

An engine that keeps its KV cache leaves it in hbmd when it exits, however it
exits: its buffer is persistent, an orphan once the engine's session ends
(a clean stop, where vLLM frees its cache, lets go of it instead:
``VllmExtensibleTensor.free``), and the daemon frees it after ``HBMD_VLLM_KEEP_KV_GRACE_S`` seconds unless a
successor adopts it. Beside it the engine keeps an index of which block holds
which prefix (:mod:`hbmd.integrations.kv_index`), in ``HBMD_VLLM_KV_INDEX_DIR``.
A successor of the same ``HBMD_VLLM_ENGINE`` name adopts both:

- its worker makes a KV buffer of its own, as any engine does (vLLM's
  warm-up writes into KV blocks, and CUDA graphs capture the buffer's
  address), then, at vLLM's final sizing, drops the warm-up's pages and
  *grafts* the predecessor's: the daemon moves the orphan's chunks, with their
  data, under the new buffer's addresses. Nothing is copied; the orphan's
  memory, charged to it until then, is counted into the new engine's block
  count (:func:`counting_kept_blocks`), so the successor is as large as its
  predecessor left room for.
- its scheduler puts every block the index publishes into vLLM's block pool as
  a cached free block, so the first request with a known prefix is served from
  it (vLLM's ``num_cached_tokens`` says so).

What makes this safe (ARCHITECTURE.md, "A prefix cache that survives the
engine"): a block is published only after the step that computed it finished,
and withdrawn, on disk, before the step that reuses it runs; the index is bound
to everything the KV bytes depend on (:func:`~hbmd.integrations.vllm_prefix.compatibility`), and a successor
adopts only where every field agrees and every rank grafted the very buffers the
index names, else it starts cold and says why; the daemon refuses to graft a
buffer a live session holds, so a predecessor still running is waited for
(``HBMD_VLLM_KEEP_KV_WAIT_S``), never shared.

Kept buffers alternate between two names per rank (``vllm-<engine>-rank<R>``
and the same with ``.b``): the successor's own buffer takes the name the
predecessor's is not using.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hbmd.proto.errors import HbmdError
from hbmd.proto.units import format_bytes

from .settings import seconds, switch

log = logging.getLogger("vllm.hbmd")

KEEP = "HBMD_VLLM_KEEP_KV"
GRACE = "HBMD_VLLM_KEEP_KV_GRACE_S"
DEFAULT_GRACE_S = 600.0
"""How long the daemon keeps a kept cache nobody adopts: a restart takes well under it, a retired engine's cache is
not held for good."""
WAIT = "HBMD_VLLM_KEEP_KV_WAIT_S"
DEFAULT_WAIT_S = 30.0
"""How long a successor waits for a predecessor that still holds its cache (a rolling restart) before starting
cold."""
INDEX_DIR = "HBMD_VLLM_KV_INDEX_DIR"
SECOND_NAME_SUFFIX = ".b"
WAIT_POLL_S = 0.25


MOST_S = 86400 * 7


def keeps() -> bool:
    """Whether ``HBMD_VLLM_KEEP_KV`` is on; ``ValueError`` for a value that is neither on nor off."""
    return switch(KEEP)


def check_settings() -> None:
    """Read every setting of this module, so that a misspelt one stops the engine at start."""
    if keeps():
        seconds(GRACE, DEFAULT_GRACE_S, MOST_S)
        seconds(WAIT, DEFAULT_WAIT_S, MOST_S)
        if not os.environ.get("HBMD_VLLM_ENGINE"):
            raise ValueError(f"{KEEP} needs HBMD_VLLM_ENGINE: the name a restarted engine finds its cache by")


def index_dir() -> Path:
    """Where the indexes and the ranks' notes live: ``HBMD_VLLM_KV_INDEX_DIR``, or a folder of this user's in
    ``/dev/shm`` (memory, like what it describes; gone at reboot, as the GPU's memory is)."""
    folder = Path(os.environ.get(INDEX_DIR) or f"/dev/shm/hbmd-vllm-{os.getuid()}")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder


def engine_name() -> str:
    return os.environ["HBMD_VLLM_ENGINE"]


def rank_note(rank: int) -> Path:
    return index_dir() / f"{engine_name()}.rank{rank}.json"


def index_path() -> Path:
    return index_dir() / f"{engine_name()}.index"


# --- the worker's side: one kept buffer per rank, grafted from the predecessor's --------------------------------


@dataclasses.dataclass
class Donor:
    """The predecessor's kept buffer of this rank, as the daemon lists it."""

    name: str
    buffer_id: int
    segment_capacities: list[int]
    segment_sizes: list[int]
    physical_bytes: int
    held: bool
    """A live session holds it: the predecessor runs on."""

    @classmethod
    def listed(cls, info: Any) -> Donor:
        return cls(info.name, info.buffer_id, list(info.segment_capacities), list(info.segment_sizes),
                   info.physical_bytes, info.session_id > 0)


@dataclasses.dataclass
class KeptRank:
    """This worker's kept buffer and the predecessor's it may adopt."""

    rank: int
    name: str
    donor: Donor | None
    grafted_blocks: int = 0

    def write_note(self, buffer_id: int, adopted_from: int | None) -> None:
        """Tell the scheduler (another process under tensor parallelism) which buffer this rank holds and whose
        blocks it adopted."""
        note = {"name": self.name, "buffer_id": buffer_id, "adopted_from": adopted_from,
                "adopted_blocks": self.grafted_blocks, "pid": os.getpid()}
        staging = rank_note(self.rank).with_suffix(f".new-{os.getpid()}")
        staging.write_text(json.dumps(note))
        os.replace(staging, rank_note(self.rank))


_rank: KeptRank | None = None
"""This worker process's kept buffer (one rank per process), from the KV tensor's creation on."""


def choose_names(client: Any, base: str, rank: int) -> KeptRank:
    """The name this rank's new buffer takes and the predecessor's buffer it may adopt; ``RuntimeError`` where both
    names are held (two engines run under one name)."""
    names = (base, base + SECOND_NAME_SUFFIX)
    uid = os.getuid()
    listed = {b.name: b for name in names for b in client.buffers(name=name, owner_uid=uid)}
    free = [n for n in names if n not in listed]
    if not free:
        raise RuntimeError(f"both of engine {engine_name()}'s kept KV buffers ({', '.join(names)}) are held: another "
                           "engine runs under this HBMD_VLLM_ENGINE; give each engine a name of its own")
    other = names[1] if free[0] == names[0] else names[0]
    donor = None
    if other in listed:
        donor = Donor.listed(listed[other])
    return KeptRank(rank, free[0], donor)


def kept_tensor_options(client: Any, base: str, rank: int) -> dict[str, Any]:
    """What the KV tensor of a keeping engine is created with: its name, persistence and grace period."""
    global _rank
    _rank = choose_names(client, base, rank)
    if _rank.donor is not None:
        log.info("hbmd keeps this engine's KV cache: the predecessor's (%s, %s) is adopted at the final sizing",
                 _rank.donor.name, format_bytes(_rank.donor.physical_bytes))
    return {"name": _rank.name, "persistent": True, "keep_orphan_s": seconds(GRACE, DEFAULT_GRACE_S, MOST_S)}


def donor_blocks(kv_cache: Any, donor: Donor) -> int:
    """The predecessor's blocks its buffer backs, in every segment."""
    return min(size // stride for size, stride in zip(donor.segment_sizes, kv_cache.segment_strides))


def settle_donor(client: Any, capacities: list[int]) -> Donor | None:
    """This rank's donor once no live session holds it (waiting up to ``HBMD_VLLM_KEEP_KV_WAIT_S``), None where
    there is none, the predecessor runs on, or its layout is not this engine's (``capacities``, per segment: another
    model under this engine's name, which the daemon would refuse to graft)."""
    rank = _rank
    if rank is None or rank.donor is None:
        return None
    if rank.donor.segment_capacities != capacities:
        log.warning("the kept KV cache %s is laid out for another model (%d segments, where this engine has %d): this "
                    "engine starts with a cold cache; the daemon frees that one at its grace period's end",
                    rank.donor.name, len(rank.donor.segment_capacities), len(capacities))
        rank.donor = None
        return None
    wait = seconds(WAIT, DEFAULT_WAIT_S, MOST_S)
    deadline = time.monotonic() + wait
    while rank.donor.held:
        if time.monotonic() >= deadline:
            log.warning("the predecessor still holds %s after %g s: this engine starts with a cold cache",
                        rank.donor.name, wait)
            rank.donor = None
            return None
        time.sleep(WAIT_POLL_S)
        listed = client.buffers(name=rank.donor.name, owner_uid=os.getuid())
        if not listed:
            rank.donor = None
            return None
        rank.donor = Donor.listed(listed[0])
    return rank.donor


def counting_kept_blocks(original: Callable[..., int]) -> Callable[..., int]:
    """Wrap vLLM's measure of the KV cache after warm-up so that it counts the predecessor's blocks as this
    engine's (they are, once grafted; until then the daemon charges them to the orphan, so free memory, what vLLM
    measures, and the daemon's room, what hbmd's cap reads, both leave them out), less the room a successor's
    warm-up will need beside this engine's kept cache (:func:`warm_up_room`).

    Never fewer than the predecessor's blocks: their memory is held already, and a graft takes all of them or
    none. The room left beside them may then fall short of the warm-up's and its tenth, by what the orphan's
    rounding up to whole chunks took from the budget, but never of what this engine's warm-up committed: that
    warm-up fit in it, and the next engine's, of the same model and settings, commits as much."""

    def measured(kv_cache: Any, *args: Any, **kwargs: Any) -> int:
        blocks = original(kv_cache, *args, **kwargs)
        client = getattr(kv_cache.buffer, "client", None)
        donor = settle_donor(client, list(kv_cache.buffer.segment_capacities)) if client is not None else None
        adopted = 0
        if donor is not None:
            adopted = donor_blocks(kv_cache, donor)
            blocks = min(kv_cache.capacity_blocks, blocks + adopted)
        sized = max(1, adopted, blocks - warm_up_room(kv_cache))
        if blocks > sized:
            log.info("hbmd keeps %d KV blocks free of this engine's cache for its successor's warm-up", blocks - sized)
        return sized

    measured.__wrapped__ = original  # type: ignore[attr-defined]
    return measured


def warm_up_room(kv_cache: Any) -> int:
    """The blocks a successor's warm-up commits before it can graft this cache: what this engine's warm-up
    committed (the same model and settings warm up alike), and a tenth more. Left out of a kept cache, so that a
    successor finds them free beside it even where the cache had the whole budget (on an H100 a successor could
    not commit its first block otherwise)."""
    committed = kv_cache.num_committed_blocks
    return committed + max(1, committed // 10)


def grafting(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap vLLM's ``extend_kv_cache`` (the final sizing, after warm-up) so that a keeping engine first adopts its
    predecessor's pages in place of the warm-up's, then lets vLLM grow the rest."""

    def extend(runner: Any, kv_cache_config: Any, num_blocks: int) -> Any:
        kv_cache = getattr(runner, "extensible_kv_cache", None)
        rank = _rank
        if rank is not None and kv_cache is not None and hasattr(kv_cache.buffer, "graft"):
            from vllm.v1.worker.extensible_kv_cache import registers_kv_cache_memory

            adopted_from = graft_donor(rank, kv_cache, num_blocks, registers_kv_cache_memory(runner.vllm_config))
            rank.write_note(kv_cache.buffer.buffer_id, adopted_from)
        return original(runner, kv_cache_config, num_blocks)

    extend.__wrapped__ = original  # type: ignore[attr-defined]
    return extend


def graft_donor(rank: KeptRank, kv_cache: Any, num_blocks: int, registers: bool) -> int | None:
    """Graft the predecessor's buffer under ``kv_cache``; returns its buffer id, or None (cold, said why). A donor
    that cannot be adopted is deleted: the block count vLLM is about to commit counted its memory."""
    donor = rank.donor
    if donor is None:
        return None
    buffer = kv_cache.buffer
    blocks = donor_blocks(kv_cache, donor)
    why = None
    if registers:
        why = "a KV connector registers the cache, which vLLM remaps as one allocation per segment"
    elif blocks > num_blocks:
        why = f"it holds {blocks} blocks, more than the {num_blocks} this engine has"
    if why is None:
        buffer.release_physical()  # the warm-up's pages: vLLM's own scratch
        kv_cache.num_committed_blocks = 0
        try:
            buffer.graft(donor.name)
        except HbmdError as exc:
            why = f"the daemon refused the graft: {exc}"
    if why is not None:
        log.warning("hbmd cannot adopt the predecessor's KV cache %s (%s): this engine starts cold", donor.name, why)
        try:
            buffer.client.delete(donor.name)
        except HbmdError as exc:
            log.warning("deleting %s failed (%s): the daemon frees it at its grace period's end", donor.name, exc)
        rank.donor = None
        return None
    kv_cache.num_committed_blocks = blocks
    rank.grafted_blocks = blocks
    log.info("adopted the predecessor's KV cache: %d blocks (%s) of %s, no copy", blocks,
             format_bytes(buffer.physical_bytes), donor.name)
    return donor.buffer_id


def patch(extensible_kv_cache: Any) -> None:
    """Route vLLM's final sizing and its scheduler through this module: where ``HBMD_VLLM_KEEP_KV`` is on."""
    extend = extensible_kv_cache.extend_kv_cache
    if not hasattr(extend, "__wrapped__"):
        extensible_kv_cache.extend_kv_cache = grafting(extend)
    from vllm.v1.core.sched.scheduler import Scheduler

    from .vllm_prefix import keeping_scheduler

    keeping_scheduler(Scheduler)


def patch_worker(worker: Any) -> None:
    """vLLM's GPU worker imports ``extend_kv_cache`` by name: point that name at the grafting one too."""
    extend = getattr(worker, "extend_kv_cache", None)
    if extend is not None and not hasattr(extend, "__wrapped__"):
        worker.extend_kv_cache = grafting(extend)


def note_created(buffer_id: int) -> None:
    """This rank's buffer exists: its note says so, and that nothing is adopted yet (a note a predecessor left must
    not speak for this engine)."""
    if _rank is not None:
        _rank.write_note(buffer_id, None)
