"""The kept prefix index under vLLM 0.34's own scheduler and block pool, driven step by step on the CPU.

The model's forward pass is stood in for by a record of what each step
writes: per block slot, the whole prefix whose KV it would hold. An engine is
"killed" at a random point of a random workload (after scheduling a step,
after running it, after its output is processed); a successor then adopts
the index, and every block it adopts must hold exactly the prefix its hash
names, which is what lets it serve a token a cold engine would not.

Needs vLLM 0.34 installed (integrations/README.md); skipped elsewhere.
"""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM is not installed")
from hbmd.integrations import kv_index, vllm_keep, vllm_prefix
from hbmd.integrations import vllm as plugin
from hbmd.integrations.kv_index import read_index
from hbmd.testing.spawn import LineProcess
from helpers import MiB, filled, torch, wait_until
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    LoadConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_block_hash, get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

pytestmark = [pytest.mark.vllm, pytest.mark.ipc, pytest.mark.torch]

BLOCK = 16
NUM_BLOCKS = 48
SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=32, dtype=torch.float32)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=1024).save_pretrained(folder)
    return folder


@pytest.fixture
def kept(monkeypatch, tmp_path):
    monkeypatch.setenv(vllm_keep.KEEP, "1")
    monkeypatch.setenv("HBMD_VLLM_ENGINE", "e")
    monkeypatch.setenv(vllm_keep.INDEX_DIR, str(tmp_path / "index"))
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    if not hasattr(SchedulerConfig.get_scheduler_cls, "__wrapped__"):
        monkeypatch.setattr(SchedulerConfig, "get_scheduler_cls", SchedulerConfig.get_scheduler_cls)
        vllm_prefix.patch_scheduler_choice()
    return tmp_path / "index"


def scheduler(folder, kind: type[Scheduler] = Scheduler, tensor_parallel: int = 1, dp: int = 0,
              cache_dtype: str = "auto", hf_overrides: dict | None = None, lora: bool = False) -> Scheduler:
    """vLLM's scheduler of an engine of the model in ``folder``, on the CPU, of the class the engine core chooses
    (``kind``: the plain or the asynchronous one) and built as it builds it."""
    model = ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype="float32", max_model_len=1024,
                        hf_overrides=hf_overrides or {})
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True, cache_dtype=cache_dtype)
    cache.num_gpu_blocks = NUM_BLOCKS
    config = VllmConfig(model_config=model, cache_config=cache, device_config=DeviceConfig(device="cpu"),
                        load_config=LoadConfig(load_format="auto"),
                        parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel),
                        lora_config=LoRAConfig(max_loras=2) if lora else None,
                        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=1024,
                                                         is_encoder_decoder=False))
    config.parallel_config.data_parallel_index = dp  # what vLLM sets in each engine core of `--data-parallel-size`
    config.scheduler_config.async_scheduling = issubclass(kind, AsyncScheduler)
    size = NUM_BLOCKS * SPEC.page_size_bytes
    kv = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_groups=[KVCacheGroupSpec(["l0"], SPEC)],
                       kv_cache_tensors=[KVCacheTensor(size=size, layers=["l0"], layer_stride=size,
                                                       block_stride=SPEC.page_size_bytes)])
    init_none_hash(get_hash_fn_by_name("sha256"))
    chosen = config.scheduler_config.get_scheduler_cls()
    assert issubclass(chosen, kind)
    return chosen(vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
                block_size=BLOCK, log_stats=False)


def note(folder, buffer: str, adopted_from: str | None, rank: int = 0, dp: int = 0, why_cold: str = "") -> None:
    """A rank's note as its worker writes it: the buffer it holds, whose it grafted (None: none, ``why_cold``)."""
    folder.mkdir(mode=0o700, exist_ok=True)
    files = "e" if dp == 0 else f"e.dp{dp}"
    (folder / f"{files}.rank{rank}.json").write_text(json.dumps({
        "buffer": buffer, "gpu": f"GPU-{dp}-{rank}", "adopted_from": adopted_from, "adopted_blocks": NUM_BLOCKS,
        "why_cold": why_cold, "weights_changed": ""}))


HASHER = get_request_block_hasher(BLOCK, get_hash_fn_by_name("sha256"))


def request(name: str, tokens: list[int], max_tokens: int, lora: LoRARequest | None = None) -> Request:
    return Request(name, tokens, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), None,
                   block_hasher=HASHER, lora_request=lora)


class Gpu:
    """What the stand-in forward pass wrote: per (block, slot), the prefix whose KV the slot holds."""

    def __init__(self) -> None:
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}
        self.prefixes: dict[bytes, tuple[int, ...]] = {}
        """Every block hash seen, and the prefix it stands for."""

    def run(self, output, placed: dict[str, tuple[Request, int, list]]) -> None:
        """Write what the step of ``output`` computes, each request's tokens where :func:`where_placed` saw them
        placed when the step was scheduled (an asynchronous scheduler has scheduled the next step since, and may
        have finished the request)."""
        for req_id, count in output.num_scheduled_tokens.items():
            req, start, blocks = placed[req_id]
            tokens = req.all_token_ids
            for position in range(start, start + count):
                self.slots[(blocks[position // BLOCK].block_id, position % BLOCK)] = tuple(tokens[: position + 1])
            for index, block_hash in enumerate(req.block_hashes):
                self.prefixes[bytes(block_hash)] = tuple(tokens[: (index + 1) * BLOCK])

    def holds(self, block_id: int, block_hash: bytes) -> bool:
        prefix = self.prefixes[bytes(get_block_hash(block_hash))]
        return all(self.slots.get((block_id, slot)) == prefix[: len(prefix) - BLOCK + slot + 1]
                   for slot in range(BLOCK))


def outputs_for(output) -> ModelRunnerOutput:
    ids = list(output.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[7] for _ in ids])


def where_placed(s: Scheduler, output) -> dict[str, tuple[Request, int, list]]:
    """Per request of the step just scheduled: the request, where its tokens of the step begin, its blocks."""
    blocks_of = s.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks
    return {r: (s.requests[r], s.requests[r].num_computed_tokens - n, list(blocks_of[r]))
            for r, n in output.num_scheduled_tokens.items()}


def drive(s: Scheduler, gpu: Gpu, rng: random.Random, steps: int, stop_at: str) -> None:
    """Random requests over a few shared prefixes through ``steps`` steps, stopping the last one at ``stop_at``.

    An asynchronous scheduler schedules a step before the previous one's output is processed, as vLLM's engine
    does with ``async_scheduling``: the step runs on the GPU behind the one before, and its output is processed
    after the next step was scheduled."""
    prefixes = [[rng.randrange(1, 1000) for _ in range(rng.choice((20, 40, 70)))] for _ in range(3)]
    ahead = isinstance(s, AsyncScheduler)
    pending = None
    for step in range(steps):
        if rng.random() < 0.5 or not s.requests:
            tokens = rng.choice(prefixes) + [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 40))]
            s.add_request(request(f"r{step}", tokens, rng.randrange(1, 30)))
        output = s.schedule()
        placed = where_placed(s, output)
        if step == steps - 1 and stop_at == "scheduled":
            return
        if not ahead:
            pending = (output, placed)
        if pending is not None:
            gpu.run(*pending)
        if step == steps - 1 and stop_at == "ran":
            return
        if pending is not None:
            s.update_from_output(pending[0], outputs_for(pending[0]))
        pending = (output, placed) if ahead else None


def damage(path, rng: random.Random, how: str) -> None:
    """Change the index at ``path`` as a crash, a full disk or a stray write might: cut it anywhere, or change one
    byte anywhere."""
    data = bytearray(path.read_bytes())
    if how == "cut":
        del data[rng.randrange(1, len(data)) :]
    else:
        data[rng.randrange(len(data))] ^= rng.randrange(1, 256)
    path.write_bytes(data)


def adopted_by(successor: Scheduler) -> dict[int, bytes]:
    """The blocks ``successor``'s pool holds cached, by id: what it adopted, before it ran any step of its own."""
    return {block.block_id: block.block_hash for block in successor.kv_cache_manager.block_pool.blocks
            if block.block_hash is not None}


@pytest.mark.parametrize("rewrite", [False, True], ids=["appended", "rewritten"])
@pytest.mark.parametrize("kind", [Scheduler, AsyncScheduler], ids=["sync", "async"])
def test_a_successor_adopts_only_blocks_that_hold_the_prefix_their_hash_names_wherever_the_engine_died(
        kept, model_folder, kind, rewrite, monkeypatch):
    rewrites = []
    if rewrite:  # the index is rewritten at every flush, as a long-serving engine's is now and then
        monkeypatch.setattr(kv_index, "COMPACT_AT_BYTES", 0)
        monkeypatch.setattr(kv_index, "COMPACT_FACTOR", 0)
        compact = kv_index.IndexWriter.compact
        monkeypatch.setattr(kv_index.IndexWriter, "compact", lambda self: rewrites.append(compact(self)))
    rng = random.Random(1234)
    adopted_total = damaged = 0
    for trial in range(40):
        note(kept, f"b{100 + trial}", None)
        gpu = Gpu()
        predecessor = scheduler(model_folder, kind=kind)
        drive(predecessor, gpu, rng, rng.randrange(2, 60), rng.choice(("scheduled", "ran", "processed")))
        how = rng.choice((None, None, "cut", "flip"))
        if how is not None:
            damage(kept / "e.index", rng, how)
        note(kept, f"b{200 + trial}", f"b{100 + trial}")
        successor = scheduler(model_folder)
        successor.schedule()  # the index is adopted at the first step
        adopted = adopted_by(successor)
        assert all(gpu.holds(block_id, block_hash) for block_id, block_hash in adopted.items()), trial
        assert how is None or not adopted, (trial, how)  # a damaged index is not trusted at all
        adopted_total += len(adopted)
        damaged += how is not None
    assert adopted_total > 50 and damaged > 10  # the checks above ran on many blocks and many damaged indexes
    assert len(rewrites) > 20 if rewrite else not rewrites, len(rewrites)


@pytest.mark.parametrize("tensor_parallel", [1, 2], ids=["tp1", "tp2"])
def test_data_parallel_replicas_of_one_engine_keep_and_adopt_each_its_own_cache_wherever_they_died(
        kept, model_folder, tensor_parallel):
    """``--data-parallel-size 2`` gives both engine cores one HBMD_VLLM_ENGINE: each replica keeps its own index,
    and a restarted replica adopts its own, never the other's, wherever each was killed; with tensor parallelism,
    each of its ranks grafted."""
    rng = random.Random(99 + tensor_parallel)
    adopted_total = 0
    for trial in range(16):
        gpus = {}
        for dp in (0, 1):
            for rank in range(tensor_parallel):
                note(kept, f"b{dp}-{rank}-{trial}", None, rank=rank, dp=dp)
            gpus[dp] = Gpu()
            drive(scheduler(model_folder, dp=dp, tensor_parallel=tensor_parallel), gpus[dp], rng,
                  rng.randrange(5, 40), rng.choice(("scheduled", "ran", "processed")))
        for dp in (1, 0):
            for rank in range(tensor_parallel):
                note(kept, f"c{dp}-{rank}-{trial}", f"b{dp}-{rank}-{trial}", rank=rank, dp=dp)
            successor = scheduler(model_folder, dp=dp, tensor_parallel=tensor_parallel)
            successor.schedule()
            adopted = adopted_by(successor)
            assert all(gpus[dp].holds(block_id, block_hash) for block_id, block_hash in adopted.items()), (trial, dp)
            adopted_total += len(adopted)
    assert adopted_total > 50 and sorted(p.name for p in kept.glob("*.index")) == ["e.dp1.index", "e.index"]


PROMPT = list(range(1, 70))
"""69 tokens: four full blocks."""


def serve_one_prompt(predecessor: Scheduler, lora: LoRARequest | None = None) -> None:
    """Run :data:`PROMPT` to its end on ``predecessor``, writing each step's blocks."""
    gpu = Gpu()
    predecessor.add_request(request("first", PROMPT, 3, lora))
    for _ in range(4):
        output = predecessor.schedule()
        gpu.run(output, where_placed(predecessor, output))
        predecessor.update_from_output(output, outputs_for(output))


def cached_after_restart(folder, kept, **successor_options) -> int:
    """How many of :data:`PROMPT`'s tokens a successor of the engine that served it finds in its cache (the index
    must be that engine's, grafted by every rank)."""
    note(kept, "b2", "b1")
    successor = scheduler(folder, **successor_options)
    successor.add_request(request("again", PROMPT, 3))
    return successor.schedule().scheduled_new_reqs[0].num_computed_tokens


def test_the_first_request_of_a_known_prefix_after_a_restart_is_served_from_the_adopted_cache(kept, model_folder):
    note(kept, "b1", None)
    serve_one_prompt(scheduler(model_folder))
    assert len(read_index(kept / "e.index").blocks) == 4
    assert cached_after_restart(model_folder, kept) == 4 * BLOCK  # from the cache


@pytest.fixture
def keep_log(caplog, monkeypatch):
    """What the keeper logs, in pytest's ``caplog`` (vLLM's loggers do not propagate to pytest's)."""
    monkeypatch.setattr(vllm_keep.log, "handlers", [caplog.handler])
    caplog.set_level(logging.INFO, logger=vllm_keep.log.name)
    return caplog


def edit_rope_theta(folder, theta: float) -> None:
    """Edit ``rope_theta`` in the model's config.json, where transformers 5 keeps it, leaving the weights alone."""
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = theta
    (folder / "config.json").write_text(json.dumps(config))


CHANGES = {
    "KV layout": (lambda folder, monkeypatch: monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "HND"), {},
                  "env.VLLM_KV_CACHE_LAYOUT"),
    "config.json": (lambda folder, monkeypatch: edit_rope_theta(folder, 20000.0), {},
                    "config.model.hf_config"),
    "--hf-overrides": (lambda folder, monkeypatch: None, {"hf_overrides": {"max_position_embeddings": 2048}},
                       "config.model.hf_config"),
    "KV dtype": (lambda folder, monkeypatch: None, {"cache_dtype": "fp8"}, "config.cache.cache_dtype"),
    "weights": (lambda folder, monkeypatch: (folder / "extra.pt").write_bytes(b"other weights"), {},
                "weights.extra.pt"),
    "hash seed": (lambda folder, monkeypatch: monkeypatch.setenv("PYTHONHASHSEED", "7"), {}, "prefix.none_hash"),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_successor_of_an_engine_whose_kv_anything_else_decided_starts_cold_naming_what_changed(
        kept, tmp_path, keep_log, monkeypatch, change):
    from transformers import LlamaConfig

    folder = tmp_path / "model"
    LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=1024).save_pretrained(folder)
    note(kept, "b1", None)
    serve_one_prompt(scheduler(folder))
    left = (kept / "e.index").read_bytes()
    assert cached_after_restart(folder, kept) == 4 * BLOCK  # unchanged: adopted
    (kept / "e.index").write_bytes(left)
    make, options, field = CHANGES[change]
    make(folder, monkeypatch)
    if change == "hash seed":
        from vllm.v1.core.kv_cache_utils import init_none_hash

        monkeypatch.setattr(vllm_prefix, "compatibility", compatibility_seeded(init_none_hash))
    assert cached_after_restart(folder, kept, **options) == 0
    assert f"the predecessor's cache differs in {field}" in keep_log.text or \
        f", {field}" in keep_log.text.split("differs in", 1)[1], keep_log.text


def test_a_hub_models_weights_are_the_snapshot_its_revision_resolves_to_and_weights_from_a_uri_are_not_kept(
        tmp_path, monkeypatch):
    """A hub model keyed by its id (revision None) moves when its main branch does: the files read are another
    snapshot's. A GGUF file is its own identity; a URI has none hbmd can see."""
    import huggingface_hub.constants

    repo = tmp_path / "hub" / "models--org--tiny"
    for revision, weights in (("a" * 40, b"old weights"), ("b" * 40, b"new weights")):
        (repo / "snapshots" / revision).mkdir(parents=True)
        (repo / "snapshots" / revision / "model.safetensors").write_bytes(weights)
    (repo / "refs").mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    hub = types.SimpleNamespace(model="org/tiny", model_weights="", revision=None)
    (repo / "refs" / "main").write_text("a" * 40)
    before = vllm_prefix.weights_identity(hub)
    assert before["weights_dir"].endswith("a" * 40)
    (repo / "refs" / "main").write_text("b" * 40)  # the branch moved: a restart reads other files
    assert vllm_prefix.weights_identity(hub) != before
    with pytest.raises(vllm_keep.KeepingOff, match="not in the local Hugging Face cache"):
        vllm_prefix.weights_identity(types.SimpleNamespace(model="org/absent", model_weights="", revision=None))
    with pytest.raises(vllm_keep.KeepingOff, match="cannot tell from another version"):
        vllm_prefix.weights_identity(types.SimpleNamespace(model="s3://bucket/model", model_weights="", revision=None))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"gguf")
    identity = vllm_prefix.weights_identity(types.SimpleNamespace(model=str(gguf), model_weights="", revision=None))
    assert [entry["name"] for entry in identity["weights_files"]] == ["model.gguf"]
    gguf.write_bytes(b"gguf, requantized")
    assert vllm_prefix.weights_identity(types.SimpleNamespace(model=str(gguf), model_weights="", revision=None)) \
        != identity


def compatibility_seeded(init_none_hash):
    """The key, with vLLM's prefix hash seed made as an engine started with PYTHONHASHSEED set makes it."""
    compatibility = vllm_prefix.compatibility

    def seeded(*args):
        init_none_hash(get_hash_fn_by_name("sha256"))
        return compatibility(*args)

    return seeded


def test_a_weight_update_in_place_withdraws_the_kept_index_and_its_successor_starts_cold_saying_so(
        kept, model_folder, keep_log, monkeypatch):
    note(kept, "b1", None)
    serve_one_prompt(scheduler(model_folder))
    monkeypatch.setattr(vllm_keep, "_rank", vllm_keep.KeptRank(vllm_keep.Scope("e", 0), 0, "b1", "GPU-0-0", None))
    vllm_keep.weights_changed("Worker.reload_weights")  # RL weight sync: the KV computed so far is the old weights'
    assert cached_after_restart(model_folder, kept) == 0
    assert "withdrew its index: the weights were changed in place (Worker.reload_weights)" in keep_log.text


def test_an_engine_whose_weights_changed_before_its_first_step_keeps_no_index(kept, model_folder, keep_log):
    note(kept, "b1", None)
    note_of = json.loads((kept / "e.rank0.json").read_text())
    (kept / "e.rank0.json").write_text(json.dumps(note_of | {"weights_changed": "the weights were changed in place"}))
    serve_one_prompt(scheduler(model_folder))
    assert not (kept / "e.index").exists()
    assert "cannot keep this engine's prefix cache: rank 0: the weights were changed in place" in keep_log.text


def test_blocks_computed_with_a_lora_adapter_are_not_kept(kept, model_folder):
    """vLLM hashes a LoRA's blocks with the adapter's name and path, not its bytes: an adapter changed under the
    same path would make them wrong."""
    note(kept, "b1", None)
    serve_one_prompt(scheduler(model_folder, lora=True), LoRARequest("adapter", 1, "/adapters/a"))
    assert read_index(kept / "e.index").blocks == {}
    serve_one_prompt(scheduler(model_folder, lora=True))
    assert len(read_index(kept / "e.index").blocks) == 4


def test_a_successor_of_another_buffer_or_one_whose_rank_could_not_graft_starts_cold_and_says_why(
        kept, model_folder, keep_log):
    note(kept, "b1", None)
    serve_one_prompt(scheduler(model_folder))
    left = (kept / "e.index").read_bytes()
    note(kept, "b2", "b99")  # the worker grafted some other buffer than the one the index describes
    cold = scheduler(model_folder)
    cold.schedule()
    assert adopted_by(cold) == {}
    assert "the buffers grafted are not the ones the index describes" in keep_log.text
    (kept / "e.index").write_bytes(left)
    note(kept, "b3", None, why_cold="the daemon refused to graft b1: over budget")
    cold = scheduler(model_folder)
    cold.schedule()
    assert adopted_by(cold) == {}
    assert "no kept prefix cache adopted (the daemon refused to graft b1: over budget)" in keep_log.text


def test_a_tensor_parallel_successor_adopts_when_every_rank_grafted_its_predecessors_buffer_and_else_none(
        kept, model_folder, keep_log):
    note(kept, "b1", None, rank=0)
    note(kept, "b11", None, rank=1)
    serve_one_prompt(scheduler(model_folder, tensor_parallel=2))
    index = read_index(kept / "e.index")
    assert index.header["ranks"] == [{"buffer": "b1", "gpu": "GPU-0-0"}, {"buffer": "b11", "gpu": "GPU-0-1"}]
    assert len(index.blocks) == 4
    left = (kept / "e.index").read_bytes()

    def successor_cached(rank1_adopted_from: str | None) -> int:
        note(kept, "b2", "b1", rank=0)
        note(kept, "b12", rank1_adopted_from, rank=1, why_cold="it found no buffer to adopt")
        (kept / "e.index").write_bytes(left)  # each successor below finds what the predecessor left
        successor = scheduler(model_folder, tensor_parallel=2)
        successor.add_request(request("again", PROMPT, 3))
        return successor.schedule().scheduled_new_reqs[0].num_computed_tokens

    assert successor_cached(None) == 0  # rank 1 started on a buffer of its own
    assert "rank 1: it found no buffer to adopt" in keep_log.text
    assert successor_cached("b13") == 0  # rank 1 grafted some other buffer
    assert "the buffers grafted are not the ones the index describes" in keep_log.text
    assert successor_cached("b11") == 4 * BLOCK  # every rank grafted its predecessor's buffer
    (kept / "e.rank1.json").unlink()  # a rank that wrote no note keeps nothing: no index for any rank
    successor = scheduler(model_folder, tensor_parallel=2)
    successor.schedule()
    assert "rank 1 of this engine left no note of its kept buffer" in keep_log.text


def test_a_worker_knows_its_rank_and_replica_as_vllm_numbers_them_not_from_the_environment(monkeypatch):
    from vllm.config import set_current_vllm_config

    monkeypatch.setenv("RANK", "5")
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    config.parallel_config.rank = 1
    config.parallel_config.data_parallel_index = 2
    assert vllm_keep.worker_place() == (0, 0)  # outside a worker
    with set_current_vllm_config(config):
        assert vllm_keep.worker_place() == (2, 1)
        assert plugin.buffer_name() == f"vllm-{plugin.engine()}-rank1-dp2"


KV_WORKER = """
import sys
import torch
from hbmd.integrations import vllm as plugin
from vllm.v1.worker import extensible_kv_cache as vllm_cache
from test_vllm import FULL, PAGE, planned
from vllm.v1.kv_cache_interface import KVCacheGroupSpec

vllm_cache.ExtensibleTensor = plugin.hbmd_or_own(vllm_cache.ExtensibleTensor)
layout, config = planned("LBHNC", [KVCacheGroupSpec([f"layers.{i}.attn" for i in range(4)], FULL)], 4 * PAGE * 600)
kv = vllm_cache.ExtensibleKVCache(config, torch.device("cpu"), layout)
kv.allocate(kv.size)
"""
"""A worker process's KV cache of four layers, as vLLM's makes it with the plugin on: what the scripts below run."""

PREDECESSOR = KV_WORKER + """
kv.commit(300)
for segment in range(len(kv.segment_strides)):
    stride = kv.segment_strides[segment]
    view = kv.buffer.segment_view(segment)
    for block in range(1, 300):
        view[block * stride : (block + 1) * stride] = block % 250 + 1
print(kv.buffer.name, flush=True)
sys.stdin.readline()
kv.free()  # a clean stop: vLLM frees its cache, which a keeping engine lets go of instead
"""


def kill_a_predecessor(daemon, kept) -> str:
    """Run :data:`PREDECESSOR` (an engine's worker whose KV cache holds 300 blocks of known bytes) and SIGKILL it,
    its index describing that cache as its scheduler's would: the name of the cache it left."""
    predecessor = LineProcess(["-c", PREDECESSOR], env={
        "HBMD_RUN_DIR": str(daemon.run_dir), "PYTHONPATH": str(Path(__file__).parent), vllm_keep.KEEP: "1",
        vllm_keep.ENGINE: "e", vllm_keep.INDEX_DIR: str(kept)})
    try:
        donor = predecessor.readline(timeout=120).strip()
    finally:
        predecessor.kill()  # an engine killed: its persistent buffer stays, an orphan
    kv_index.IndexWriter(kept / "e.index", {"key": {}, "ranks": [{"buffer": donor, "gpu": "host"}]}).close()
    with daemon.connect(observer=True) as observer:
        wait_until(lambda: [b.session_id for b in observer.buffers(name=donor)] == [0])
    return donor


@pytest.fixture
def keeping_cache(kept, monkeypatch):
    """vLLM's KV cache module as the plugin sets it up for a keeping engine (on the daemon of ``HBMD_RUN_DIR``)."""
    from hbmd.integrations import vllm as plugin
    from vllm.v1.worker import extensible_kv_cache as vllm_cache

    monkeypatch.setattr(vllm_keep, "_rank", None)
    monkeypatch.setattr(vllm_cache, "ExtensibleTensor", plugin.hbmd_or_own(vllm_cache.ExtensibleTensor))
    monkeypatch.setattr(vllm_cache.ExtensibleKVCache, "commit", plugin.refusal_explained(
        vllm_cache.ExtensibleKVCache.commit))
    return vllm_cache


def four_layers_of(vllm_cache, blocks: int = 600):
    from test_vllm import FULL, PAGE, planned
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    layout, config = planned("LBHNC", [KVCacheGroupSpec([f"layers.{i}.attn" for i in range(4)], FULL)],
                             4 * PAGE * blocks)
    return vllm_cache.ExtensibleKVCache(config, torch.device("cpu"), layout), config


@pytest.mark.parametrize("capacity", [600, 800], ids=["same reservation", "a longer one"])
def test_a_successor_grafts_its_predecessors_blocks_in_place_of_its_warm_ups_and_counts_them(
        kept, daemon, keeping_cache, monkeypatch, capacity):
    """``capacity``: the successor's reservation in blocks, the predecessor's 600 or (its profiled memory moved, as
    CUDA graphs make it) 800, where each layer's segment is 8 MiB, not 6, and lies elsewhere."""
    monkeypatch.setenv("HBMD_RUN_DIR", str(daemon.run_dir))
    donor = kill_a_predecessor(daemon, kept)
    observer = daemon.connect(observer=True)
    kv, config = four_layers_of(keeping_cache, capacity)
    assert vllm_keep.Scope("e", 0).kept_name(0, kv.buffer.name) and kv.buffer.name != donor and kv.buffer.persistent
    base = kv.allocate(kv.size).data_ptr()
    kv.commit(50)  # warm-up: its garbage in the blocks the predecessor's cache holds
    for segment in range(len(kv.segment_strides)):
        kv.buffer.segment_view(segment)[: 50 * kv.segment_strides[segment]] = 0xEE
    measured = vllm_keep.counting_kept_blocks(lambda cache: 300)(kv)
    # What vLLM measured beside the orphan, and the orphan, which becomes this engine's, less room for the next
    # engine's warm-up: what this one's committed and a tenth more, in whole granules per segment as the daemon
    # charges them (55 blocks of 8 KiB: a granule of 2 MiB in each of 4 segments).
    assert kv.physical_bytes_for(measured) == kv.physical_bytes_for(600) - 4 * 2 * MiB and measured == 512
    # Short of room for the next warm-up beside the orphan (the budget's rounding to whole chunks): sized at the
    # orphan, whose memory is held already, not below it, which would leave nothing adopted.
    assert vllm_keep.counting_kept_blocks(lambda cache: 52)(kv) == 300
    runner = types.SimpleNamespace(extensible_kv_cache=kv, vllm_config=VllmConfig(device_config=DeviceConfig("cpu")),
                                   get_model=lambda: types.SimpleNamespace())
    vllm_keep.grafting(lambda runner, config, blocks: runner.extensible_kv_cache.commit(blocks, shrink=True))(
        runner, config, measured)

    assert kv.num_committed_blocks == measured and kv.buffer.base_ptr == base
    for segment in range(len(kv.segment_strides)):
        stride, view = kv.segment_strides[segment], kv.buffer.segment_view(segment)
        assert all(filled(view[b * stride : (b + 1) * stride], b % 250 + 1) for b in range(1, 300)), segment
        assert filled(view[300 * stride : measured * stride], 0)  # grown past the graft: vLLM's zeroed blocks
    (mine,) = observer.buffers(name=kv.buffer.name)
    assert observer.buffers(name=donor) == [] and mine.physical_bytes == kv.physical_bytes
    note = json.loads((kept / "e.rank0.json").read_text())
    assert note == {"buffer": kv.buffer.name, "gpu": "host", "adopted_from": donor, "adopted_blocks": 300,
                    "why_cold": "", "weights_changed": "", "pid": os.getpid()}
    assert mine.keep_orphan_s == vllm_keep.DEFAULT_GRACE_S
    kv.free()  # as vLLM's model runner frees it when the engine stops: a keeping engine's cache stays, for the next
    wait_until(lambda: [(b.session_id, b.physical_bytes) for b in observer.buffers(name=mine.name)]
               == [(0, mine.physical_bytes)])


@pytest.mark.parametrize("budget", ["8MiB", "12MiB"])
def test_a_kept_cache_that_leaves_the_successor_no_room_to_warm_up_is_freed_and_the_engine_starts_cold(
        kept, start_daemon, keeping_cache, monkeypatch, keep_log, budget):
    daemon = start_daemon("--budget", budget)
    monkeypatch.setenv("HBMD_RUN_DIR", str(daemon.run_dir))
    with daemon.connect() as gone:  # an engine that kept what the budget held, 2 MiB in each of its 4 segments
        from hbmd.client import ExtensibleTensor

        kv, _ = four_layers_of(keeping_cache)
        left = ExtensibleTensor(kv.size, "cpu", segment_capacities=kv.buffer.segment_capacities, client=gone,
                                name="vllm-e-rank0.00000000000a", persistent=True)
        left.resize_segments_([2 * MiB] * 4)
        kv.free()
    kv_index.IndexWriter(kept / "e.index", {"key": {}, "ranks": [{"buffer": left.name, "gpu": "host"}]}).close()
    kv, _ = four_layers_of(keeping_cache)
    kv.allocate(kv.size)  # vLLM's first commit: refused beside the kept cache, then done once it is freed
    assert kv.num_committed_blocks == kv.min_committed_blocks and kv.physical_bytes > 0
    assert vllm_keep._rank.donor is None and "leaves too little of the budget for this engine's warm-up" in \
        keep_log.text
    with daemon.connect(observer=True) as observer:
        assert [b.name for b in observer.buffers()] == [kv.buffer.name]
    kv.free()


def test_an_index_that_cannot_be_written_goes_and_the_engine_serves_on(kept, model_folder, monkeypatch):
    note(kept, "b1", None)
    engine = scheduler(model_folder)
    engine.add_request(request("first", list(range(1, 70)), 3))
    output = engine.schedule()
    engine.update_from_output(output, outputs_for(output))
    assert read_index(kept / "e.index").blocks  # published

    def full(fd, data, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("hbmd.integrations.kv_index.os.pwrite", full)
    for step in range(3):  # the engine goes on scheduling; its index is gone, not left stale
        engine.add_request(request(f"more{step}", list(range(100 * step + 100, 100 * step + 140)), 2))
        output = engine.schedule()
        engine.update_from_output(output, outputs_for(output))
    assert not (kept / "e.index").exists()


def test_an_index_folder_another_user_made_first_keeps_nothing_and_stops_nothing(kept, model_folder, keep_log):
    kept.mkdir(mode=0o755)
    try:
        os.chown(kept, 65534, 65534)
    except PermissionError:
        pytest.skip("only root can give a folder to another user")
    engine = scheduler(model_folder)
    serve_one_prompt(engine)
    assert "belongs to uid 65534" in keep_log.text and list(kept.iterdir()) == []


def test_a_kept_cache_of_another_layout_is_freed_before_vllm_measures_and_the_engine_starts_cold(kept, monkeypatch):
    donor = vllm_keep.Donor("vllm-e-rank0.00000000000a", [4 << 20] * 12, [2 << 20] * 12, 24 << 20, held=False)
    monkeypatch.setattr(vllm_keep, "_rank", vllm_keep.KeptRank(vllm_keep.Scope("e", 0), 0, "n", "host", donor))
    freed = []
    daemon = types.SimpleNamespace(delete=freed.append)
    assert vllm_keep.settle_donor(daemon, [8 << 20] * 4) is None  # another model under the engine's name: no graft
    assert vllm_keep._rank.donor is None and "laid out for another model" in vllm_keep._rank.why_cold
    assert freed == [donor.name]  # its memory is free again when vLLM measures what it has


def test_a_fault_of_the_keeper_at_start_leaves_the_engine_serving_and_keeping_nothing(
        kept, model_folder, keep_log, monkeypatch):
    note(kept, "b1", None)

    def broken(*args):
        raise RuntimeError("a vLLM config hbmd did not foresee")

    monkeypatch.setattr(vllm_prefix, "compatibility", broken)
    serve_one_prompt(scheduler(model_folder))  # every step scheduled and processed
    assert not (kept / "e.index").exists() and "prefix keeper could not start" in keep_log.text


def test_the_plugin_keeps_through_the_scheduler_class_vllm_chooses_and_leaves_vllms_classes_as_they_are(tmp_path):
    """vLLM's engine core builds whichever class ``SchedulerConfig.get_scheduler_cls`` chooses: with the plugin on,
    the keeping subclass of the one vLLM picks (plain, asynchronous, or the operator's ``scheduler_cls``), while
    vLLM's own scheduler classes keep their methods."""
    code = (
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vllm.config import SchedulerConfig\n"
        "from vllm.v1.core.sched.async_scheduler import AsyncScheduler\n"
        "from vllm.v1.core.sched.scheduler import Scheduler\n"
        "picked = {}\n"
        "for name, options in [('plain', {}), ('async', {'async_scheduling': True}),\n"
        "                      ('named', {'scheduler_cls': 'vllm.v1.core.sched.async_scheduler.AsyncScheduler'})]:\n"
        "    chosen = SchedulerConfig.default_factory(**options).get_scheduler_cls()\n"
        "    picked[name] = [c.__name__ for c in chosen.__mro__[:2]]\n"
        "print(picked)\n"
        "print([hasattr(c.__dict__[m], '__wrapped__') for c in (Scheduler, AsyncScheduler)\n"
        "       for m in ('schedule', 'update_from_output') if m in c.__dict__])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"} | {
        "HBMD_VLLM": "1", vllm_keep.KEEP: "1", "HBMD_VLLM_ENGINE": "e", vllm_keep.INDEX_DIR: str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    picked, wrapped = out.stdout.strip().splitlines()[-2:]
    assert picked == str({"plain": ["KeepingScheduler", "Scheduler"],
                          "async": ["KeepingAsyncScheduler", "AsyncScheduler"],
                          "named": ["KeepingAsyncScheduler", "AsyncScheduler"]})
    assert wrapped == str([False, False])
