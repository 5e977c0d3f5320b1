"""Every place hbmd's vLLM plugin touches vLLM, in one table, checked against the installed vLLM before anything is
patched.

Each :class:`TouchPoint` names a module and a symbol in it, what hbmd expects of it (the leading parameters of a
call, or the attributes of a class and of its instances), what hbmd does with it, and, where it is not a seam vLLM
offers to extensions, why hbmd must use it anyway. :func:`check` compares the whole table with the installed vLLM;
:func:`hbmd.integrations.vllm.register` refuses the whole plugin on any mismatch, so that an engine runs either with
every part of hbmd or with none of it, never half patched. ``tests/test_vllm_compat.py`` asserts that every entry
matches the installed vLLM: it is the first thing to fail on a vLLM that moved one.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import sys
import textwrap
from pathlib import Path
from typing import Any

OPT_IN = "HBMD_VLLM"


class UnsupportedVllm(RuntimeError):
    """The installed vLLM is not one this plugin knows: refusing beats silently allocating the wrong way."""


@dataclasses.dataclass(frozen=True)
class TouchPoint:
    """One symbol of vLLM's that hbmd patches, subclasses, wraps, calls or reads."""

    module: str
    symbol: str
    """A dotted path inside ``module``: ``Class.method``, ``Class`` or a module-level name."""
    expects: tuple[str, ...]
    """A call's leading parameter names, in order; or, for a class read by attribute, the names its class or its
    instances must have."""
    use: str
    """What hbmd does with it."""
    private: str = ""
    """Why hbmd must use a part vLLM does not offer to extensions; empty for one of vLLM's own seams."""
    attributes: bool = False
    """``expects`` names attributes, not parameters."""
    read_not_imported: bool = False
    """Checked in the module's source where the module is not loaded yet, not imported for the check: vLLM's GPU
    worker module is loaded by its worker process alone (importing it elsewhere runs the platform's kernel set-up,
    which a process without that platform cannot)."""

    @property
    def name(self) -> str:
        return f"{self.module}.{self.symbol}"


KV_CACHE = "vllm.v1.worker.extensible_kv_cache"
WORKER = "vllm.v1.worker.gpu_worker"
SCHEDULER = "vllm.v1.core.sched.scheduler"
NO_KV_HOOK = ("vLLM 0.34's extensible KV cache has no allocator or sizing hook: the module's own name is what its "
              "callers look up")
WORKER_SEAM = ("a worker extension (worker_extension_cls) may add methods, not replace the worker's (vLLM refuses the "
               "conflict), and the worker class is a setting of the engine's config, which a plugin never sees")
SCHEDULER_STATE = ("vLLM has no call that lists a request's blocks or the blocks a step completes: the keeper reads "
                   "them where the scheduler keeps them")

TABLE: tuple[TouchPoint, ...] = (
    # The KV cache: allocated through hbmd, sized to what the daemon admits.
    TouchPoint(KV_CACHE, "ExtensibleTensor",
               ("max_num_bytes", "device", "num_segments", "segment_capacities", "export_handle_types"),
               "the module global vLLM's KV cache constructs its tensor by: pointed at hbmd's class", NO_KV_HOOK),
    TouchPoint(KV_CACHE, "ExtensibleKVCache.commit", ("self", "num_blocks", "defragment", "shrink"),
               "wrapped: a commit hbmd refuses fails naming the cause", NO_KV_HOOK),
    TouchPoint(KV_CACHE, "ExtensibleKVCache.committable_blocks", ("self",),
               "wrapped: warm-up commits no more blocks than hbmd admits", NO_KV_HOOK),
    TouchPoint(KV_CACHE, "ExtensibleKVCache.release_physical", ("self",),
               "wrapped: the sleep's release keeps the cache in the host tier with HBMD_VLLM_SLEEP=keep", NO_KV_HOOK),
    TouchPoint(KV_CACHE, "ExtensibleKVCache.recommit", ("self",),
               "wrapped: the wake waits for its blocks, or fails with the engine still asleep", NO_KV_HOOK),
    TouchPoint(KV_CACHE, "ExtensibleKVCache",
               ("buffer", "num_committed_blocks", "segment_strides", "capacity_blocks", "blocks_within",
                "physical_bytes_for"),
               "read: its tensor, its committed and possible blocks, and the bytes a count of blocks takes",
               attributes=True),
    TouchPoint(KV_CACHE, "measure_kv_cache_blocks", ("kv_cache", "vllm_config", "device"),
               "wrapped here and under the GPU worker's name for it: the count is capped to what hbmd admits, a "
               "keeping engine counts its predecessor's blocks, and a standby waits in it for its takeover",
               NO_KV_HOOK),
    TouchPoint(KV_CACHE, "extend_kv_cache", ("runner", "kv_cache_config", "num_blocks"),
               "wrapped here and under the GPU worker's name for it (HBMD_VLLM_KEEP_KV): the predecessor's pages are "
               "grafted before vLLM grows the rest", NO_KV_HOOK),
    TouchPoint(KV_CACHE, "registers_kv_cache_memory", ("vllm_config",),
               "called: a cache a KV connector registers is not grafted"),
    TouchPoint(WORKER, "measure_kv_cache_blocks", ("kv_cache", "vllm_config", "device"),
               "the GPU worker's name for vLLM's measure: wrapped as the original is", NO_KV_HOOK,
               read_not_imported=True),
    TouchPoint(WORKER, "extend_kv_cache", ("runner", "kv_cache_config", "num_blocks"),
               "the GPU worker's name for vLLM's final sizing: wrapped as the original is", NO_KV_HOOK,
               read_not_imported=True),
    TouchPoint(WORKER, "Worker.sleep", ("self", "level"),
               "wrapped: the KV cache's release inside it is the sleep's, which may keep", WORKER_SEAM,
               read_not_imported=True),
    *(TouchPoint(WORKER, f"Worker.{update}", ("self",),
                 "wrapped (HBMD_VLLM_KEEP_KV): a weight update in place withdraws the kept prefix index", WORKER_SEAM,
                 read_not_imported=True)
      for update in ("reload_weights", "start_weight_update", "start_draft_weight_update", "reset_weights")),
    TouchPoint("vllm.config", "get_current_vllm_config_or_none", (),
               "called: the worker's data-parallel replica and rank name its buffer"),
    TouchPoint("vllm.config", "ParallelConfig", ("data_parallel_index", "rank", "world_size"),
               "read: which replica and rank a worker is, and how many ranks share a scheduler", attributes=True),
    # The kept prefix cache's scheduler half (HBMD_VLLM_KEEP_KV).
    TouchPoint("vllm.config", "SchedulerConfig.get_scheduler_cls", ("self",),
               "wrapped: the engine core gets the keeping subclass of the class vLLM picks (its scheduler_cls, "
               "or the asynchronous or plain scheduler)",
               "the class is vLLM's scheduler_cls seam, but a general plugin never sees the engine's config to set "
               "it: the choice is wrapped where it is made, so vLLM's and the operator's choice stand"),
    TouchPoint(SCHEDULER, "Scheduler.schedule", ("self",),
               "overridden in the keeping subclass: the blocks a step completes are noted, the withdrawals written "
               "first"),
    TouchPoint(SCHEDULER, "Scheduler.update_from_output", ("self", "scheduler_output", "model_runner_output"),
               "overridden in the keeping subclass: the blocks of a finished step are published"),
    TouchPoint(SCHEDULER, "Scheduler",
               ("requests", "kv_cache_manager", "block_size", "hash_block_size", "vllm_config", "kv_cache_config"),
               "read: the requests, the KV cache manager and the block size of the engine's scheduler",
               SCHEDULER_STATE, attributes=True),
    TouchPoint("vllm.v1.core.kv_cache_manager", "KVCacheManager", ("block_pool", "coordinator"),
               "read: the block pool and the coordinator of the scheduler's cache", SCHEDULER_STATE, attributes=True),
    TouchPoint("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator", ("single_type_managers",),
               "read: the one group's manager of a model with one KV cache group", SCHEDULER_STATE, attributes=True),
    TouchPoint("vllm.v1.core.single_type_kv_cache_manager", "SingleTypeKVCacheManager", ("req_to_blocks",),
               "read: each request's blocks, to see which a step completes", SCHEDULER_STATE, attributes=True),
    TouchPoint("vllm.v1.core.kv_cache_utils", "KVCacheBlock",
               ("block_id", "block_hash", "block_hash_num_tokens", "is_null"),
               "read: a block's id and the hash and token count it is cached under", attributes=True),
    TouchPoint("vllm.v1.request", "Request", ("lora_request", "num_computed_tokens"),
               "read: a LoRA request's blocks are never kept; the computed tokens say which blocks are full",
               attributes=True),
    TouchPoint("vllm.v1.core.sched.output", "SchedulerOutput", ("num_scheduled_tokens",),
               "read: the requests a step runs", attributes=True),
    TouchPoint("vllm.v1.core.block_pool", "BlockPool._insert_block_hash",
               ("self", "block_hash_with_group_id", "block", "num_tokens"),
               "called at start: each block the predecessor published becomes a cached free block",
               "vLLM has no public call that puts a computed block into its prefix cache"),
    TouchPoint("vllm.v1.core.block_pool", "BlockPool._remove_cached_block_hashes", ("self", "block"),
               "wrapped on the scheduler's pool object: a block that loses its hashes leaves the index first",
               "vLLM's KV events report an eviction after the fact and only where configured: the index must hear "
               "of it before the step that overwrites the block runs"),
    TouchPoint("vllm.v1.core.block_pool", "BlockPool.reset_prefix_cache", ("self",),
               "wrapped on the scheduler's pool object: a reset withdraws the whole index",
               "vLLM offers no hook at a prefix-cache reset"),
    TouchPoint("vllm.v1.core.block_pool", "BlockPool", ("blocks",),
               "read: the pool's blocks by id", SCHEDULER_STATE, attributes=True),
    TouchPoint("vllm.config", "VllmConfig.compile_factors", ("self",),
               "called: what vLLM hashes for its compiled graphs binds a kept cache to its engine's settings"),
    TouchPoint("vllm.envs", "compile_factors", (),
               "called: the environment and vLLM's version a kept cache is bound to"),
    TouchPoint("vllm.v1.core.kv_cache_utils", "NONE_HASH", (),
               "read: the seed of the prefix hashes a kept cache is bound to", "vLLM exports no getter for it",
               attributes=True),
    # The warm standby (HBMD_VLLM_STANDBY).
    TouchPoint("vllm.v1.engine.core_client", "VLLM_ENGINE_READY_TIMEOUT_S", (),
               "set in a standby's front end: it waits for its engine core for as long as the standby waits",
               "vLLM reads the wait from its environment once, at import, and the environment is one of the "
               "compile factors a kept cache is bound to", attributes=True),
    # An engine core ends with its front end.
    TouchPoint("vllm.v1.engine.core", "EngineCoreProc.run_engine_core", ("args", "dp_rank", "local_dp_rank"),
               "wrapped: a forked engine core watches its front end from its start and ends when it ends",
               "vLLM offers no hook in the engine core's process before its engine starts, and a forked engine core "
               "loads no plugin (its front end's are loaded already)"),
    # The weight loader: --load-format hbmd.
    TouchPoint("vllm.model_executor.model_loader", "register_model_loader", ("load_format",),
               "called: registers --load-format hbmd"),
    TouchPoint("vllm.model_executor.model_loader.weight_cache.ipc_loader", "IpcModelLoader._build_model",
               ("self", "vllm_config", "model_config", "prefix", "state"),
               "subclassed, its __init__ bypassed (it would connect to vLLM's weight daemon): the model is built "
               "over the sealed buffer's tensors",
               "vLLM's loader over pre-processed weights is private to its weight cache"),
    TouchPoint("vllm.model_executor.model_loader.weight_cache.ipc_loader", "IpcModelLoader._fallback_load",
               ("self", "vllm_config", "model_config", "prefix"),
               "called: the disk load where hbmd cannot serve the weights", "the weight cache's own fallback"),
    TouchPoint("vllm.model_executor.model_loader.weight_cache.ipc_loader", "IpcModelLoader._fallback_load_config",
               ("self",), "called: the load config of the disk load", "the weight cache's own fallback"),
    TouchPoint("vllm.model_executor.model_loader.weight_cache.ipc_loader", "IpcModelLoader._watch_daemon", ("self",),
               "overridden: there is no weight daemon to watch", "the weight cache's own hook"),
    TouchPoint("vllm.model_executor.model_loader.default_loader", "DefaultModelLoader._prepare_weights",
               ("self", "model_name_or_path", "subfolder", "revision", "fall_back_to_pt", "allow_patterns_overrides"),
               "called: the folder and files vLLM's disk load reads key the sealed weights",
               "vLLM has no public call that finds a checkpoint's files as its loader does"),
    TouchPoint("vllm.config", "CompilationConfig", ("static_forward_context", "static_all_moe_layers"),
               "edited: the layers a failed build registered are forgotten before the disk load registers them again",
               "vLLM offers no call that unregisters a layer", attributes=True),
)


def resolve(point: TouchPoint) -> Any:
    """The object ``point`` names in the installed vLLM; ``LookupError`` naming what is missing."""
    try:
        found: Any = importlib.import_module(point.module)
    except Exception as exc:  # whatever a module raises as it loads, the table does not match this vLLM
        raise LookupError(f"no module {point.module} that loads here ({type(exc).__name__}: {exc})") from exc
    for part in point.symbol.split("."):
        # A name a module declares and sets later (``NONE_HASH``, at the engine's start) is there to be read.
        if not hasattr(found, part) and part not in getattr(found, "__annotations__", {}):
            raise LookupError(f"no {point.name}")
        found = getattr(found, part, None)
    return found


def defines(node: ast.stmt, name: str) -> bool:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    if isinstance(node, ast.ImportFrom):
        return any((alias.asname or alias.name) == name for alias in node.names)
    return isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)


def parameters_in_source(point: TouchPoint) -> list[str]:
    """The parameters of what ``point`` names, read from its module's source (a function or method defined there,
    or a function the module imports by name, looked up where it comes from); ``LookupError`` where it is not
    there."""
    spec = importlib.util.find_spec(point.module)
    if spec is None or spec.origin is None:
        raise LookupError(f"no module {point.module}")
    body = ast.parse(Path(spec.origin).read_text(), spec.origin).body
    for part in point.symbol.split("."):
        node = next((node for node in body if defines(node, part)), None)
        if node is None:
            raise LookupError(f"no {point.name}")
        body = getattr(node, "body", [])
    if isinstance(node, ast.ImportFrom) and node.module:
        imported = TouchPoint(node.module, point.symbol.rpartition(".")[2], point.expects, point.use)
        return list(inspect.signature(resolve(imported)).parameters)
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise LookupError(f"{point.name} is not a function")
    arguments = node.args
    return [argument.arg for argument in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]


def attribute_names(cls: type) -> set[str]:
    """The names a class and its instances have: its own and inherited attributes, annotations and dataclass fields,
    and what any ``__init__`` of its classes assigns to ``self``."""
    names = set(dir(cls))
    for klass in cls.__mro__:
        names.update(getattr(klass, "__annotations__", {}))
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        except (OSError, TypeError, SyntaxError):
            continue
        names.update(node.attr for node in ast.walk(tree)
                     if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                     and isinstance(node.ctx, ast.Store))
    return names


def mismatch(point: TouchPoint) -> str | None:
    """How the installed vLLM differs from what ``point`` expects, or None where it matches."""
    if point.read_not_imported and point.module not in sys.modules:
        try:
            return differs(point, parameters_in_source(point))
        except (LookupError, OSError, SyntaxError, TypeError, ValueError) as exc:
            return str(exc)
    try:
        found = resolve(point)
    except LookupError as exc:
        return str(exc)
    if point.attributes:
        if not isinstance(found, type):
            return None if not point.expects else f"{point.name} is not a class"
        missing = [name for name in point.expects if name not in attribute_names(found)]
        return f"{point.name} has no {', '.join(missing)}" if missing else None
    try:
        parameters = list(inspect.signature(found).parameters)
    except (TypeError, ValueError) as exc:
        return f"{point.name} has no signature to check ({exc})"
    return differs(point, parameters)


def differs(point: TouchPoint, parameters: list[str]) -> str | None:
    """How ``parameters`` differ from the leading ones ``point`` expects, or None."""
    if parameters[: len(point.expects)] != list(point.expects):
        return (f"{point.name} takes ({', '.join(parameters)}), where hbmd expects "
                f"({', '.join(point.expects)}{', ...' if len(parameters) > len(point.expects) else ''})")
    return None


def check(version: str) -> None:
    """Raise :class:`UnsupportedVllm` naming every entry of :data:`TABLE` the installed vLLM (``version``) does not
    match: the plugin then patches nothing."""
    problems = [problem for point in TABLE if (problem := mismatch(point)) is not None]
    if problems:
        raise UnsupportedVllm(
            f"hbmd's vLLM plugin does not match vLLM {version}, so it patches nothing: {'; '.join(problems)}. Unset "
            f"{OPT_IN} (or set it to 0) to run vLLM without hbmd"
        )
