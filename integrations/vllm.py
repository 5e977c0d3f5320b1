"""vLLM plugin: vLLM's extensible KV cache allocates through hbmd.

Registered as a ``vllm.general_plugins`` entry point, so vLLM calls
:func:`register` in every process it starts (front end, engine core,
workers). It does nothing unless the operator opts in with ``HBMD_VLLM=1``
(or ``true``, ``yes``, ``on``; any spelling it does not know is refused);
then it checks the vLLM version and hbmd's other settings, and points the
name vLLM's KV cache looks up
(``vllm.v1.worker.extensible_kv_cache.ExtensibleTensor``) at
:class:`VllmExtensibleTensor`, hbmd's class with vLLM's interface (vLLM's
own where no daemon serves the GPU, with a warning: :func:`hbmd_or_own`). No vLLM
code is copied or changed; a few of its functions are wrapped:

- vLLM counts its KV blocks (after warm-up, and the blocks warm-up may
  commit) no higher than hbmd admits for this worker
  (:func:`capped_by_daemon`): its scheduler's block pool is built from that
  count before any commit, so the count is where a budget must bite.
- a commit hbmd refuses anyway (another engine took the memory since)
  fails naming the cause (:func:`refusal_explained`), never runs short.
- vLLM's sleep returns the pages to the daemon, or with
  ``HBMD_VLLM_SLEEP=keep`` demotes the cache to the daemon's host tier
  (:func:`keeping_release`; only the sleep keeps: every other release
  discards); the wake gets every block back or waits, then fails with the
  engine still asleep (:func:`waking`, ``HBMD_VLLM_WAKE_WAIT_S``).

It also registers the model loader ``--load-format hbmd``
(:mod:`hbmd.integrations.vllm_weights`): weights loaded once per GPU into a
sealed buffer, mapped by every later engine.

Buffers are named ``vllm-<engine>-rank<R>`` (``HBMD_VLLM_ENGINE``, default
the pid; the rank from ``RANK``/``LOCAL_RANK``), so ``hbmctl buffers`` shows
which engine holds what; ``HBMD_TENANT`` charges them to a tenant of the
daemon's ``--config``. The KV cache is not persistent unless
``HBMD_VLLM_KEEP_KV`` is on: then a restarted engine of the same name adopts
its predecessor's cache and prefix index (:mod:`hbmd.integrations.vllm_keep`).

vLLM loads general plugins only where ``VLLM_PLUGINS`` is unset or names
them: with a list that leaves ``hbmd`` out, none of this runs, whatever
``HBMD_VLLM`` says.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any

from hbmd.client.kept_names import buffer_base
from hbmd.client.opening import default_client
from hbmd.client.tensor import ExtensibleTensor
from hbmd.proto import TIER_HOST
from hbmd.proto.errors import DaemonUnavailable, HbmdError, NotFound, OutOfBudget, OutOfDeviceMemory
from hbmd.proto.units import format_bytes

from . import vllm_compat, vllm_keep, vllm_standby
from .settings import LOAD_FORMAT, seconds, switch
from .vllm_compat import UnsupportedVllm
from .vllm_front_end import end_with_front_end, patch_engine_core

# Under vLLM's logger, so that what hbmd does shows in vLLM's own log, in its format.
log = logging.getLogger("vllm.hbmd")

OPT_IN = vllm_compat.OPT_IN
REQUIRED = "HBMD_VLLM_REQUIRED"
"""On: an engine that cannot have hbmd (no daemon, a vLLM the table does not match) stops instead of starting on
vLLM's own allocation, outside the daemon's budget."""
SLEEP = "HBMD_VLLM_SLEEP"
"""``keep``: sleep demotes the KV cache to the daemon's host tier instead of dropping it; ``drop`` (the default)."""
SUPPORTED = ((0, 34),)
"""vLLM releases whose ``extensible_kv_cache`` module this plugin was checked against (major, minor)."""


def enabled() -> bool:
    """Whether ``HBMD_VLLM`` opts in; ``ValueError`` for a value that is neither on nor off, which an operator meant
    as something: running vLLM without hbmd (or with it) against their word would go unnoticed."""
    return switch(OPT_IN)


def required() -> bool:
    """Whether ``HBMD_VLLM_REQUIRED`` asks an engine to stop rather than run without hbmd; ``ValueError`` for a
    value that is neither on nor off."""
    return switch(REQUIRED)


class HbmdRequired(RuntimeError):
    """``HBMD_VLLM_REQUIRED`` is on and this engine cannot have hbmd: it stops rather than allocate outside the
    daemon's budget."""


def check_version(version: str) -> None:
    """Raise :class:`UnsupportedVllm` unless ``version`` is a supported release."""
    try:
        release = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        release = ()
    if release not in SUPPORTED:
        known = ", ".join(f"{major}.{minor}.x" for major, minor in SUPPORTED)
        raise UnsupportedVllm(
            f"hbmd's vLLM plugin supports vLLM {known}, not {version}; unset {OPT_IN} to run vLLM without hbmd"
        )


def sleep_keeps() -> bool:
    """Whether ``HBMD_VLLM_SLEEP`` asks sleep to keep the KV cache; ``ValueError`` for a value that is neither."""
    value = os.environ.get(SLEEP, "").strip().lower()
    if value not in ("", "keep", "drop"):
        raise ValueError(f"{SLEEP}={os.environ[SLEEP]!r}: expected keep or drop (the default)")
    return value == "keep"


def engine() -> str:
    return os.environ.get(vllm_keep.ENGINE) or str(os.getpid())


def buffer_name() -> str:
    """This worker's buffer name: ``vllm-<engine>-rank<R>`` (``-dp<D>`` after it in data-parallel replica D > 0),
    the rank and replica as vLLM numbers them (:func:`~hbmd.integrations.vllm_keep.worker_place`)."""
    return buffer_base(engine(), *vllm_keep.worker_place())


class VllmExtensibleTensor(ExtensibleTensor):
    """hbmd's tensor as vLLM constructs it: named per engine and rank, connected to the daemon of ``device``.

    Its ``release_physical`` is the plain one, which discards: vLLM calls it
    to throw the pages away before a remap (``ExtensibleKVCache.commit`` with
    ``shrink`` or ``defragment``). Only vLLM's sleep may keep them
    (:func:`keeping_release`).
    """

    def __init__(
        self,
        max_num_bytes: int,
        device: Any = None,
        num_segments: int = 1,
        segment_capacities: Any = None,
        export_handle_types: int = 0,
    ) -> None:
        options: dict[str, Any] = {"name": buffer_name()}
        if vllm_keep.keeps():
            dp, rank = vllm_keep.worker_place()
            try:
                options = vllm_keep.kept_tensor_options(default_client(device), vllm_keep.Scope(engine(), dp), rank)
            except vllm_keep.KeepingOff as exc:
                log.warning("hbmd cannot keep this engine's KV cache (%s): it serves without keeping it", exc)
        super().__init__(max_num_bytes, device, num_segments, segment_capacities, export_handle_types, **options)
        if self.persistent:
            try:
                vllm_keep.note_created()
            except OSError as exc:
                log.warning("hbmd cannot write this rank's note in the index folder (%s): this engine's prefix cache "
                            "will not be kept", exc)
        # The worker exists by now (it built the model runner that builds this cache).
        patch_worker()

    @property
    def physical_bytes(self) -> int:
        """Bytes on the device, as vLLM's own class counts them: none while a sleep keeps the cache in the daemon's
        host tier (vLLM reads 0 as "released by sleep", and lends nothing of it to a weight update)."""
        return 0 if self.tier == TIER_HOST else super().physical_bytes

    def free(self) -> None:
        """vLLM frees its KV cache when the engine shuts down (its model runner's ``shutdown``): a keeping engine's
        is let go of instead, left in the daemon for its successor as a killed engine's is (an orphan, freed at its
        grace period's end unless adopted). Where the daemon refuses that, it is freed."""
        if self.persistent and vllm_keep.keeps() and not self._freed:
            try:
                self.detach()
                log.info("hbmd keeps this engine's KV cache %s (%s) for its successor", self.name,
                         format_bytes(self.physical_bytes))
                return
            except HbmdError as exc:
                log.warning("hbmd could not keep this engine's KV cache %s (%s): it is freed", self.name, exc)
        super().free()


def hbmd_or_own(own):
    """What vLLM's KV cache constructs in place of its own ``ExtensibleTensor`` (``own``): hbmd's, or where no daemon
    serves this GPU (none started, or it is down), vLLM's own, with a warning that says why: an engine that would
    start without hbmd starts without it, unless ``HBMD_VLLM_REQUIRED`` is on (:class:`HbmdRequired`)."""

    def kv_tensor(*args: Any, **kwargs: Any) -> Any:
        try:
            return VllmExtensibleTensor(*args, **kwargs)
        except (DaemonUnavailable, NotFound) as exc:
            if required():
                raise HbmdRequired(
                    f"hbmd is not reachable ({exc}) and {REQUIRED} is on: this engine does not start outside hbmd's "
                    f"budget. Start the GPU's daemon (hbmd --device N, or the hbmd@N unit), or unset {REQUIRED}"
                ) from exc
            log.warning("hbmd is not reachable (%s): the KV cache is vLLM's own, allocated in this process", exc)
            return own(*args, **kwargs)

    kv_tensor.__wrapped__ = own  # type: ignore[attr-defined]
    return kv_tensor


_sleep = threading.local()
"""``active`` while vLLM's worker sleeps: the one release that may keep the KV cache."""


def sleeping(original):
    """Wrap ``Worker.sleep`` so that the KV cache's release inside it knows it is the sleep's."""

    def sleep(self: Any, *args: Any, **kwargs: Any) -> Any:
        _sleep.active = True
        try:
            return original(self, *args, **kwargs)
        finally:
            _sleep.active = False

    sleep.__wrapped__ = original  # type: ignore[attr-defined]
    return sleep


def patch_worker() -> None:
    """Wrap vLLM's GPU worker's ``sleep`` with :func:`sleeping` and its sizing with :func:`capped_by_daemon`, once,
    where the worker module is loaded.

    Looked up, not imported: a process that runs no GPU worker never loads it for hbmd's sake.
    """
    worker = sys.modules.get("vllm.v1.worker.gpu_worker")
    if worker is None:
        return
    if not hasattr(worker.Worker.sleep, "__wrapped__"):
        worker.Worker.sleep = sleeping(worker.Worker.sleep)
    patch_sizing(worker)
    if vllm_keep.keeps():
        vllm_keep.patch_worker(worker)


def keeping_release(original):
    """Wrap ``ExtensibleKVCache.release_physical`` so that vLLM's sleep with ``HBMD_VLLM_SLEEP=keep`` demotes the
    cache to the daemon's host tier; every other release (``release_kv_cache_memory``, a weight update borrowing
    the memory, ``discard``) drops the pages, as vLLM asked.

    vLLM clears its prefix cache at sleep level 1 and above, so a kept cache
    is never read by vLLM itself: where the daemon cannot keep it (no host
    tier, host budget short), the sleep drops it and says so.
    """

    def release_physical(self: Any) -> Any:
        buffer = self.buffer
        if getattr(_sleep, "active", False) and sleep_keeps() and isinstance(buffer, ExtensibleTensor):
            try:
                buffer.release_physical(keep=True)
                return None
            except OutOfBudget as exc:
                log.warning("hbmd cannot keep the KV cache over this sleep (%s): dropping it instead", exc)
        return original(self)

    release_physical.__wrapped__ = original  # type: ignore[attr-defined]
    return release_physical


def admitted_blocks(kv_cache: Any) -> int | None:
    """The most blocks of ``kv_cache`` hbmd admits for this worker now (what it holds plus what the daemon would
    still admit), or None where the cache is not hbmd's."""
    buffer = kv_cache.buffer
    if not isinstance(buffer, ExtensibleTensor):
        return None
    return kv_cache.blocks_within(buffer.physical_bytes + buffer.client.device_memory().budget_left)


def capped_by_daemon(original, what: str):
    """Wrap a function of vLLM that sizes the KV cache in blocks (the measure after warm-up, the blocks warm-up may
    commit) so that it never counts more blocks than hbmd admits.

    vLLM builds its scheduler's block pool from the measured count before
    any worker commits it, and nothing reads the committed count back: a
    block counted there without memory behind it faults when written. So the
    cap belongs in the count, not in the commit. The first argument of
    ``original`` is the ``ExtensibleKVCache``.
    """

    def sized(kv_cache: Any, *args: Any, **kwargs: Any) -> int:
        blocks = original(kv_cache, *args, **kwargs)
        admitted = admitted_blocks(kv_cache)
        if admitted is not None and admitted < blocks:
            log.warning("hbmd admits %d of the %d KV blocks vLLM %s; vLLM sizes its cache to %d (%s)", admitted,
                        blocks, what, admitted, format_bytes(kv_cache.physical_bytes_for(admitted)))
            return admitted
        return blocks

    sized.__wrapped__ = original  # type: ignore[attr-defined]
    return sized


class KvCacheRefused(RuntimeError):
    """hbmd refused the KV blocks vLLM already counts on: serving on would write where no memory is."""


def refused(kv_cache: Any, num_blocks: int, refusal: OutOfBudget) -> KvCacheRefused:
    return KvCacheRefused(
        f"hbmd refused {num_blocks} KV blocks ({format_bytes(kv_cache.physical_bytes_for(num_blocks))}) that vLLM "
        f"counts on: {refusal}. Another session committed since vLLM measured; start the engine again, or give "
        "this tenant a guaranteed minimum in the daemon's --config"
    )


def refusal_explained(original):
    """Wrap ``ExtensibleKVCache.commit`` so that a commit hbmd refuses fails with what happened and what to do.

    No round trip before it: the count was sized to what hbmd admits
    (:func:`capped_by_daemon`), and a refusal means another engine took the
    memory since, or, before the final sizing, that the predecessor's kept
    cache waiting to be grafted leaves too little for the warm-up: that one
    is freed and the commit tried again (the engine starts cold, saying why).
    """

    def commit(self: Any, num_blocks: int, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, num_blocks, *args, **kwargs)
        except OutOfBudget as exc:
            if not (vllm_keep.keeps() and isinstance(self.buffer, ExtensibleTensor)
                    and vllm_keep.make_room(self.buffer.client, exc)):
                raise refused(self, num_blocks, exc) from exc
        try:  # again, with the memory a kept cache held given back
            return original(self, num_blocks, *args, **kwargs)
        except OutOfBudget as exc:
            raise refused(self, num_blocks, exc) from exc

    commit.__wrapped__ = original  # type: ignore[attr-defined]
    return commit


def waking(original):
    """Wrap ``ExtensibleKVCache.recommit`` (vLLM's wake) so that it comes back with every block vLLM counts on, or
    not at all.

    A cache kept in the host tier over sleep is promoted first; on a
    promoted buffer vLLM's own recommit then changes nothing. Where the
    daemon cannot give the blocks back yet (another engine grew while this
    one slept), the wake waits up to ``HBMD_VLLM_WAKE_WAIT_S`` seconds (default
    :data:`DEFAULT_WAKE_WAIT_S`) for them, then fails with
    :class:`KvCacheRefused`, the cache still asleep and its block count kept,
    so that vLLM's engine stays asleep and a later wake tries again.
    """

    def recommit(self: Any, *args: Any, **kwargs: Any) -> Any:
        buffer = self.buffer
        if not isinstance(buffer, ExtensibleTensor):
            return original(self, *args, **kwargs)
        blocks = self.num_committed_blocks
        deadline = time.monotonic() + wake_wait_s()
        while True:
            try:
                if buffer.tier == TIER_HOST:
                    buffer.promote()
                return original(self, *args, **kwargs)
            except (OutOfBudget, OutOfDeviceMemory, KvCacheRefused) as exc:
                self.num_committed_blocks = blocks  # vLLM zeroed it before the commit that was refused
                if time.monotonic() >= deadline:
                    raise KvCacheRefused(
                        f"hbmd could not give back the {blocks} KV blocks this engine held before it slept "
                        f"({format_bytes(self.physical_bytes_for(blocks))}) within {wake_wait_s():g} s: {exc}. "
                        "The engine stays asleep; wake it again once memory is free"
                    ) from exc
                time.sleep(WAKE_POLL_S)

    recommit.__wrapped__ = original  # type: ignore[attr-defined]
    return recommit


WAKE_WAIT = "HBMD_VLLM_WAKE_WAIT_S"
DEFAULT_WAKE_WAIT_S = 30.0
WAKE_POLL_S = 0.25


def wake_wait_s() -> float:
    """``HBMD_VLLM_WAKE_WAIT_S``: how long a wake waits for its blocks (0 to a day); ``ValueError`` otherwise."""
    return seconds(WAKE_WAIT, DEFAULT_WAKE_WAIT_S, 86400)


def patch_sizing(module: Any) -> None:
    """Point ``module``'s name ``measure_kv_cache_blocks`` at the capped one, once (vLLM's GPU worker imports the
    function by name, so the name there is patched as well as the one it comes from)."""
    measure = getattr(module, "measure_kv_cache_blocks", None)
    if measure is not None and not hasattr(measure, "__wrapped__"):
        measure = capped_by_daemon(measure, "measured after warm-up")
        if vllm_keep.keeps():
            # Outside the cap: the predecessor's blocks are charged to its orphan, not to the room the cap reads.
            measure = vllm_keep.counting_kept_blocks(measure)
        if vllm_keep.standing_by():
            # Before anything is measured: a standby measures what its takeover leaves.
            measure = vllm_standby.waiting(measure)
        module.measure_kv_cache_blocks = measure


def asks_for_hbmd_loader(argv: list[str]) -> bool:
    """Whether a command line (``vllm serve``'s) asks for ``--load-format hbmd``: with the plugin off, vLLM would
    only say the format is not supported, after the engine started."""
    for at, arg in enumerate(argv):
        name, _, value = arg.partition("=")
        value = value or (argv[at + 1] if at + 1 < len(argv) else "")
        if name.replace("_", "-") == "--load-format" and value.lower() == LOAD_FORMAT:
            return True
    return False


def register() -> None:
    """The entry point: inert unless ``HBMD_VLLM`` is on; otherwise route vLLM's extensible KV cache to hbmd.

    Every setting of hbmd's is read here, so that a misspelt one stops the
    engine at start, not at its first sleep; and every part of vLLM hbmd
    touches is checked against :data:`~hbmd.integrations.vllm_compat.TABLE`
    before any is patched, so that a vLLM that moved one refuses the whole
    plugin, naming it: the engine runs without hbmd, saying so, or with
    ``HBMD_VLLM_REQUIRED`` on, does not start (:class:`HbmdRequired`).
    """
    if not enabled():
        if asks_for_hbmd_loader(sys.argv):
            raise ValueError(f"--load-format {LOAD_FORMAT} is hbmd's weight loader, and hbmd's vLLM plugin is off: set "
                             f"{OPT_IN}=1 to use it")
        return
    sleep_keeps()
    wake_wait_s()
    must = required()
    vllm_keep.check_settings()
    import vllm
    from vllm.v1.worker import extensible_kv_cache

    check_version(vllm.__version__)
    try:
        vllm_compat.check(vllm.__version__)
    except UnsupportedVllm as exc:
        if must:
            raise HbmdRequired(f"{exc}; {REQUIRED} is on, so this engine does not start without hbmd") from exc
        log.error("%s. This engine runs without hbmd (%s=1 stops it instead)", exc, REQUIRED)
        return
    if hasattr(extensible_kv_cache.ExtensibleTensor, "__wrapped__"):
        return  # vLLM may load general plugins more than once in a process
    end_with_front_end()
    patch_engine_core()
    if vllm_keep.standing_by():
        vllm_standby.patch_front_end()
    extensible_kv_cache.ExtensibleTensor = hbmd_or_own(extensible_kv_cache.ExtensibleTensor)
    cache = extensible_kv_cache.ExtensibleKVCache
    cache.commit = refusal_explained(cache.commit)
    cache.committable_blocks = capped_by_daemon(cache.committable_blocks, "may commit during warm-up")
    cache.release_physical = keeping_release(cache.release_physical)
    cache.recommit = waking(cache.recommit)
    patch_sizing(extensible_kv_cache)
    if vllm_keep.keeps():
        from .vllm_prefix import patch_scheduler_choice

        vllm_keep.patch(extensible_kv_cache)
        patch_scheduler_choice()
    patch_worker()
    from vllm.model_executor.model_loader import register_model_loader

    from .vllm_weights import HbmdModelLoader

    register_model_loader(LOAD_FORMAT)(HbmdModelLoader)
    log.info("vLLM %s: the extensible KV cache allocates through hbmd, and --load-format %s maps weights from it",
             vllm.__version__, LOAD_FORMAT)
