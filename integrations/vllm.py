"""vLLM plugin: vLLM's extensible KV cache allocates through hbmd.

Registered as a ``vllm.general_plugins`` entry point, so vLLM calls
:func:`register` in every process it starts (front end, engine core,
workers). It does nothing unless the operator opts in with ``HBMD_VLLM=1``
(or ``true``, ``yes``, ``on``; any spelling it does not know is refused);
then it checks the vLLM version and points the name vLLM's KV cache looks
up (``vllm.v1.worker.extensible_kv_cache.ExtensibleTensor``) at
:class:`VllmExtensibleTensor`, hbmd's class with vLLM's interface, and caps
each commit by what the daemon would admit for this worker. No vLLM code is
copied or changed; sleep mode's ``release_physical``/``recommit`` return the
pages to the daemon and take fresh ones, or with ``HBMD_VLLM_SLEEP=keep``
demote the cache to the daemon's host tier and promote it back. It also registers the model loader
``--load-format hbmd`` (:mod:`hbmd.integrations.vllm_weights`): weights
loaded once per GPU into a sealed buffer, mapped by every later engine.

Buffers are named ``vllm-<engine>-rank<R>`` (``HBMD_VLLM_ENGINE``, default
the pid; the rank from ``RANK``/``LOCAL_RANK``), so ``hbmctl buffers`` shows
which engine holds what; ``HBMD_TENANT`` charges them to a tenant of the
daemon's ``--config``. The KV cache is not persistent: a restarted vLLM
rebuilds its prefix index from nothing, so a cache that outlived the worker
would be unreadable to it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from hbmd.client.tensor import ExtensibleTensor
from hbmd.proto import TIER_HOST

# Under vLLM's logger, so that what hbmd does shows in vLLM's own log, in its format.
log = logging.getLogger("vllm.hbmd")

OPT_IN = "HBMD_VLLM"
SLEEP = "HBMD_VLLM_SLEEP"
"""``keep``: sleep demotes the KV cache to the daemon's host tier instead of dropping it; ``drop`` (the default)."""
SUPPORTED = ((0, 34),)
"""vLLM releases whose ``extensible_kv_cache`` module this plugin was checked against (major, minor)."""


ON = ("1", "true", "yes", "on")
OFF = ("", "0", "false", "no", "off")


class UnsupportedVllm(RuntimeError):
    """The installed vLLM is not one this plugin knows: refusing beats silently allocating the wrong way."""


def enabled() -> bool:
    """Whether ``HBMD_VLLM`` opts in; ``ValueError`` for a value that is neither on nor off, which an operator meant
    as something: running vLLM without hbmd (or with it) against their word would go unnoticed."""
    value = os.environ.get(OPT_IN, "")
    if value.strip().lower() in ON:
        return True
    if value.strip().lower() in OFF:
        return False
    raise ValueError(f"{OPT_IN}={value!r}: expected one of {', '.join(ON)} (on) or {', '.join(OFF[1:])} or unset (off)")


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


def buffer_name() -> str:
    engine = os.environ.get("HBMD_VLLM_ENGINE") or str(os.getpid())
    rank = os.environ.get("RANK") or os.environ.get("LOCAL_RANK") or "0"
    return f"vllm-{engine}-rank{rank}"


class VllmExtensibleTensor(ExtensibleTensor):
    """hbmd's tensor as vLLM constructs it: named per engine and rank, connected to the daemon of ``device``."""

    def __init__(
        self,
        max_num_bytes: int,
        device: Any = None,
        num_segments: int = 1,
        segment_capacities: Any = None,
        export_handle_types: int = 0,
    ) -> None:
        super().__init__(
            max_num_bytes, device, num_segments, segment_capacities, export_handle_types, name=buffer_name()
        )

    def release_physical(self, keep: bool | None = None) -> None:
        """vLLM's sleep: drop the pages, or with ``HBMD_VLLM_SLEEP=keep`` demote them to the host tier."""
        super().release_physical(keep=sleep_keeps() if keep is None else keep)


def capped_commit(original):
    """Wrap ``ExtensibleKVCache.commit`` so it never asks for more blocks than the daemon would admit.

    vLLM sizes its cache from the device's free memory; under an hbmd budget
    or a tenant maximum less may be admissible. The cap counts vLLM's own
    per-segment granule rounding (``blocks_within``).
    """

    def commit(self, num_blocks: int, *args: Any, **kwargs: Any) -> Any:
        buffer = self.buffer
        if isinstance(buffer, ExtensibleTensor) and num_blocks > self.num_committed_blocks:
            most = self.blocks_within(buffer.physical_bytes + buffer.client.device_memory().budget_left)
            if most < num_blocks:
                log.warning("hbmd admits %d of the %d KV blocks vLLM asked for", most, num_blocks)
                num_blocks = most
        return original(self, num_blocks, *args, **kwargs)

    commit.__wrapped__ = original  # type: ignore[attr-defined]
    return commit


def promoting_recommit(original):
    """Wrap ``ExtensibleKVCache.recommit`` so that a cache kept in the host tier over sleep comes back first.

    vLLM's wake commits the blocks it held again; on a promoted buffer they
    are committed already, with their data, and that commit changes nothing.
    """

    def recommit(self, *args: Any, **kwargs: Any) -> Any:
        buffer = self.buffer
        if isinstance(buffer, ExtensibleTensor) and buffer.tier == TIER_HOST:
            buffer.promote()
        return original(self, *args, **kwargs)

    recommit.__wrapped__ = original  # type: ignore[attr-defined]
    return recommit


def register() -> None:
    """The entry point: inert unless ``HBMD_VLLM`` is on; otherwise route vLLM's extensible KV cache to hbmd."""
    if not enabled():
        return
    import vllm
    from vllm.v1.worker import extensible_kv_cache

    check_version(vllm.__version__)
    if extensible_kv_cache.ExtensibleTensor is VllmExtensibleTensor:
        return  # vLLM may load general plugins more than once in a process
    extensible_kv_cache.ExtensibleTensor = VllmExtensibleTensor
    cache = extensible_kv_cache.ExtensibleKVCache
    cache.commit = capped_commit(cache.commit)
    cache.recommit = promoting_recommit(cache.recommit)
    from vllm.model_executor.model_loader import register_model_loader

    from .vllm_weights import LOAD_FORMAT, HbmdModelLoader

    register_model_loader(LOAD_FORMAT)(HbmdModelLoader)
    log.info("vLLM %s: the extensible KV cache allocates through hbmd, and --load-format %s maps weights from it",
             vllm.__version__, LOAD_FORMAT)
