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
import random
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM is not installed")
from hbmd.integrations import kv_index, vllm_keep, vllm_prefix  # noqa: E402
from hbmd.integrations.kv_index import read_index  # noqa: E402
from hbmd.testing.spawn import LineProcess  # noqa: E402
from helpers import filled, wait_until  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_block_hash, get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.ipc]

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
    if not hasattr(Scheduler.schedule, "__wrapped__"):
        monkeypatch.setattr(Scheduler, "schedule", Scheduler.schedule)
        monkeypatch.setattr(Scheduler, "update_from_output", Scheduler.update_from_output)
        vllm_prefix.keeping_scheduler(Scheduler)
    return tmp_path / "index"


def scheduler(folder, salt: str = "", kind: type[Scheduler] = Scheduler, tensor_parallel: int = 1) -> Scheduler:
    model = ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype="float32", max_model_len=1024)
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    cache.num_gpu_blocks = NUM_BLOCKS
    config = VllmConfig(model_config=model, cache_config=cache, device_config=DeviceConfig(device="cpu"),
                        load_config=LoadConfig(load_format="auto"),
                        parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel),
                        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=1024,
                                                         is_encoder_decoder=False))
    size = NUM_BLOCKS * SPEC.page_size_bytes
    kv = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_groups=[KVCacheGroupSpec(["l0"], SPEC)],
                       kv_cache_tensors=[KVCacheTensor(size=size, layers=["l0"], layer_stride=size,
                                                       block_stride=SPEC.page_size_bytes)])
    init_none_hash(get_hash_fn_by_name("sha256"))
    return kind(vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
                block_size=BLOCK, log_stats=False)


def note(folder, buffer_id: int, adopted_from: int | None, rank: int = 0) -> None:
    folder.mkdir(exist_ok=True)
    (folder / f"e.rank{rank}.json").write_text(json.dumps({"buffer_id": buffer_id, "adopted_from": adopted_from,
                                                     "adopted_blocks": NUM_BLOCKS}))


HASHER = get_request_block_hasher(BLOCK, get_hash_fn_by_name("sha256"))


def request(name: str, tokens: list[int], max_tokens: int) -> Request:
    return Request(name, tokens, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), None,
                   block_hasher=HASHER)


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
    adopted_total = 0
    for trial in range(40):
        note(kept, 100 + trial, None)
        gpu = Gpu()
        predecessor = scheduler(model_folder, kind=kind)
        drive(predecessor, gpu, rng, rng.randrange(2, 60), rng.choice(("scheduled", "ran", "processed")))
        note(kept, 200 + trial, 100 + trial)
        successor = scheduler(model_folder)
        successor.schedule()  # the index is adopted at the first step
        pool = successor.kv_cache_manager.block_pool
        adopted = {block.block_id: block.block_hash for block in pool.blocks if block.block_hash is not None}
        assert all(gpu.holds(block_id, block_hash) for block_id, block_hash in adopted.items()), trial
        adopted_total += len(adopted)
    assert adopted_total > 100  # the check above ran on many blocks, not on none
    assert len(rewrites) > 20 if rewrite else not rewrites, len(rewrites)


PROMPT = list(range(1, 70))
"""69 tokens: four full blocks."""


def serve_one_prompt(predecessor: Scheduler) -> None:
    """Run :data:`PROMPT` to its end on ``predecessor``, writing each step's blocks."""
    gpu = Gpu()
    predecessor.add_request(request("first", PROMPT, 3))
    for _ in range(4):
        output = predecessor.schedule()
        gpu.run(output, where_placed(predecessor, output))
        predecessor.update_from_output(output, outputs_for(output))


def test_the_first_request_of_a_known_prefix_after_a_restart_is_served_from_the_adopted_cache(kept, model_folder):
    note(kept, 1, None)
    serve_one_prompt(scheduler(model_folder))
    assert len(read_index(kept / "e.index").blocks) == 4
    note(kept, 2, 1)
    successor = scheduler(model_folder)
    successor.add_request(request("again", PROMPT, 3))
    scheduled = successor.schedule().scheduled_new_reqs
    assert [(r.req_id, r.num_computed_tokens) for r in scheduled] == [("again", 4 * BLOCK)]  # from the cache


@pytest.fixture
def keep_log(caplog, monkeypatch):
    """What the keeper logs, in pytest's ``caplog`` (vLLM's loggers do not propagate to pytest's)."""
    monkeypatch.setattr(vllm_keep.log, "handlers", [caplog.handler])
    caplog.set_level(logging.INFO, logger=vllm_keep.log.name)
    return caplog


def test_a_successor_of_another_model_or_another_buffer_starts_cold_and_says_why(kept, model_folder, keep_log):
    note(kept, 1, None)
    predecessor = scheduler(model_folder)
    predecessor.add_request(request("first", list(range(1, 70)), 2))
    for _ in range(3):
        output = predecessor.schedule()
        predecessor.update_from_output(output, outputs_for(output))
    note(kept, 2, 99)  # the worker grafted some other buffer than the one the index describes
    cold = scheduler(model_folder)
    cold.schedule()
    assert not any(block.block_hash is not None for block in cold.kv_cache_manager.block_pool.blocks)
    assert "the buffers grafted are not the ones the index describes" in keep_log.text
    note(kept, 3, 2)
    (model_folder / "extra.pt").write_bytes(b"other weights")
    try:
        other = scheduler(model_folder)
        other.schedule()
    finally:
        (model_folder / "extra.pt").unlink()
    assert not any(block.block_hash is not None for block in other.kv_cache_manager.block_pool.blocks)
    assert "the predecessor's cache differs in weights" in keep_log.text


def test_a_tensor_parallel_successor_adopts_when_every_rank_grafted_its_predecessors_buffer_and_else_none(
        kept, model_folder, keep_log):
    note(kept, 1, None, rank=0)
    note(kept, 11, None, rank=1)
    serve_one_prompt(scheduler(model_folder, tensor_parallel=2))
    index = read_index(kept / "e.index")
    assert index.header["buffers"] == [1, 11] and len(index.blocks) == 4
    left = (kept / "e.index").read_bytes()

    def successor_cached(rank1_adopted_from: int | None) -> int:
        note(kept, 2, 1, rank=0)
        note(kept, 12, rank1_adopted_from, rank=1)
        (kept / "e.index").write_bytes(left)  # each successor below finds what the predecessor left
        successor = scheduler(model_folder, tensor_parallel=2)
        successor.add_request(request("again", PROMPT, 3))
        return successor.schedule().scheduled_new_reqs[0].num_computed_tokens

    assert successor_cached(None) == 0  # rank 1 started on a buffer of its own
    assert "not every rank adopted its predecessor's buffer" in keep_log.text
    assert successor_cached(13) == 0  # rank 1 grafted some other buffer
    assert "the buffers grafted are not the ones the index describes" in keep_log.text
    assert successor_cached(11) == 4 * BLOCK  # every rank grafted its predecessor's buffer


PREDECESSOR = """
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
kv.commit(300)
for segment in range(len(kv.segment_strides)):
    stride = kv.segment_strides[segment]
    view = kv.buffer.segment_view(segment)
    for block in range(1, 300):
        view[block * stride : (block + 1) * stride] = block % 250 + 1
print(kv.buffer.buffer_id, flush=True)
sys.stdin.readline()
"""


def test_a_successor_grafts_its_predecessors_blocks_in_place_of_its_warm_ups_and_counts_them(
        kept, daemon, monkeypatch):
    from hbmd.integrations import vllm as plugin
    from test_vllm import FULL, PAGE, planned
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec
    from vllm.v1.worker import extensible_kv_cache as vllm_cache

    monkeypatch.setenv("HBMD_RUN_DIR", str(daemon.run_dir))
    monkeypatch.setattr(vllm_cache, "ExtensibleTensor", plugin.hbmd_or_own(vllm_cache.ExtensibleTensor))
    predecessor = LineProcess(["-c", PREDECESSOR], env={"HBMD_RUN_DIR": str(daemon.run_dir),
                                                        "PYTHONPATH": str(Path(__file__).parent)})
    try:
        donor_id = int(predecessor.readline(timeout=120))
    finally:
        predecessor.kill()  # an engine killed: its persistent buffer stays, an orphan
    observer = daemon.connect(observer=True)
    wait_until(lambda: [b.session_id for b in observer.buffers(name="vllm-e-rank0")] == [0])

    layout, config = planned("LBHNC", [KVCacheGroupSpec([f"layers.{i}.attn" for i in range(4)], FULL)], 4 * PAGE * 600)
    kv = vllm_cache.ExtensibleKVCache(config, torch.device("cpu"), layout)
    assert kv.buffer.name == "vllm-e-rank0.b" and kv.buffer.persistent
    base = kv.allocate(kv.size).data_ptr()
    kv.commit(50)  # warm-up: its garbage in the blocks the predecessor's cache holds
    for segment in range(len(kv.segment_strides)):
        kv.buffer.segment_view(segment)[: 50 * kv.segment_strides[segment]] = 0xEE
    measured = vllm_keep.counting_kept_blocks(lambda cache: 80)(kv)
    # What vLLM measured beside the orphan, and the orphan, which becomes this engine's, less room for the next
    # engine's warm-up: what this one's committed, and a tenth more.
    assert measured == 80 + 300 - (50 + 5)
    # Short of room for the next warm-up beside the orphan (the budget's rounding to whole chunks): sized at the
    # orphan, whose memory is held already, not below it, which would leave nothing adopted.
    assert vllm_keep.counting_kept_blocks(lambda cache: 52)(kv) == 300
    runner = types.SimpleNamespace(extensible_kv_cache=kv, vllm_config=VllmConfig(device_config=DeviceConfig("cpu")))
    vllm_keep.grafting(lambda runner, config, blocks: runner.extensible_kv_cache.commit(blocks, shrink=True))(
        runner, config, measured)

    assert kv.num_committed_blocks == measured and kv.buffer.base_ptr == base
    for segment in range(len(kv.segment_strides)):
        stride, view = kv.segment_strides[segment], kv.buffer.segment_view(segment)
        assert all(filled(view[b * stride : (b + 1) * stride], b % 250 + 1) for b in range(1, 300)), segment
        assert filled(view[300 * stride : measured * stride], 0)  # grown past the graft: vLLM's zeroed blocks
    (mine,) = observer.buffers(name="vllm-e-rank0.b")
    assert observer.buffers(name="vllm-e-rank0") == [] and mine.physical_bytes == kv.physical_bytes
    note = json.loads((kept / "e.rank0.json").read_text())
    assert note["adopted_from"] == donor_id and note["adopted_blocks"] == 300 and note["buffer_id"] == mine.buffer_id
    assert mine.keep_orphan_s == vllm_keep.DEFAULT_GRACE_S
    kv.free()  # as vLLM's model runner frees it when the engine stops: a keeping engine's cache stays, for the next
    wait_until(lambda: [(b.session_id, b.physical_bytes) for b in observer.buffers(name="vllm-e-rank0.b")]
               == [(0, mine.physical_bytes)])
    with daemon.connect() as following:
        rank = vllm_keep.choose_names(following, "vllm-e-rank0", 0)
    assert rank.name == "vllm-e-rank0" and rank.donor is not None and rank.donor.name == "vllm-e-rank0.b"


def test_an_index_that_cannot_be_written_goes_and_the_engine_serves_on(kept, model_folder, monkeypatch):
    note(kept, 1, None)
    engine = scheduler(model_folder)
    engine.add_request(request("first", list(range(1, 70)), 3))
    output = engine.schedule()
    engine.update_from_output(output, outputs_for(output))
    assert read_index(kept / "e.index").blocks  # published

    def full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("hbmd.integrations.kv_index.os.write", full)
    for step in range(3):  # the engine goes on scheduling; its index is gone, not left stale
        engine.add_request(request(f"more{step}", list(range(100 * step + 100, 100 * step + 140)), 2))
        output = engine.schedule()
        engine.update_from_output(output, outputs_for(output))
    assert not (kept / "e.index").exists()


def test_a_kept_cache_of_another_layout_is_left_alone_and_the_engine_starts_cold(kept, monkeypatch):
    donor = vllm_keep.Donor("vllm-e-rank0", 7, [4 << 20] * 12, [2 << 20] * 12, 24 << 20, held=False)
    monkeypatch.setattr(vllm_keep, "_rank", vllm_keep.KeptRank(0, "vllm-e-rank0.b", donor))
    assert vllm_keep.settle_donor(None, [8 << 20] * 4) is None  # another model under the engine's name: no graft
    assert vllm_keep._rank.donor is None
