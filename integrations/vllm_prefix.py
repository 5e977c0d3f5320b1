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

import hashlib
import json
import os
from typing import Any

from .kv_index import IndexWriter, NotAnIndex, Published, Superseded, read_index
from .vllm_keep import engine_name, index_path, log, rank_note


def compatibility(vllm_config: Any, block_size: int, kv_cache_config: Any) -> dict[str, Any]:
    """Everything the KV bytes of a block depend on besides its tokens (which its hash covers, with the cache
    salt, the LoRA and multimodal inputs): the model's weights, how the KV is computed and laid out, how block
    hashes are made. A successor adopts only where every field is equal."""
    import vllm
    from vllm.v1.core import kv_cache_utils

    from .weights_key import checkpoint_fields

    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    folder = model.model if os.path.isdir(model.model) else None
    weights: Any = {"model": model.model, "revision": model.revision}
    if folder is not None:
        files = sorted(os.path.join(folder, name) for name in os.listdir(folder)
                       if name.endswith((".safetensors", ".bin", ".pt")))
        weights = checkpoint_fields(folder, files)
    none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
    return {
        "vllm": vllm.__version__,
        "weights": weights,
        "load_format": str(vllm_config.load_config.load_format),
        "dtype": str(model.dtype),
        "quantization": str(model.quantization),
        "kv_cache_dtype": str(cache.cache_dtype),
        "block_size": block_size,
        "kv_cache_groups": repr(kv_cache_config.kv_cache_groups),
        "hash_algo": str(cache.prefix_caching_hash_algo),
        "none_hash": hashlib.sha256(bytes(none_hash)).hexdigest() if none_hash is not None else None,
        "tensor_parallel": parallel.tensor_parallel_size,
        "pipeline_parallel": parallel.pipeline_parallel_size,
        "lora": vllm_config.lora_config is not None,
    }


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


class Keeper:
    """A scheduler's index: publishes computed blocks, withdraws reused ones, and at start adopts a predecessor's."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        manager = scheduler.kv_cache_manager
        self.pool = manager.block_pool
        self.blocks_of = manager.coordinator.single_type_managers[0].req_to_blocks
        self.block_size = scheduler.block_size
        self.world = scheduler.vllm_config.parallel_config.world_size
        self.epochs = [0] * len(self.pool.blocks)
        """Per block, how often it was withdrawn: a block withdrawn between its step's scheduling and its output
        was reused, and what that step computed is not what the block holds."""
        self.cursors: dict[str, tuple[int, int]] = {}
        """Per request, how many of its leading blocks were looked at, and the id of the last of them."""
        self.waiting: dict[int, list[tuple[int, int, bytes, int]]] = {}
        """Per scheduler output (by id), the blocks its step completes: (block id, epoch, hash, tokens)."""
        self.writer: IndexWriter | None = None

    def start(self) -> None:
        """Adopt what the predecessor's index publishes where it may, and begin this engine's index."""
        key = compatibility(self.scheduler.vllm_config, self.block_size, self.scheduler.kv_cache_config)
        notes = [self.read_note(rank) for rank in range(self.world)]
        adopted: dict[int, Published] = {}
        try:
            adopted, why = self.adoptable(key, notes)
        except (OSError, NotAnIndex, ValueError, KeyError, TypeError) as exc:
            why = f"its index cannot be read ({exc})"
        if why is not None:
            log.info("hbmd: no kept prefix cache adopted (%s)", why)
        for block_id, block in adopted.items():
            self.pool._insert_block_hash(block.block_hash, self.pool.blocks[block_id], num_tokens=block.num_tokens)
        if adopted:
            log.info("hbmd: adopted %d cached KV blocks from the predecessor's prefix cache", len(adopted))
        header = {"key": key, "buffers": [note["buffer_id"] if note else None for note in notes]}
        try:
            self.writer = IndexWriter(index_path(), header, adopted)
        except OSError as exc:
            self.abandon(exc)

    def read_note(self, rank: int) -> dict[str, Any] | None:
        try:
            note = json.loads(rank_note(rank).read_text())
        except (OSError, ValueError):
            return None
        return note if isinstance(note, dict) else None

    def adoptable(self, key: dict[str, Any], notes: list[dict[str, Any] | None]) -> tuple[dict[int, Published],
                                                                                             str | None]:
        """The blocks this engine may adopt and, where none, why."""
        if all(note is not None and note.get("adopted_from") is None for note in notes):
            return {}, f"engine {engine_name()} left no KV cache to adopt"
        if any(note is None or note.get("adopted_from") is None for note in notes):
            return {}, "not every rank adopted its predecessor's buffer"
        try:
            index = read_index(index_path())
        except FileNotFoundError:
            return {}, "the predecessor left no index"
        changed = sorted(field for field in set(key) | set(index.header.get("key", {}))
                         if key.get(field) != index.header.get("key", {}).get(field))
        if changed:
            return {}, f"the predecessor's cache differs in {', '.join(changed)}"
        if [note["adopted_from"] for note in notes if note] != index.header.get("buffers"):
            return {}, "the buffers grafted are not the ones the index describes"
        limit = min(min(int(note["adopted_blocks"]) for note in notes if note), len(self.pool.blocks))
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
            if request is None or not blocks:
                continue
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
            self.waiting[id(output)] = completes
        self.flush()

    def computed(self, output: Any) -> None:
        """Before ``update_from_output``: the step of ``output`` has finished; publish what it completed."""
        if self.writer is None:
            return
        for block_id, epoch, block_hash, num_tokens in self.waiting.pop(id(output), ()):
            block = self.pool.blocks[block_id]
            if self.epochs[block_id] == epoch and block.block_hash == block_hash and \
                    self.writer.published(block_id) != block_hash:
                self.writer.publish(block_id, block_hash, num_tokens)
        for req_id in [r for r in self.cursors if r not in self.scheduler.requests]:
            del self.cursors[req_id]

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
        log.warning("hbmd cannot write the prefix index %s (%s): this engine's prefix cache will not be kept",
                    index_path(), exc)
        try:
            if self.writer is not None:
                writer, self.writer = self.writer, None
                writer.remove()
            else:
                index_path().unlink(missing_ok=True)
        except OSError as gone:
            log.error("the prefix index %s could not be removed (%s): delete it before the next start", index_path(),
                      gone)


def keeping_scheduler(scheduler_cls: Any) -> None:
    """Wrap ``schedule`` and ``update_from_output`` of vLLM's scheduler class, once, so that an engine that keeps
    its KV cache keeps its prefix index. The index starts at the first ``schedule``: vLLM sets the hash seed
    (``NONE_HASH``) after it builds the scheduler."""
    if hasattr(scheduler_cls.schedule, "__wrapped__"):
        return
    schedule, update = scheduler_cls.schedule, scheduler_cls.update_from_output

    def keeper_of(self: Any) -> Keeper | None:
        keeper = self.__dict__.get("_hbmd_keeper", False)
        if keeper is False:
            keeper = None
            why = why_not_kept(self)
            if why is not None:
                log.warning("hbmd cannot keep this engine's prefix cache: %s", why)
            else:
                keeper = Keeper(self)
                keeper.start()
                hook_pool(self.kv_cache_manager.block_pool, keeper)
            self.__dict__["_hbmd_keeper"] = keeper
        return keeper

    def kept_schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        keeper = keeper_of(self)
        output = schedule(self, *args, **kwargs)
        if keeper is not None:
            keeper.scheduled(output)
        return output

    def kept_update(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        keeper = keeper_of(self)
        if keeper is not None:
            keeper.computed(scheduler_output)
        result = update(self, scheduler_output, model_runner_output)
        if keeper is not None:
            keeper.flush()
        return result

    kept_schedule.__wrapped__ = schedule  # type: ignore[attr-defined]
    kept_update.__wrapped__ = update  # type: ignore[attr-defined]
    scheduler_cls.schedule = kept_schedule
    scheduler_cls.update_from_output = kept_update


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
