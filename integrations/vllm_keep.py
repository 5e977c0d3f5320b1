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
and withdrawn, on disk, before the step that reuses it runs; the index checks
itself whole; it is bound to everything the KV bytes depend on
(:func:`~hbmd.integrations.vllm_prefix.compatibility`) and to the very buffers
it describes, which carry a random generation in their names; a successor
adopts only where all of that agrees and every rank grafted those buffers,
else it starts cold and says why; a weight update in place withdraws the whole
index (:func:`weights_changed`); the daemon refuses to graft a buffer a live
session holds, so a predecessor still running is waited for
(``HBMD_VLLM_KEEP_KV_WAIT_S``), never shared.

Keeping never stops an engine from starting: where it cannot keep (the index
folder is another user's, or unwritable) or cannot adopt, the engine starts
without, saying why.

A kept cache is scoped by the engine's name and its data-parallel replica as
vLLM numbers it (``data_parallel_index``), and within that by each worker's
rank as vLLM's parallel state knows it (``parallel_config.rank``): buffers are
named ``vllm-<engine>-rank<R>.<generation>`` (``-dp<D>`` after the rank for
replica D > 0), the index ``<engine>.index`` (``<engine>.dp<D>.index``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import secrets
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hbmd.client.kept_names import GENERATION_HEX, buffer_base, is_kept
from hbmd.proto.errors import HbmdError
from hbmd.proto.units import format_bytes

from .kv_index import NotAnIndex, read_header, withdraw_all
from .settings import seconds, switch

log = logging.getLogger("vllm.hbmd")

KEEP = "HBMD_VLLM_KEEP_KV"
ENGINE = "HBMD_VLLM_ENGINE"
GRACE = "HBMD_VLLM_KEEP_KV_GRACE_S"
DEFAULT_GRACE_S = 600.0
"""How long the daemon keeps a kept cache nobody adopts: a restart takes well under it, a retired engine's cache is
not held for good."""
WAIT = "HBMD_VLLM_KEEP_KV_WAIT_S"
DEFAULT_WAIT_S = 30.0
"""How long a successor waits for a predecessor that still holds its cache (a rolling restart) before starting
cold."""
INDEX_DIR = "HBMD_VLLM_KV_INDEX_DIR"
STANDBY = "HBMD_VLLM_STANDBY"
"""On: this engine is a warm standby of the engine of its name (:mod:`hbmd.integrations.vllm_standby`)."""
WAIT_POLL_S = 0.25
MOST_S = 86400 * 7
ENGINE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""What an engine name may be: it names files in the index folder and buffers in the daemon, and a successor finds
its predecessor's by it."""


class KeepingOff(RuntimeError):
    """Why this engine cannot keep its KV cache: it starts and serves without keeping it."""


def keeps() -> bool:
    """Whether ``HBMD_VLLM_KEEP_KV`` is on; ``ValueError`` for a value that is neither on nor off."""
    return switch(KEEP)


def standing_by() -> bool:
    """Whether ``HBMD_VLLM_STANDBY`` is on; ``ValueError`` for a value that is neither on nor off."""
    return switch(STANDBY)


def check_settings() -> None:
    """Read every setting of this module, so that a misspelt one stops the engine at start."""
    if standing_by() and not keeps():
        raise ValueError(f"{STANDBY} needs {KEEP}=1: a standby takes over the kept cache of the engine it stands by")
    if keeps():
        seconds(GRACE, DEFAULT_GRACE_S, MOST_S)
        seconds(WAIT, DEFAULT_WAIT_S, MOST_S)
        engine = os.environ.get(ENGINE, "")
        if not engine:
            raise ValueError(f"{KEEP} needs {ENGINE}: the name a restarted engine finds its cache by")
        if not ENGINE_NAME.fullmatch(engine):
            raise ValueError(f"{ENGINE}={engine!r}: a kept engine's name is 1 to 64 letters, digits, '_' or '-'")


def worker_place() -> tuple[int, int]:
    """This worker's data-parallel replica and its rank within it, as vLLM numbers them (its multiprocess executor
    sets neither ``RANK`` nor ``LOCAL_RANK``); (0, 0) outside a vLLM worker. Looked up, not imported: a process that
    has not loaded vLLM's config runs no vLLM worker."""
    config_module = sys.modules.get("vllm.config")
    config = config_module.get_current_vllm_config_or_none() if config_module is not None else None
    if config is None:
        return 0, 0
    return config.parallel_config.data_parallel_index, config.parallel_config.rank


@dataclasses.dataclass(frozen=True)
class Scope:
    """One kept cache: an engine's data-parallel replica."""

    engine: str
    dp: int

    def files(self) -> str:
        return self.engine if self.dp == 0 else f"{self.engine}.dp{self.dp}"

    def index_path(self) -> Path:
        return index_dir() / f"{self.files()}.index"

    def note_path(self, rank: int) -> Path:
        return index_dir() / f"{self.files()}.rank{rank}.json"

    def kept_name(self, rank: int, name: str) -> bool:
        """Whether ``name`` is one of this scope's kept buffers of ``rank`` (of any generation)."""
        return is_kept(name, self.engine, self.dp, rank)


def engine_name() -> str:
    return os.environ[ENGINE]


def index_dir() -> Path:
    """Where the indexes and the ranks' notes live: ``HBMD_VLLM_KV_INDEX_DIR``, or a folder of this user's in
    ``/dev/shm`` (memory, like what it describes; gone at reboot, as the GPU's memory is). :class:`KeepingOff` where
    it is not a folder of this user's that no one else may write: an index another user could write could make this
    engine's successor serve KV the user chose."""
    folder = Path(os.environ.get(INDEX_DIR) or f"/dev/shm/hbmd-vllm-{os.getuid()}")
    try:
        folder.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    except OSError as exc:
        raise KeepingOff(f"the index folder {folder} cannot be made ({exc}); set {INDEX_DIR}") from exc
    try:
        info = os.lstat(folder)
    except OSError as exc:
        raise KeepingOff(f"the index folder {folder} cannot be looked at ({exc})") from exc
    if not stat.S_ISDIR(info.st_mode):
        raise KeepingOff(f"the index folder {folder} is not a folder (a link or a file is refused); remove it, or set "
                         f"{INDEX_DIR}")
    if info.st_uid != os.getuid():
        raise KeepingOff(f"the index folder {folder} belongs to uid {info.st_uid}, not to this engine's uid "
                         f"{os.getuid()} (another user made it first); remove it, or set {INDEX_DIR}")
    if info.st_mode & 0o022:
        raise KeepingOff(f"the index folder {folder} may be written by others (mode {stat.S_IMODE(info.st_mode):o}); "
                         f"chmod go-w it, or set {INDEX_DIR}")
    return folder


def write_note(path: Path, note: dict[str, Any]) -> None:
    """Put ``note`` at ``path`` in one rename, through no link, readable by this user alone."""
    staging = path.with_name(f"{path.name}.new-{os.getpid()}")
    staging.unlink(missing_ok=True)
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as file:
            file.write(json.dumps(note))
        os.replace(staging, path)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise


def read_note(path: Path) -> dict[str, Any] | None:
    """The note at ``path``, or None where there is none that reads (a link is not followed)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd) as file:
            note = json.loads(file.read())
    except (OSError, ValueError):
        return None
    return note if isinstance(note, dict) else None


# --- the worker's side: one kept buffer per rank, grafted from the predecessor's --------------------------------


@dataclasses.dataclass
class Donor:
    """The predecessor's kept buffer of this rank, as the daemon lists it."""

    name: str
    segment_capacities: list[int]
    segment_sizes: list[int]
    physical_bytes: int
    held: bool
    """A live session holds it: the predecessor runs on."""

    @classmethod
    def listed(cls, info: Any) -> Donor:
        return cls(info.name, list(info.segment_capacities), list(info.segment_sizes), info.physical_bytes,
                   info.session_id > 0)


@dataclasses.dataclass
class KeptRank:
    """This worker's kept buffer and the predecessor's it may adopt."""

    scope: Scope
    rank: int
    name: str
    gpu: str
    """The device's UUID (``host`` on the host backend): an index describes the buffers of given GPUs."""
    donor: Donor | None
    why_cold: str = ""
    """Why this rank adopts nothing, where it does not: said in the scheduler's log."""
    grafted_blocks: int = 0
    adopted_from: str | None = None
    weights_changed: str = ""
    """What changed the weights in place, where something did: nothing this engine computes may be adopted."""
    standing_by: bool = False
    """A standby that has not taken over: it writes no note (the note is the active engine's) until it has."""
    line: int | None = None
    """The standbys' line this rank holds the head of (a locked file descriptor), until it has taken over."""

    def write_note(self) -> None:
        """Tell the scheduler (another process under tensor parallelism) which buffer this rank holds and whose
        blocks it adopted."""
        write_note(self.scope.note_path(self.rank), {
            "buffer": self.name, "gpu": self.gpu, "adopted_from": self.adopted_from,
            "adopted_blocks": self.grafted_blocks, "why_cold": self.why_cold, "weights_changed": self.weights_changed,
            "pid": os.getpid()})

    def leave_line(self) -> None:
        """This standby took over: the next in line may stand by for it."""
        self.standing_by = False
        if self.line is not None:
            os.close(self.line)
            self.line = None

    def cold(self, why: str) -> None:
        """Adopt nothing, for ``why`` (logged here, and said by the scheduler)."""
        log.warning("hbmd cannot adopt the predecessor's KV cache: %s; this engine starts cold", why)
        self.donor, self.why_cold = None, why


_rank: KeptRank | None = None
"""This worker process's kept buffer (one rank per process), from the KV tensor's creation on."""


def expected_donor(scope: Scope, rank: int, gpu: str) -> tuple[str | None, str]:
    """The buffer the index says this rank's predecessor kept, or None and why there is none."""
    try:
        header = read_header(scope.index_path())
    except FileNotFoundError:
        return None, f"engine {scope.engine} left no prefix index"
    except (OSError, NotAnIndex) as exc:
        return None, f"its prefix index cannot be trusted ({exc})"
    if header.get("withdrawn"):
        return None, f"the predecessor withdrew its prefix index: {header['withdrawn']}"
    ranks = header.get("ranks")
    if not isinstance(ranks, list) or rank >= len(ranks) or not isinstance(ranks[rank], dict):
        return None, f"its prefix index describes no buffer of rank {rank}"
    if ranks[rank].get("gpu") != gpu:
        return None, f"its prefix index describes rank {rank}'s cache on another GPU ({ranks[rank].get('gpu')})"
    name = ranks[rank].get("buffer")
    return (name, "") if isinstance(name, str) else (None, f"its prefix index describes no buffer of rank {rank}")


def kept_tensor_options(client: Any, scope: Scope, rank: int) -> dict[str, Any]:
    """What the KV tensor of a keeping engine is created with: a new name of its own, persistence and grace period.

    The predecessor's buffer the index describes becomes this rank's donor; every other orphan of this rank's (a
    start that failed, a generation no index describes any more) is freed: nothing could ever adopt it. Raises
    :class:`KeepingOff` where the index folder cannot be used."""
    global _rank
    standby = standing_by()
    try:
        if not standby:  # a standby's active engine speaks for this rank until the standby takes over
            # The note a predecessor left must not speak for this rank, even where this one's cannot be written.
            scope.note_path(rank).unlink(missing_ok=True)
    except OSError as exc:
        raise KeepingOff(f"the note {scope.note_path(rank)} cannot be removed ({exc})") from exc
    gpu = client.welcome.device_uuid or "host"
    expected, why = expected_donor(scope, rank, gpu)
    donor = None
    for info in client.buffers(owner_uid=os.getuid()):
        if not scope.kept_name(rank, info.name):
            continue
        if info.name == expected:
            donor = Donor.listed(info)
        elif info.session_id == 0 and _free(client, info.name):
            log.info("hbmd freed %s (%s), a kept KV buffer of engine %s that no prefix index describes (a start that "
                     "failed, or an older generation)", info.name, format_bytes(info.physical_bytes), scope.engine)
    if expected is not None and donor is None:
        why = donor_gone(expected)
    name = f"{buffer_base(scope.engine, scope.dp, rank)}.{secrets.token_hex(GENERATION_HEX // 2)}"
    _rank = KeptRank(scope, rank, name, gpu, donor, why, standing_by=standby)
    if donor is not None and not standby:
        log.info("hbmd keeps this engine's KV cache: the predecessor's (%s, %s) is adopted at the final sizing",
                 donor.name, format_bytes(donor.physical_bytes))
    return {"name": name, "persistent": True, "keep_orphan_s": seconds(GRACE, DEFAULT_GRACE_S, MOST_S)}


def donor_gone(expected: str) -> str:
    """Why a rank adopts nothing where the buffer its prefix index describes is not listed."""
    return f"the buffer its prefix index describes, {expected}, is gone (freed at its grace period's end?)"


def note_created() -> None:
    """This rank's buffer exists: its note says so, and that nothing is adopted yet (a note a predecessor left must
    not speak for this engine)."""
    if _rank is not None and not _rank.standing_by:
        _rank.write_note()


def donor_blocks(kv_cache: Any, donor: Donor) -> int:
    """The predecessor's blocks its buffer backs, in every segment."""
    return min(size // stride for size, stride in zip(donor.segment_sizes, kv_cache.segment_strides))


def settle_donor(client: Any, capacities: list[int]) -> Donor | None:
    """This rank's donor once no live session holds it (waiting up to ``HBMD_VLLM_KEEP_KV_WAIT_S``), None where
    there is none, the predecessor runs on, or its layout cannot be this engine's (``capacities``, per segment:
    another model under this engine's name, which the daemon would refuse to graft; that one is freed now, before
    vLLM measures what memory it has)."""
    rank = _rank
    if rank is None or rank.donor is None:
        return None
    donor = rank.donor
    if len(donor.segment_capacities) != len(capacities) or any(
            size > capacity for size, capacity in zip(donor.segment_sizes, capacities)):
        rank.cold(f"the kept KV cache {donor.name} is laid out for another model ({len(donor.segment_capacities)} "
                  f"segments of up to {max(donor.segment_sizes, default=0)} bytes committed, where this engine has "
                  f"{len(capacities)} of {min(capacities, default=0)} bytes or more)")
        if not donor.held:
            _free(client, donor.name)
        return None
    wait = seconds(WAIT, DEFAULT_WAIT_S, MOST_S)
    deadline = time.monotonic() + wait
    while rank.donor.held:
        if time.monotonic() >= deadline:
            rank.cold(f"the predecessor still holds {rank.donor.name} after {wait:g} s ({WAIT})")
            return None
        time.sleep(WAIT_POLL_S)
        listed = client.buffers(name=rank.donor.name, owner_uid=os.getuid())
        if not listed:
            rank.cold(f"the predecessor's {rank.donor.name} went while this engine waited for it")
            return None
        rank.donor = Donor.listed(listed[0])
    return rank.donor


def _free(client: Any, name: str) -> bool:
    """Delete the orphan ``name``; False (logged) where the daemon refuses."""
    try:
        client.delete(name)
        return True
    except HbmdError as exc:
        log.warning("hbmd could not free %s (%s): the daemon frees it at its grace period's end", name, exc)
        return False


def make_room(client: Any, refusal: Exception) -> bool:
    """A commit before the final sizing was refused: where this rank's donor, not grafted yet, holds the memory the
    commit needs, free it (this engine starts cold, saying why) and say the commit may be tried again."""
    rank = _rank
    if rank is None or rank.donor is None or rank.donor.held or rank.adopted_from is not None:
        return False
    donor = rank.donor
    rank.cold(f"its kept cache {donor.name} ({format_bytes(donor.physical_bytes)}) leaves too little of the budget "
              f"for this engine's warm-up ({refusal}); it is freed")
    return _free(client, donor.name)


def counting_kept_blocks(original: Callable[..., int]) -> Callable[..., int]:
    """Wrap vLLM's measure of the KV cache after warm-up so that it counts the predecessor's blocks as this
    engine's (they are, once grafted; until then the daemon charges them to the orphan, so free memory, what vLLM
    measures, and the daemon's room, what hbmd's cap reads, both leave them out), less the room a successor's
    warm-up will need beside this engine's kept cache (:func:`warm_up_room`).

    Never fewer than the predecessor's blocks: their memory is held already, and a graft takes all of them or
    none. The room left beside them may then fall short of the warm-up's and its tenth, by what the orphan's
    rounding up to whole chunks took from the budget, but never of what this engine's warm-up committed: that
    warm-up fit in it, and the next engine's, of the same model and settings, commits as much. A successor that
    finds too little room anyway frees the kept cache and starts cold (:func:`make_room`)."""

    def measured(kv_cache: Any, *args: Any, **kwargs: Any) -> int:
        client = getattr(kv_cache.buffer, "client", None)
        donor = settle_donor(client, list(kv_cache.buffer.segment_capacities)) if client is not None else None
        blocks = original(kv_cache, *args, **kwargs)
        adopted = 0
        if donor is not None:
            adopted = donor_blocks(kv_cache, donor)
            blocks = min(kv_cache.capacity_blocks, blocks + adopted)
        room = warm_up_room(kv_cache)
        sized = max(1, adopted, kv_cache.blocks_within(kv_cache.physical_bytes_for(blocks) - room))
        if blocks > sized:
            log.info("hbmd keeps %d KV blocks (%s) free of this engine's cache for its successor's warm-up",
                     blocks - sized, format_bytes(room))
        return sized

    measured.__wrapped__ = original  # type: ignore[attr-defined]
    return measured


def warm_up_room(kv_cache: Any) -> int:
    """The bytes a successor's warm-up commits before it can graft this cache: what this engine's warm-up committed
    (the same model and settings warm up alike), and a tenth more, each segment rounded up to whole granules as the
    daemon charges it. Left out of a kept cache, so that a successor finds them free beside it even where the cache
    had the whole budget (on an H100 a successor could not commit its first block otherwise)."""
    committed = kv_cache.num_committed_blocks
    return int(kv_cache.physical_bytes_for(committed + max(1, committed // 10)))


def grafting(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap vLLM's ``extend_kv_cache`` (the final sizing, after warm-up) so that a keeping engine first adopts its
    predecessor's pages in place of the warm-up's, then lets vLLM grow the rest; and so that a weight update of the
    model it serves withdraws what this engine keeps (:func:`watch_weights`)."""

    def extend(runner: Any, kv_cache_config: Any, num_blocks: int) -> Any:
        kv_cache = getattr(runner, "extensible_kv_cache", None)
        rank = _rank
        if rank is not None and kv_cache is not None and hasattr(kv_cache.buffer, "graft"):
            from vllm.v1.worker.extensible_kv_cache import registers_kv_cache_memory

            graft_donor(rank, kv_cache, num_blocks, registers_kv_cache_memory(runner.vllm_config))
            rank.write_note()
            rank.leave_line()
            watch_weights(runner.get_model())
        return original(runner, kv_cache_config, num_blocks)

    extend.__wrapped__ = original  # type: ignore[attr-defined]
    return extend


def graft_donor(rank: KeptRank, kv_cache: Any, num_blocks: int, registers: bool) -> None:
    """Graft the predecessor's buffer under ``kv_cache`` (``rank.adopted_from`` says so), or start cold, saying why.
    A donor that cannot be adopted is deleted: the block count vLLM is about to commit counted its memory."""
    donor = rank.donor
    if donor is None:
        return
    buffer = kv_cache.buffer
    blocks = donor_blocks(kv_cache, donor)
    why = None
    if registers:
        why = "a KV connector registers the cache, which vLLM remaps as one allocation per segment"
    elif blocks > num_blocks:
        why = f"{donor.name} holds {blocks} blocks, more than the {num_blocks} this engine has"
    if why is None:
        buffer.release_physical()  # the warm-up's pages: vLLM's own scratch
        kv_cache.num_committed_blocks = 0
        try:
            buffer.graft(donor.name)
        except HbmdError as exc:
            why = f"the daemon refused to graft {donor.name}: {exc}"
    if why is not None:
        rank.cold(why)
        _free(buffer.client, donor.name)
        return
    kv_cache.num_committed_blocks = blocks
    rank.grafted_blocks, rank.adopted_from = blocks, donor.name
    log.info("adopted the predecessor's KV cache: %d blocks (%s) of %s, no copy", blocks,
             format_bytes(buffer.physical_bytes), donor.name)


def weights_changed(what: str) -> None:
    """The weights this engine serves changed in place (``what``: the call): KV computed before no longer matches
    them, nor KV computed after the weights a successor loads. This rank's note says so (the scheduler keeps no index
    where it sees that at start) and the index is withdrawn whole (a scheduler writing it finds out, and stops)."""
    rank = _rank
    if rank is None or rank.weights_changed:
        return
    rank.weights_changed = f"the weights were changed in place ({what})"
    log.warning("hbmd: %s; this engine's prefix cache will not be kept", rank.weights_changed)
    try:
        rank.write_note()
        withdraw_all(rank.scope.index_path(), rank.weights_changed)
    except (OSError, KeepingOff) as exc:
        log.error("hbmd could not withdraw the prefix index %s (%s): delete it before the next start",
                  rank.scope.files(), exc)


def changing_weights(original: Callable[..., Any], what: str) -> Callable[..., Any]:
    """Wrap a call that changes a model's weights in place so that it withdraws this engine's kept prefix index
    first: a successor loads the weights from disk, not these."""

    def change(*args: Any, **kwargs: Any) -> Any:
        weights_changed(what)
        return original(*args, **kwargs)

    change.__wrapped__ = original  # type: ignore[attr-defined]
    return change


WEIGHT_UPDATES = ("reload_weights", "start_weight_update", "start_draft_weight_update", "reset_weights")
"""vLLM 0.34's worker calls that change the weights it serves in place (RL weight sync among them)."""


def watch_weights(model: Any) -> None:
    """Withdraw the kept index at any later ``load_weights`` of the loaded ``model`` (what vLLM's own updates and a
    trainer's worker extension call)."""
    load = getattr(model, "load_weights", None)
    if load is not None and not hasattr(load, "__wrapped__"):
        model.load_weights = changing_weights(load, f"{type(model).__name__}.load_weights")


def patch(extensible_kv_cache: Any) -> None:
    """Route vLLM's final sizing through this module: where ``HBMD_VLLM_KEEP_KV`` is on (the scheduler's half is
    :mod:`hbmd.integrations.vllm_prefix`'s)."""
    extend = extensible_kv_cache.extend_kv_cache
    if not hasattr(extend, "__wrapped__"):
        extensible_kv_cache.extend_kv_cache = grafting(extend)


def patch_worker(worker: Any) -> None:
    """vLLM's GPU worker imports ``extend_kv_cache`` by name: point that name at the grafting one too; and withdraw
    the kept index at each of its weight updates."""
    extend = getattr(worker, "extend_kv_cache", None)
    if extend is not None and not hasattr(extend, "__wrapped__"):
        worker.extend_kv_cache = grafting(extend)
    for method in WEIGHT_UPDATES:
        update = getattr(worker.Worker, method, None)
        if update is not None and not hasattr(update, "__wrapped__"):
            setattr(worker.Worker, method, changing_weights(update, f"Worker.{method}"))
