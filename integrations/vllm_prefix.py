"""The prefix index a keeping vLLM engine's scheduler writes and its successor's adopts (``HBMD_VLLM_KEEP_KV``).

:mod:`hbmd.integrations.vllm_keep` keeps the KV buffer and grafts it into the
successor; this module keeps vLLM's block pool in step with it: it publishes a
block once the step that computed it finished, withdraws it before the step
that reuses it is sent to the GPU, and at start puts every block the
predecessor published into the new pool, where everything the KV depends on
agrees (:func:`compatibility`) and every rank grafted the buffers the index
describes.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from .kv_index import IndexWriter, NotAnIndex, Published, Superseded, read_index
from .vllm_keep import KeepingOff, Scope, engine_name, log, read_note
from .weights_key import checkpoint_fields

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SHOWN_CHANGES = 6
"""How many of the fields that differ a cold start names, the rest counted."""


def compatibility(vllm_config: Any, block_size: int, kv_cache_config: Any) -> dict[str, str]:
    """Everything the KV bytes of a block depend on besides its tokens (which its hash covers, with the cache
    salt, the LoRA and multimodal inputs), as field names and digests: a successor adopts only where every field
    is equal, and names those that are not.

    What vLLM itself hashes to decide its compiled graphs are valid (``VllmConfig.compile_factors``: the model's
    resolved config with its overrides, revision, dtype and quantization, the cache's dtype and layout, the
    attention backend, parallelism, compilation; and ``vllm.envs.compile_factors``: the environment, the KV layout
    among it, and vLLM's version), what it hashes prefixes with, the KV cache's groups and layout as the engine
    core resolved them, and the weights' bytes as their files identify them (:func:`weights_identity`).
    :class:`KeepingOff` where one of those cannot be told."""
    from vllm.v1.core import kv_cache_utils

    fields = shared_fields(vllm_config)
    cache = vllm_config.cache_config
    none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
    fields.update({
        "prefix.block_size": str(block_size),
        "prefix.hash_block_size": str(getattr(cache, "hash_block_size", None)),
        "prefix.match_unit": str(getattr(cache, "prefix_match_unit", None)),
        "prefix.hash_algo": str(cache.prefix_caching_hash_algo),
        "prefix.none_hash": hashlib.sha256(bytes(none_hash)).hexdigest() if none_hash is not None else "",
        "prefix.lookahead_tokens": str(getattr(vllm_config, "num_hash_lookahead_tokens", 0)),
        "kv.groups": _digest(repr(kv_cache_config.kv_cache_groups)),
        "kv.layout": str(getattr(kv_cache_config, "kv_cache_layout", None)),
    })
    return fields


def shared_fields(vllm_config: Any) -> dict[str, str]:
    """The fields of :func:`compatibility` that every process of an engine can tell from its configuration alone:
    vLLM's compile factors, its environment's, and the weights' identity."""
    from vllm import envs

    try:
        factors = {"config": vllm_config.compile_factors(), "env": envs.compile_factors()}
    except (TypeError, ValueError) as exc:
        raise KeepingOff(f"vLLM's configuration cannot be fingerprinted ({exc})") from exc
    fields: dict[str, str] = {}
    for part, sections in factors.items():
        for section, value in sections.items():
            if isinstance(value, dict) and part == "config":
                fields.update((f"{part}.{section}.{name}", _digest(inner)) for name, inner in value.items())
            else:
                fields[f"{part}.{section}"] = _digest(value)
    identity = weights_identity(vllm_config.model_config)
    fields["weights.folder"] = _digest(identity["weights_dir"])
    fields.update((f"weights.{entry['name']}", _digest(entry)) for entry in identity["weights_files"])
    return fields


def weights_identity(model_config: Any) -> dict[str, Any]:
    """The weight files an engine of ``model_config`` reads, as :func:`~hbmd.integrations.weights_key.checkpoint_fields`
    identifies them (each file's resolved path, size, times, device and inode): a local folder or file, or the
    snapshot a hub model resolves to in the local Hugging Face cache (its folder names the revision).
    :class:`KeepingOff` for weights from anywhere else (a URI, a hub model not in the cache)."""
    source = getattr(model_config, "model_weights", "") or model_config.model
    if not os.path.exists(source):
        if "://" in source:
            raise KeepingOff(f"the weights come from {source}, whose files hbmd cannot tell from another version's")
        try:
            from huggingface_hub import snapshot_download

            source = snapshot_download(source, revision=model_config.revision, local_files_only=True)
        except Exception as exc:  # the hub raises a dozen kinds for a model it does not have: none may stop the engine
            raise KeepingOff(f"the weights of {source} are not in the local Hugging Face cache ({exc})") from exc
    try:
        if os.path.isdir(source):
            files = sorted(os.path.join(source, name) for name in os.listdir(source) if name.endswith(WEIGHT_SUFFIXES))
            return checkpoint_fields(source, files)
        return checkpoint_fields(os.path.dirname(source) or ".", [source])
    except OSError as exc:
        raise KeepingOff(f"the weights at {source} cannot be looked at ({exc})") from exc


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def why_not_kept(scheduler: Any) -> str | None:
    """Why this engine's scheduler cannot keep its prefix index, or None."""
    config = scheduler.vllm_config
    if not config.cache_config.enable_prefix_caching:
        return "prefix caching is off"
    if len(scheduler.kv_cache_config.kv_cache_groups) != 1:
        return "the model has several KV cache groups (hybrid or sliding-window layers)"
    if config.speculative_config is not None:
        return "speculative decoding writes KV for tokens it may reject"
    if str(config.load_config.load_format) == "dummy":
        return "the weights are random (--load-format dummy)"
    if getattr(scheduler, "hash_block_size", scheduler.block_size) != scheduler.block_size:
        return "block hashes are made over another block size"
    return None


def scope_of(vllm_config: Any) -> Scope:
    """The kept cache of this engine core: its name's, its data-parallel replica's."""
    return Scope(engine_name(), vllm_config.parallel_config.data_parallel_index)


class Keeper:
    """A scheduler's index: publishes computed blocks, withdraws reused ones, and at start adopts a predecessor's."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        manager = scheduler.kv_cache_manager
        self.pool = manager.block_pool
        self.blocks_of = manager.coordinator.single_type_managers[0].req_to_blocks
        self.block_size = scheduler.block_size
        self.scope = scope_of(scheduler.vllm_config)
        self.world = scheduler.vllm_config.parallel_config.world_size
        self.epochs = [0] * len(self.pool.blocks)
        """Per block, how often it was withdrawn: a block withdrawn between its step's scheduling and its output
        was reused, and what that step computed is not what the block holds."""
        self.cursors: dict[str, tuple[int, int]] = {}
        """Per request, how many of its leading blocks were looked at, and the id of the last of them."""
        self.waiting: collections.deque[tuple[Any, list[tuple[int, int, bytes, int]]]] = collections.deque()
        """The scheduler outputs whose steps complete blocks, in the order they were scheduled (the order their
        outputs come back in), each with those blocks: (block id, epoch, hash, tokens). The output itself is held, not
        its id, which a later output may be given once this one is gone."""
        self.writer: IndexWriter | None = None
        self.path = Path()
        """The index, once :meth:`start` found its folder fit."""

    def start(self) -> None:
        """Adopt what the predecessor's index publishes where it may, and begin this engine's index;
        :class:`KeepingOff` (nothing adopted, no index begun) where this engine cannot keep one."""
        self.path = self.scope.index_path()
        notes = [read_note(self.scope.note_path(rank)) for rank in range(self.world)]
        for rank, note in enumerate(notes):
            if note is None or not isinstance(note.get("buffer"), str) or not isinstance(note.get("gpu"), str):
                raise KeepingOff(f"rank {rank} of this engine left no note of its kept buffer: it keeps none")
            if note.get("weights_changed"):
                raise KeepingOff(f"rank {rank}: {note['weights_changed']}")
        key = compatibility(self.scheduler.vllm_config, self.block_size, self.scheduler.kv_cache_config)
        adopted: dict[int, Published] = {}
        try:
            adopted, why = self.adoptable(key, notes)  # type: ignore[arg-type]
        except (OSError, NotAnIndex, ValueError, KeyError, TypeError) as exc:
            why = f"its index cannot be used ({exc})"
        if why is not None:
            log.info("hbmd: no kept prefix cache adopted (%s)", why)
        for block_id, block in adopted.items():
            self.pool._insert_block_hash(block.block_hash, self.pool.blocks[block_id], num_tokens=block.num_tokens)
        if adopted:
            log.info("hbmd: adopted %d cached KV blocks from the predecessor's prefix cache", len(adopted))
        header = {"key": key, "ranks": [{"buffer": note["buffer"], "gpu": note["gpu"]} for note in notes if note]}
        try:
            self.writer = IndexWriter(self.path, header, adopted)
        except (OSError, TimeoutError) as exc:
            self.abandon(exc)

    def adoptable(self, key: dict[str, str], notes: list[dict[str, Any]]) -> tuple[dict[int, Published], str | None]:
        """The blocks this engine may adopt and, where none, why."""
        cold = [(rank, note.get("why_cold") or "it adopted no buffer") for rank, note in enumerate(notes)
                if note.get("adopted_from") is None]
        if cold:
            return {}, "; ".join(why if len(notes) == 1 else f"rank {rank}: {why}" for rank, why in cold)
        try:
            index = read_index(self.path)
        except FileNotFoundError:
            return {}, "the predecessor left no index"
        if index.header.get("withdrawn"):
            return {}, f"the predecessor withdrew its index: {index.header['withdrawn']}"
        theirs = index.header.get("key", {})
        changed = sorted(field for field in set(key) | set(theirs) if key.get(field) != theirs.get(field))
        if changed:
            more = f" and {len(changed) - SHOWN_CHANGES} more" if len(changed) > SHOWN_CHANGES else ""
            return {}, f"the predecessor's cache differs in {', '.join(changed[:SHOWN_CHANGES])}{more}"
        grafted = [{"buffer": note["adopted_from"], "gpu": note["gpu"]} for note in notes]
        if grafted != index.header.get("ranks"):
            return {}, "the buffers grafted are not the ones the index describes"
        limit = min(min(int(note["adopted_blocks"]) for note in notes), len(self.pool.blocks))
        blocks = {block_id: block for block_id, block in index.blocks.items()
                  if 0 < block_id < limit and block.num_tokens > 0}
        return blocks, None if blocks else "the predecessor's index publishes no block"

    # hooks

    def scheduled(self, output: Any) -> None:
        """After ``schedule``: note the blocks this step completes, and write the withdrawals its allocations made
        before the step can reach the GPU."""
        completes: list[tuple[int, int, bytes, int]] = []
        for req_id in output.num_scheduled_tokens:
            request = self.scheduler.requests.get(req_id)
            blocks = self.blocks_of.get(req_id)
            if request is None or not blocks or request.lora_request is not None:
                continue  # a LoRA's blocks are hashed with its name and path, not its bytes: not kept
            looked, last = self.cursors.get(req_id, (0, -1))
            if looked > len(blocks) or (looked and blocks[looked - 1].block_id != last):
                looked = 0  # preempted and scheduled again: its blocks are new
            full = min(len(blocks), request.num_computed_tokens // self.block_size)
            index = looked
            while index < full:
                block = blocks[index]
                if block.block_hash is None and not block.is_null:
                    # Its last token is not known yet (an asynchronous scheduler samples it in the step before):
                    # looked at again in a later step, once it is.
                    break
                if block.block_hash is not None and block.block_hash_num_tokens == (index + 1) * self.block_size:
                    completes.append((block.block_id, self.epochs[block.block_id], bytes(block.block_hash),
                                      block.block_hash_num_tokens))
                index += 1
            if index > looked:
                self.cursors[req_id] = (index, blocks[index - 1].block_id)
        if completes:
            self.waiting.append((output, completes))
        self.flush()

    def computed(self, output: Any) -> None:
        """Before ``update_from_output``: the step of ``output`` has finished; publish what it completed."""
        if self.writer is None:
            return
        for block_id, epoch, block_hash, num_tokens in self.finished(output):
            block = self.pool.blocks[block_id]
            if self.epochs[block_id] == epoch and block.block_hash == block_hash and \
                    self.writer.published(block_id) != block_hash:
                self.writer.publish(block_id, block_hash, num_tokens)
        for req_id in [r for r in self.cursors if r not in self.scheduler.requests]:
            del self.cursors[req_id]

    def finished(self, output: Any) -> list[tuple[int, int, bytes, int]]:
        """The blocks the step of ``output`` completes, taken off :attr:`waiting` with those of any step scheduled
        before it (their outputs come back first, or never)."""
        if not any(waiting is output for waiting, _ in self.waiting):
            return []
        while True:
            waiting, completes = self.waiting.popleft()
            if waiting is output:
                return completes

    def withdrawn(self, block: Any) -> None:
        """A block loses its hashes (evicted for reuse, or written on): it leaves the index."""
        if block.block_hash is None:
            return
        self.epochs[block.block_id] += 1
        if self.writer is not None and self.writer.published(block.block_id) is not None:
            self.writer.withdraw(block.block_id)

    def cleared(self) -> None:
        self.epochs = [epoch + 1 for epoch in self.epochs]
        if self.writer is not None:
            self.writer.clear()

    def flush(self) -> None:
        if self.writer is None:
            return
        try:
            self.writer.flush()
        except Superseded as exc:
            log.warning("hbmd: %s (a successor started while this engine ran): this engine's prefix cache is no "
                        "longer kept", exc)
            self.writer.close()
            self.writer = None
        except OSError as exc:
            self.abandon(exc)

    def abandon(self, exc: OSError) -> None:
        """The index cannot be written (its folder full or gone): the engine serves on without keeping its prefix
        cache, and the index goes, so that no successor trusts what the withdrawals it lost would have changed."""
        path = self.path
        log.warning("hbmd cannot write the prefix index %s (%s): this engine's prefix cache will not be kept",
                    path, exc)
        try:
            if self.writer is not None:
                writer, self.writer = self.writer, None
                writer.remove()
            else:
                path.unlink(missing_ok=True)
        except (OSError, TimeoutError) as gone:
            log.error("the prefix index %s could not be removed (%s): delete it before the next start", path, gone)


def keeper_of(scheduler: Any) -> Keeper | None:
    """``scheduler``'s keeper, started at its first call (vLLM sets the hash seed, ``NONE_HASH``, after it builds
    the scheduler); None where this engine cannot keep its prefix index, said once."""
    keeper = scheduler.__dict__.get("_hbmd_keeper", False)
    if keeper is not False:
        return keeper
    keeper = None
    why = why_not_kept(scheduler)
    if why is None:
        keeper = Keeper(scheduler)
        try:
            keeper.start()
            hook_pool(scheduler.kv_cache_manager.block_pool, keeper)
        except KeepingOff as exc:
            keeper, why = None, str(exc)
        except Exception:  # a fault of the keeper's must not stop the engine: it serves, keeping nothing
            log.exception("hbmd's prefix keeper could not start: this engine serves without keeping its prefix cache")
            keeper = None
    if why is not None:
        log.warning("hbmd cannot keep this engine's prefix cache: %s", why)
    scheduler.__dict__["_hbmd_keeper"] = keeper
    return keeper


_keeping: dict[type, type] = {}
"""Per scheduler class vLLM picks, the keeping class made of it."""


def keeping(base: Any) -> Any:
    """The scheduler class that keeps a prefix index, made of ``base`` (vLLM's ``Scheduler``, its
    ``AsyncScheduler``, or whichever class the engine's config names): ``base``'s ``schedule`` and
    ``update_from_output``, each with the keeper's note around it. ``base`` itself is left as it is."""
    if base in _keeping.values():
        return base
    if base not in _keeping:

        class Keeping(base):
            def schedule(self, *args: Any, **kwargs: Any) -> Any:
                keeper = keeper_of(self)
                output = super().schedule(*args, **kwargs)
                if keeper is not None:
                    keeper.scheduled(output)
                return output

            def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
                keeper = keeper_of(self)
                if keeper is not None:
                    keeper.computed(scheduler_output)
                result = super().update_from_output(scheduler_output, model_runner_output)
                if keeper is not None:
                    keeper.flush()
                return result

        Keeping.__name__ = Keeping.__qualname__ = f"Keeping{base.__name__}"
        _keeping[base] = Keeping
    return _keeping[base]


def choosing_keeping(original: Any) -> Any:
    """Wrap ``SchedulerConfig.get_scheduler_cls`` (where vLLM's engine core chooses its scheduler class) so that it
    chooses the keeping class made of the one vLLM would pick (:func:`keeping`)."""

    def get_scheduler_cls(self: Any) -> Any:
        return keeping(original(self))

    get_scheduler_cls.__wrapped__ = original  # type: ignore[attr-defined]
    return get_scheduler_cls


def patch_scheduler_choice() -> None:
    """Point vLLM's choice of scheduler class at the keeping one, once: where ``HBMD_VLLM_KEEP_KV`` is on."""
    from vllm.config import SchedulerConfig

    if not hasattr(SchedulerConfig.get_scheduler_cls, "__wrapped__"):
        SchedulerConfig.get_scheduler_cls = choosing_keeping(SchedulerConfig.get_scheduler_cls)


def hook_pool(pool: Any, keeper: Keeper) -> None:
    """Withdraw from ``keeper``'s index every block ``pool`` takes the hashes of, and everything at a prefix-cache
    reset; on this pool object alone (another pool of the process, an offloading tier's, is not this cache)."""
    remove, reset = pool._remove_cached_block_hashes, pool.reset_prefix_cache

    def remove_cached_block_hashes(block: Any) -> Any:
        keeper.withdrawn(block)
        return remove(block)

    def reset_prefix_cache() -> bool:
        done = reset()
        if done:
            keeper.cleared()
            keeper.flush()
        return done

    pool._remove_cached_block_hashes = remove_cached_block_hashes
    pool.reset_prefix_cache = reset_prefix_cache
