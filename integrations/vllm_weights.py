"""vLLM's weights from hbmd: ``HBMD_VLLM=1 vllm serve MODEL --load-format hbmd``.

The first engine to start with a configuration loads the model from disk
with vLLM's default loader (its ``process_weights_after_loading`` included),
stores the processed tensors in one sealed persistent buffer, and then
builds its model exactly as every later engine does: vLLM's model classes
initialised on the meta device, each parameter and buffer replaced by a
read-only view of the sealed buffer, ``process_weights_after_loading`` run
again in pre-processed mode. A later engine (a restart, a replica, a second
instance on the GPU) reads nothing from disk, and every engine maps the
same pages, so the GPU holds one copy however many engines serve the model.

The key is vLLM's own ``WeightCacheKey`` (checkpoint, revision, dtype,
quantization, TP/PP/DP rank and size, kernel backends, vLLM version ...)
and what identifies the bytes, which vLLM's key does not: its checkpoint
field fingerprints only tensor names and safetensors headers, the same for
a fine-tune of the same shapes and for a checkpoint overwritten in place,
and sealed weights outlive every engine. hbmd adds ``weights_dir``, the
folder vLLM's default loader reads resolved (a local folder; for a hub
model the cache's snapshot folder, which names the revision, downloaded
first as that loader would), and ``weights_files``, each weight file there
with its resolved path (a snapshot's blob), size and modification time in
nanoseconds (:mod:`hbmd.integrations.weights_key`). A copy of a checkpoint
in another folder is another checkpoint; a rewrite that keeps a file's size
and modification time goes unseen, as no weight byte is read to tell.

The buffer is named ``vllm-weights:<architecture>:<folder>:<dtype>:tp<r>of<n>:pp<r>of<n>:<digest>``
(``<folder>`` the checkpoint folder's own name),
the digest a SHA-256 of every field of the key, which the buffer also
records whole so that a reader compares field by field. Two engines
starting together: the one that creates the buffer first stores, from a
session named ``vllm-weights-store:<digest>``, and the other waits for the
seal and maps; an unsealed buffer whose storer died is deleted by the next
engine, which stores again; one held by any other live session (a process
of the same user that took the name), or unsealed for longer than ``wait_s``
(one that could be such a process under a storer's name; the daemon counts
the time across every session that held the name), is not waited for. A
storer whose weight files change while it reads them keeps its copy and
stores nothing.
Anything that keeps the weights from coming from hbmd (no daemon, a key
that differs, a name held by something that is not storing it, a
quantization that cannot be rebuilt from processed tensors, a storer that
takes longer than ``wait_s``) loads from disk with a warning saying why,
unless ``fallback`` is off.

Options, as ``--model-loader-extra-config '{"fallback": false, "wait_s": 60}'``:
``fallback`` (default true) and ``wait_s``, the longest to wait for another
engine's store (default 600 s).

This module imports vLLM; :func:`hbmd.integrations.vllm.register` imports
it only when the operator opts in.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import logging
import os
import re
import time
from typing import Any

import torch
from hbmd.client import Client, Conflict, NotFound, default_client
from hbmd.client.tensor import ExtensibleTensor
from hbmd.client.weights import Weights, open_weights, write_weights
from hbmd.integrations.settings import LOAD_FORMAT
from hbmd.integrations.weights_key import checkpoint_fields, files_changes, not_a_store, storer_name, unsealed_for
from hbmd.proto.admin import SessionInfo
from hbmd.proto.buffers import MAX_NAME, BufferInfo
from hbmd.proto.units import format_bytes
from torch import nn
from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.distributed import (
    get_dp_group,
    get_pp_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.utils import get_draft_load_config
from vllm.model_executor.model_loader.weight_cache.ipc_loader import IpcModelLoader
from vllm.model_executor.model_loader.weight_cache.protocol import (
    CacheConfigMismatchError,
    WeightCacheKey,
    WeightCacheState,
    check_ipc_quant_support,
)
from vllm.model_executor.model_loader.weight_cache.utils import (
    export_model_attrs,
    record_external_weight_charge,
    record_external_weight_fallback,
)

# Under vLLM's logger, so that what hbmd does shows in vLLM's own log, in its format.
log = logging.getLogger("vllm.hbmd")

NAME_PREFIX = "vllm-weights"
FORMAT = "vllm-weights-1"
"""What the buffer's manifest says it holds: vLLM's processed tensors, their kinds, tied aliases and model flags."""
DEFAULT_WAIT_S = 600.0
POLL_S = 0.2


class WeightsNotReady(RuntimeError):
    """Another engine was still storing the weights when this one stopped waiting."""


class WeightsNameHeld(RuntimeError):
    """The weights' name is held, unsealed, by a session that is not an engine storing them: no seal is coming."""


class CheckpointChanged(RuntimeError):
    """A weight file changed while the storing engine read the checkpoint: what it read is not sealed."""


def key_fields(key: WeightCacheKey, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """hbmd's key: vLLM's fields as JSON gives them back (tuples as lists), so that a stored key and a computed one
    compare, and ``checkpoint``'s (:func:`~hbmd.integrations.weights_key.checkpoint_fields`)."""
    return json.loads(json.dumps(dataclasses.asdict(key), sort_keys=True, default=str)) | checkpoint


def weights_name(key: dict[str, Any]) -> str:
    """The sealed buffer's name for ``key`` (:func:`key_fields`): readable in ``hbmctl buffers``, unique by the digest
    of every field, the checkpoint's files included."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    model = re.sub(r"[^A-Za-z0-9._-]", "_", key["model_arch"])[:32] or "model"
    folder = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(key["weights_dir"])) or "checkpoint"
    ranks = f"tp{key['tp_rank']}of{key['tp_size']}:pp{key['pp_rank']}of{key['pp_size']}"
    if key["dp_size"] > 1:
        ranks += f":dp{key['dp_rank']}of{key['dp_size']}"
    role = ":draft" if key["is_draft"] else ""
    rest = f"{key['dtype'].removeprefix('torch.')}:{ranks}{role}:{digest}"
    # The checkpoint folder's own name, so that `hbmctl weights` tells two fine-tunes of one architecture apart; cut
    # to what a buffer name's 128 characters leave.
    folder = folder[: max(8, MAX_NAME - len(f"{NAME_PREFIX}:{model}::{rest}"))]
    return f"{NAME_PREFIX}:{model}:{folder}:{rest}"


@dataclasses.dataclass
class MappedEntry:
    """One tensor of the sealed buffer, as vLLM's model building takes a weight cache entry."""

    kind: str
    tensor: Any

    def rebuild(self, device_index: int) -> Any:
        return self.tensor


class HbmdModelLoader(IpcModelLoader):
    """``--load-format hbmd``: vLLM's weight cache loader, with the weights in an hbmd sealed buffer.

    It takes vLLM's model building from :class:`IpcModelLoader` (meta-device
    initialisation, tied aliases, pre-processed ``process_weights_after_loading``)
    and its disk fallback; only where the bytes come from differs.
    ``source`` says where they came from: ``"stored"`` (this engine loaded
    them from disk into hbmd), ``"mapped"`` or ``"disk"``.
    """

    def __init__(self, load_config: LoadConfig) -> None:
        BaseModelLoader.__init__(self, load_config)
        extra = dict(load_config.model_loader_extra_config or {})
        self.fallback = extra.pop("fallback", True)
        self.wait_s = float(extra.pop("wait_s", DEFAULT_WAIT_S))
        if not isinstance(self.fallback, bool) or not 0 <= self.wait_s <= 86400:
            raise ValueError(f"load format {LOAD_FORMAT}: fallback must be true or false and wait_s 0 to 86400 seconds")
        if extra:
            raise ValueError(
                f"unexpected --model-loader-extra-config keys for load format {LOAD_FORMAT}: {sorted(extra)}"
            )
        # What IpcModelLoader's model building reads: the engine maps the tensors, it does not copy them.
        self.mode = "zero_copy"
        self.is_draft = False
        self.weights: Weights | None = None
        """The read claim this engine's parameters are views of."""
        self.source = ""
        self._checkpoints: dict[tuple[str, str | None], tuple[str, list[str]]] = {}
        """The folder and weight files of each model (and revision) this engine loads: found once, so that the key
        vLLM sizes its memory by is the key the load uses."""

    # vLLM's loader interface

    def get_external_weight_memory(self, vllm_config: VllmConfig) -> int:
        """The bytes of the sealed weights this engine will map, already resident: vLLM sizes its KV cache without them.

        Weights this engine stores itself are not resident yet: its memory
        profile counts them once they are, as it would a disk load.
        """
        total = self._resident_bytes(vllm_config, vllm_config.model_config)
        spec = vllm_config.speculative_config
        if (spec is not None and spec.draft_model_config is not None
                and get_draft_load_config(vllm_config).load_format == LOAD_FORMAT):
            total += self._resident_bytes(vllm_config, spec.draft_model_config)
        return total

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        if vllm_config.parallel_config.enable_eplb:
            raise ValueError(f"load format {LOAD_FORMAT} does not support EPLB: its expert weights move")
        name = ""
        registered = _registrations(vllm_config)
        try:
            key = self._key(vllm_config, model_config)
            name = weights_name(key)
            return self._load(vllm_config, model_config, prefix, key, name)
        except Exception as exc:
            if not self.fallback:
                raise
            log.warning("weights %s: not from hbmd (%s); loading them from disk", name or "(no key)", exc)
        # A model built before the failure registered its layers by name: the one loaded from disk registers the
        # same names, which vLLM refuses twice.
        _forget_since(vllm_config, registered)
        record_external_weight_fallback(name, self.is_draft)
        self.source = "disk"
        return self._fallback_load(vllm_config, model_config, prefix)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """Copy the sealed tensors into ``model``'s own parameters (a model loaded from disk); parameters that are views
        of the sealed buffer already hold them, and are never written."""
        if self.weights is None:
            raise RuntimeError(f"load format {LOAD_FORMAT}: no weights mapped; load the model first")
        targets = dict(model.named_parameters()) | dict(model.named_buffers())
        for name, source in self.weights.tensors.items():
            target = targets.get(name)
            if target is None or target.shape != source.shape:
                log.warning("weights: %s has no parameter of its shape in the model; skipped", name)
            elif target.data_ptr() != source.data_ptr():
                target.data.copy_(source)

    # IpcModelLoader's hooks

    def _watch_daemon(self) -> None:
        """Nothing to watch: the mapping outlives a restart of hbmd, and a restarted hbmd keeps the one copy."""

    # where the weights come from

    def _load(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str, key: dict[str, Any],
              name: str) -> nn.Module:
        device = self._device(vllm_config)
        client = default_client(device)
        uid = _uid_seen_by(client)
        deadline = time.monotonic() + self.wait_s
        waited = False
        while True:
            info = _named(client, name, uid)
            if info is None:
                model = self._store(vllm_config, model_config, prefix, key, name, device, client)
                if model is not None:
                    return model
            elif info.sealed:
                try:
                    return self._map(vllm_config, model_config, prefix, key, name, device, client, "mapped")
                except NotFound:
                    pass  # deleted since it was listed: look again
            elif info.session_id == 0:
                self._clear_abandoned(name, device, client)
                continue
            else:
                holder = _session(client, info.session_id)
                # No holder: its session ended since the buffer was listed, leaving it sealed or abandoned.
                if holder is not None:
                    reason = not_a_store(name, holder, self.wait_s, unsealed_for(info, time.time()))
                    if reason:
                        raise WeightsNameHeld(reason)
                    if not waited:
                        # At WARNING: a process of the same user could hold the name under a storer's session name.
                        log.warning("weights %s: waiting up to %.0f s for session %d (pid %d, uid %d, client %r) to "
                                    "store them", name, max(0.0, deadline - time.monotonic()), holder.session_id,
                                    holder.pid, holder.uid, holder.client_name)
                        waited = True
            if time.monotonic() >= deadline:
                # None: another engine claimed the name between this one's look and its claim.
                by = "another engine" if info is None else f"session {info.session_id}"
                raise WeightsNotReady(f"{name} was still being stored after {self.wait_s:g} s, held unsealed by {by}")
            time.sleep(POLL_S)

    def _store(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str, key: dict[str, Any], name: str,
               device: torch.device, client: Client) -> nn.Module | None:
        """Claim ``name``, load from disk, store and map; None when another engine claimed it first.

        The claim is the buffer itself, created empty before the disk load so
        that a second engine waits instead of loading too; its capacity (the
        budget: address space only) fits any model the daemon can hold. It
        belongs to a session of its own, named after the key, by which that
        engine tells a store from a name taken by anything else.
        """
        storer = Client(client.paths, timeout=client.timeout, client_name=storer_name(name), lease=False)
        try:
            return self._store_as(storer, vllm_config, model_config, prefix, key, name, device, client)
        finally:
            storer.close()

    def _store_as(self, storer: Client, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str,
                  key: dict[str, Any], name: str, device: torch.device, client: Client) -> nn.Module | None:
        try:
            claim = ExtensibleTensor(storer.status().budget_bytes, device, client=storer, name=name, persistent=True)
        except Conflict:
            return None
        registered = _registrations(vllm_config)
        try:
            log.info("weights %s: the first engine with this key: loading from disk to store them", name)
            model = self._fallback_load(vllm_config, model_config, prefix)
        except BaseException:
            claim.free()
            raise
        try:
            check_ipc_quant_support(model)
            self._check_unchanged(model_config, key)
            write_weights(claim, *self._exported(model, key))
        except Exception as exc:
            # Whatever kept the store from completing (an import inside vLLM's quantization check included), the
            # model from disk is whole: this engine serves with it rather than build a second one.
            claim.free()
            if not self.fallback:
                raise
            log.warning("weights %s: not stored in hbmd (%s); this engine keeps its copy from disk", name, exc)
            self.source = "disk"
            return model
        except BaseException:
            claim.free()
            raise
        claim.detach()
        _forget_since(vllm_config, registered)
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return self._map(vllm_config, model_config, prefix, key, name, device, client, "stored")

    def _map(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str, key: dict[str, Any], name: str,
             device: torch.device, client: Client, source: str) -> nn.Module:
        weights = open_weights(name, device, client)
        try:
            meta = weights.meta
            if meta.get("format") != FORMAT:
                raise CacheConfigMismatchError(f"{name} holds {meta.get('format') or 'no vLLM weights'}, not {FORMAT}")
            stored = meta.get("key", {})
            differ = sorted(field for field in key.keys() | stored.keys() if key.get(field) != stored.get(field))
            if differ:
                changes = files_changes(stored.get("weights_files"), key["weights_files"])
                which = ", ".join(differ) + (f" ({'; '.join(changes)})" if changes else "")
                raise CacheConfigMismatchError(f"{name} was stored for another configuration: {which} differ")
            kinds = meta["kinds"]
            # Parameters are mapped; buffers (attention scales, rotary caches: small) are copied, as vLLM's
            # post-processing writes some of them in place, even over weights that are processed already.
            state = WeightCacheState(
                entries={n: MappedEntry(kinds[n], t if kinds[n] == "param" else t.clone())
                         for n, t in weights.tensors.items()},
                aliases=meta.get("aliases", {}),
                attrs=meta.get("attrs", {}),
            )
            model = self._build_model(vllm_config, model_config, prefix, state)
        except BaseException:
            weights.buffer.detach()
            raise
        self.weights, self.source = weights, source
        params = [t for n, t in weights.tensors.items() if kinds[n] == "param"]
        log.info("weights %s: %d parameters (%s) of %s mapped read-only from hbmd, %d buffers copied; %s", name,
                 len(params), format_bytes(sum(t.numel() * t.element_size() for t in params)), key["weights_dir"],
                 len(weights.tensors) - len(params),
                 "stored by this engine" if source == "stored" else "nothing read from disk")
        return model

    def _clear_abandoned(self, name: str, device: torch.device, client: Client) -> None:
        """Delete the unsealed orphan ``name``: its storer died before the seal, and nobody may read half a model."""
        try:
            abandoned = ExtensibleTensor.attach(name, device, client=client)
        except (Conflict, NotFound):
            return  # taken or cleared by another engine meanwhile
        if abandoned.sealed:
            abandoned.detach()
            return
        log.warning("weights %s: deleting what an engine that died while storing them left", name)
        abandoned.free()

    # helpers

    def _exported(self, model: nn.Module, key: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model's distinct tensors by name, and what the buffer records beside them."""
        tensors: dict[str, Any] = {}
        kinds: dict[str, str] = {}
        aliases: dict[str, str] = {}
        named: dict[int, str] = {}
        for kind, items in (("param", model.named_parameters(remove_duplicate=False)),
                            ("buffer", model.named_buffers(remove_duplicate=False))):
            for tensor_name, tensor in items:
                if tensor_name in kinds or tensor_name in aliases:
                    continue
                if id(tensor) in named:
                    aliases[tensor_name] = named[id(tensor)]
                    continue
                named[id(tensor)] = tensor_name
                tensors[tensor_name], kinds[tensor_name] = tensor, kind
        meta = {"format": FORMAT, "key": key, "kinds": kinds, "aliases": aliases,
                "attrs": export_model_attrs(model)}
        return tensors, meta

    def _key(self, vllm_config: VllmConfig, model_config: ModelConfig) -> dict[str, Any]:
        """hbmd's key for ``model_config`` in this engine (:func:`key_fields`)."""
        folder, files = self._checkpoint(model_config)
        return key_fields(self._vllm_key(vllm_config, model_config), checkpoint_fields(folder, files))

    def _checkpoint(self, model_config: ModelConfig) -> tuple[str, list[str]]:
        """The folder and the weight files vLLM's default loader reads for ``model_config``, found as it finds them (a
        hub model downloaded first, unless in the cache and offline), once per model.

        The files of the model's own checkpoint: those its model class adds
        from elsewhere (``secondary_weights``) are not known before it is built.
        """
        source = (model_config.model, model_config.revision)
        if source not in self._checkpoints:
            folder, files, _, _ = DefaultModelLoader(self._fallback_load_config())._prepare_weights(
                model_config.model, None, model_config.revision, fall_back_to_pt=True, allow_patterns_overrides=None)
            self._checkpoints[source] = (folder, files)
        return self._checkpoints[source]

    def _check_unchanged(self, model_config: ModelConfig, key: dict[str, Any]) -> None:
        """Raise ``CheckpointChanged`` when a weight file changed since ``key`` was taken: the bytes this engine read
        may be neither the old checkpoint nor the new one."""
        now = checkpoint_fields(*self._checkpoint(model_config))
        changes = files_changes(key["weights_files"], now["weights_files"])
        if changes:
            raise CheckpointChanged(f"its weight files changed while this engine read them: {'; '.join(changes)}")

    def _vllm_key(self, vllm_config: VllmConfig, model_config: ModelConfig) -> WeightCacheKey:
        spec = vllm_config.speculative_config
        self.is_draft = spec is not None and model_config is spec.draft_model_config
        dp, pp = get_dp_group(), get_pp_group()
        parallel = vllm_config.parallel_config
        return WeightCacheKey.from_model_config(
            model_config,
            cache_config=vllm_config.cache_config,
            tp_size=get_tensor_model_parallel_world_size(),
            tp_rank=get_tensor_model_parallel_rank(),
            pp_size=pp.world_size,
            pp_rank=pp.rank_in_group,
            dp_size=dp.world_size,
            dp_rank=dp.rank_in_group,
            is_draft=self.is_draft,
            enable_expert_parallel=parallel.enable_expert_parallel,
            expert_placement_strategy=parallel.expert_placement_strategy,
            kernel_config=vllm_config.kernel_config,
        )

    def _resident_bytes(self, vllm_config: VllmConfig, model_config: ModelConfig) -> int:
        name = ""
        try:
            key = self._key(vllm_config, model_config)
            name = weights_name(key)
            client = default_client(self._device(vllm_config))
            info = _named(client, name, _uid_seen_by(client))
            size = info.physical_bytes if info is not None and info.sealed else 0
        except Exception as exc:
            if not self.fallback:
                raise
            log.warning("weights %s: cannot ask hbmd what is resident (%s); counting nothing", name or "(no key)", exc)
            return 0
        record_external_weight_charge(name, self.is_draft, size)
        return size

    def _device(self, vllm_config: VllmConfig) -> torch.device:
        device = torch.device(self.load_config.device or vllm_config.device_config.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device


def _uid_seen_by(client: Client) -> int:
    """This process's uid as the daemon sees it, from this session's record: in another user namespace it is not
    ``os.getuid()``."""
    return next(s.uid for s in client.sessions(client.session_id))


def _session(client: Client, session_id: int) -> SessionInfo | None:
    """Live session ``session_id``, as this session may see it (its own user's); None once it has ended."""
    return next(iter(client.sessions(session_id)), None)


def _named(client: Client, name: str, uid: int) -> BufferInfo | None:
    """User ``uid``'s persistent buffer ``name`` (names are per user), asked for alone: however many buffers others
    hold, the answer is one page."""
    return next((b for b in client.buffers(name=name, owner_uid=uid) if b.persistent), None)


def _registrations(vllm_config: VllmConfig) -> tuple[set[str], int]:
    """What models built in ``vllm_config`` have registered so far: the layer names of its forward context and the
    length of its list of MoE layers (see :func:`_forget_since`)."""
    compilation = vllm_config.compilation_config
    return set(compilation.static_forward_context), len(compilation.static_all_moe_layers)


def _forget_since(vllm_config: VllmConfig, registered: tuple[set[str], int]) -> None:
    """Drop what models built in ``vllm_config`` registered since :func:`_registrations` returned ``registered``
    (attention, state and MoE layers register by name, and a name registered twice stops vLLM), so that the next
    model built can register the same names."""
    names, moe_layers = registered
    compilation = vllm_config.compilation_config
    for layer in [name for name in compilation.static_forward_context if name not in names]:
        del compilation.static_forward_context[layer]
    del compilation.static_all_moe_layers[moe_layers:]
