"""Warm standbys taking over a busy vLLM engine killed anywhere, round after round, on vLLM 0.34's own scheduler,
block pool and extensible KV cache on the host backend.

Each engine is one process holding both halves a real one holds: its KV cache (hbmd's buffer, four layers), which
stands by, waits for the active engine's end and grafts its pages; and vLLM's scheduler, built after the graft, whose
first step adopts the kept prefix index. The model's forward pass is stood in for by writes into the real KV buffer
that make each block name its own prefix: per slot and layer, the token and the hash of the block before (vLLM's hash
chain). A successor checks every block it adopted against the hash it adopted it under, before serving; the active
engine is killed at a random point of a random workload (scheduling, writing, processing the output, flushing the
index), as a crash kills it.

Needs vLLM 0.34 installed (integrations/README.md); skipped elsewhere.
"""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM is not installed")
from hbmd.integrations import vllm_keep, vllm_prefix
from hbmd.testing.spawn import LineProcess
from helpers import torch, wait_until
from test_vllm_keep import (  # noqa: F401
    BLOCK,
    KV_WORKER,
    NUM_BLOCKS,
    adopted_by,
    kept,
    model_folder,
    outputs_for,
    request,
    scheduler,
    where_placed,
)
from test_vllm_standby import engine_env, line_is_free, take_over
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import get_block_hash, hash_block_tokens

pytestmark = [pytest.mark.vllm, pytest.mark.ipc, pytest.mark.torch]

ROUNDS = 10
"""Takeovers: each kills the active engine and checks what its standby adopted."""
AHEAD = 2
"""Standbys started before they are needed: each imports vLLM for seconds, while the rounds before it run."""
SERVE_S = (0.1, 0.8)
"""How long an active engine serves before it is killed: hundreds of steps."""
WARM_UP_BLOCKS = 50
SHA256 = get_hash_fn_by_name("sha256")
HASH = 32
"""The bytes of a block hash (sha256), the parent's in each slot's record."""
RECORD = HASH + 8
"""What the stand-in forward pass writes per slot and layer: the hash of the block before the slot's, and its token."""
PREFIXES = [[random.Random(prefix).randrange(1, 1000) for _ in range(length)]
            for prefix, length in enumerate((20, 40, 70))]
"""The prompts' shared beginnings, the same in every engine: a successor serves them from the blocks it adopted."""

ENGINE = KV_WORKER + """
from test_vllm_standby_loop import engine
engine(kv, config, sys.argv[1])
"""
"""An engine's process: its KV cache made as vLLM's is with the plugin on, then :func:`engine`."""


class Layers:
    """The KV cache's blocks as the stand-in forward pass writes them: per layer, block and slot, a :data:`RECORD`."""

    def __init__(self, kv) -> None:
        self.layers = [kv.buffer.segment_view(segment)[: NUM_BLOCKS * stride].view(NUM_BLOCKS, BLOCK, -1)
                       for segment, stride in enumerate(kv.segment_strides)]

    def write(self, output, placed: dict[str, tuple]) -> None:
        """What the step of ``output`` computes, in every layer: per slot, its token and the hash of the block before
        its block (``placed``: :func:`where_placed`). A step may write part of a block, a slot at a time."""
        for req_id, count in output.num_scheduled_tokens.items():
            req, start, blocks = placed[req_id]
            end = start + count
            for index in range(start // BLOCK, (end - 1) // BLOCK + 1):
                first, last = max(start, index * BLOCK), min(end, (index + 1) * BLOCK)
                parent = req.block_hashes[index - 1] if index else kv_cache_utils.NONE_HASH
                records = b"".join(parent + token.to_bytes(RECORD - HASH, "little")
                                   for token in req.all_token_ids[first:last])
                slots = torch.frombuffer(bytearray(records), dtype=torch.uint8).view(last - first, RECORD)
                for layer in self.layers:
                    layer[blocks[index].block_id, first % BLOCK : first % BLOCK + len(slots), :RECORD] = slots

    def holds(self, block_id: int, block_hash: bytes) -> bool:
        """Whether every layer of block ``block_id`` holds the KV of the prefix ``block_hash`` names: one parent
        in all its slots, which with their tokens hashes to it."""
        for layer in self.layers:
            records = bytes(layer[block_id, :, :RECORD].flatten().tolist())
            parents = {records[at : at + HASH] for at in range(0, len(records), RECORD)}
            tokens = [int.from_bytes(records[at + HASH : at + RECORD], "little")
                      for at in range(0, len(records), RECORD)]
            if len(parents) != 1 or hash_block_tokens(SHA256, parents.pop(), tokens) != get_block_hash(block_hash):
                return False
        return True


def engine(kv, kv_cache_config, model: str) -> None:
    """Run in an engine's process (:data:`ENGINE`): warm up, stand by until no other engine runs, graft its cache,
    build the scheduler, check every block it adopted and print that as JSON; then, at ``serve SEED`` on stdin,
    serve random requests until killed."""
    kv.commit(WARM_UP_BLOCKS)
    for segment, stride in enumerate(kv.segment_strides):
        kv.buffer.segment_view(segment)[: WARM_UP_BLOCKS * stride] = 0xEE  # the warm-up's garbage
    take_over(kv, kv_cache_config)
    vllm_prefix.patch_scheduler_choice()
    engine_core = scheduler(model)
    engine_core.schedule()  # the kept index is adopted at the first step
    layers = Layers(kv)
    adopted = adopted_by(engine_core)
    print(json.dumps({"took_over": kv.buffer.name, "adopted_from": vllm_keep._rank.adopted_from,
                      "adopted": len(adopted),
                      "wrong": sorted(block for block, block_hash in adopted.items()
                                      if not layers.holds(block, block_hash))}), flush=True)
    rng = random.Random(int(sys.stdin.readline().split()[1]))
    for step in itertools.count():
        if rng.random() < 0.5 or not engine_core.requests:
            tokens = rng.choice(PREFIXES) + [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 40))]
            engine_core.add_request(request(f"r{step}", tokens, rng.randrange(1, 30)))
        output = engine_core.schedule()
        layers.write(output, where_placed(engine_core, output))
        engine_core.update_from_output(output, outputs_for(output))


def serve_for(active: LineProcess, seconds: float) -> None:
    """Let ``active`` serve ``seconds``; it must still be serving at their end."""
    try:
        code = active.wait(seconds)
    except subprocess.TimeoutExpired:
        return
    raise AssertionError(f"the active engine exited with {code} while it served: {active.stderr_tail()}")


def taken_over_from(index_dir, killed: str) -> dict | None:
    """The rank's note once an engine other than ``killed`` wrote it (it took over), else None."""
    note = vllm_keep.read_note(index_dir / "e.rank0.json")
    return note if note is not None and note["buffer"] != killed else None


def test_standbys_take_over_a_busy_engine_killed_anywhere_adopting_only_blocks_that_hold_the_prefix_their_hash_names(
        kept, daemon, model_folder):
    rng = random.Random(20260)
    observer = daemon.connect(observer=True)
    started: list[LineProcess] = []

    def start() -> LineProcess:
        started.append(LineProcess(["-c", ENGINE, str(model_folder)], env=engine_env(daemon, kept, standby=True)))
        return started[-1]

    try:
        active = start()
        first = json.loads(active.readline(timeout=120))
        assert (first["adopted_from"], first["adopted"]) == (None, 0)  # it finds no engine running: it serves at once
        name = first["took_over"]
        standbys = [start() for _ in range(AHEAD)]
        adopted = []
        for round_ in range(ROUNDS):
            wait_until(lambda: not line_is_free(kept), timeout=120)  # a standby stands by at the head of the line
            active.send(f"serve {rng.randrange(1 << 30)}")
            serve_for(active, rng.uniform(*SERVE_S))
            active.kill()
            note = wait_until(lambda: taken_over_from(kept, name), timeout=60)
            (active,) = [standby for standby in standbys if standby.proc.pid == note["pid"]]
            standbys.remove(active)
            if len(started) <= ROUNDS:  # one standby per round, each started while the rounds before it run
                standbys.append(start())
            report = json.loads(active.readline(timeout=60))
            assert report == {"took_over": note["buffer"], "adopted_from": name, "adopted": report["adopted"],
                              "wrong": []}, round_
            name = note["buffer"]
            adopted.append(report["adopted"])
        print(f"blocks adopted and checked, per round: {adopted}")
        assert sum(adopted) > 10 * ROUNDS and not standbys  # the checks ran on many blocks; every standby took over
        assert [(b.name, b.session_id > 0) for b in observer.buffers()] == [(name, True)]
        active.kill()  # the last engine's cache is kept for the next, and nothing else is left
        wait_until(lambda: [(b.name, b.session_id) for b in observer.buffers()] == [(name, 0)])
    finally:
        for process in started:
            process.kill()
