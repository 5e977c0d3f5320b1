"""A serving engine over hbmd: warm-up on a small KV prefix, size the cache from what is left, serve, crash, resume.

The flow follows what a serving engine does with an extensible KV cache:

1. build the model, reserve the KV cache's whole address range and back
   only a few blocks;
2. warm up: a prefill of the longest prompt (the activation peak) and the
   decode step, which on a GPU is captured once in a CUDA graph whose block
   indices live in device tensors;
3. size the cache, to what the requests need (the default) or to a share
   of what the daemon can still give (:func:`kv_blocks_that_fit`, as vLLM's
   ``--gpu-memory-utilization`` sizes to the device), and commit it,
   defragmented, under the captured graph: the base pointers do not move,
   so the graph stays valid;
4. serve: prefill each prompt, then replay the decode step.

Each phase logs a line with its time to stderr; a decode that runs longer
than :data:`PROGRESS_EVERY_S` logs where it stands meanwhile.

The decode state (block tables, sequence lengths, tokens so far) is small
and saved after every step, so a worker killed mid-request can be replaced
by one that attaches the persistent KV buffers and carries on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from decoder import CONFIGS, Decoder, DecoderConfig
from hbmd.client import Client, kv_blocks_that_fit
from hbmd.proto.units import format_bytes
from paged_kv import BlockTables, PagedKVCache

PROGRESS_EVERY_S = 5.0
"""A decode running longer than this says where it stands this often (a user watching the terminal sees it move)."""


def log(who: str, message: str) -> None:
    print(f"[{who}] {message}", file=sys.stderr, flush=True)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_prompts(config: DecoderConfig, seed: int, batch: int, max_len: int) -> list[list[int]]:
    """``batch`` prompts of seeded random token ids, lengths between ``max_len // 2`` and ``max_len``."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, max_len // 2), max_len + 1, (batch,), generator=generator)
    return [torch.randint(0, config.vocab_size, (int(n),), generator=generator).tolist() for n in lengths]


@dataclasses.dataclass
class DecodeState:
    """Where a batch's decoding stands: all a new worker needs, with the KV buffers, to continue it.

    ``generated[i][-1]`` (also in ``last_tokens``) is the token whose K/V is
    not yet in the cache: the next decode step's input, at position
    ``seq_lens[i]``.
    """

    engine: str
    config: str
    weights_seed: int
    prompt_seed: int
    prompt_len: int
    """With ``prompt_seed``, what :func:`make_prompts` rebuilds the prompts from (they are not saved)."""
    prompt_lens: list[int]
    new_tokens: int
    batch_size: int
    """The decode batch the step was built for: the same shapes give the same kernels, hence the same tokens."""
    block_tables: list[list[int]]
    seq_lens: list[int]
    generated: list[list[int]]
    last_tokens: list[int]
    step: int
    """Decode steps done: 0 right after the prefill."""

    def save(self, path: Path) -> None:
        """Replace ``path`` atomically: a worker killed at any instant leaves the old state or the new one.

        No fsync: surviving the process's death is the point, and the page
        cache does; a machine crash takes the device memory with it anyway.
        """
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self)))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> DecodeState:
        return cls(**json.loads(path.read_text()))

    @property
    def done(self) -> bool:
        return all(len(g) >= self.new_tokens for g in self.generated)


class DecodeStep:
    """The single-token decode step of a fixed batch: captured in a CUDA graph on a GPU, eager on the CPU.

    Its inputs are static device tensors (tokens, positions, block tables)
    refilled before each replay, so the graph reads the current block
    indices without being captured again.
    """

    def __init__(self, model: Decoder, caches: list[torch.Tensor], batch_size: int, device: torch.device) -> None:
        self.model, self.caches, self.batch_size = model, caches, batch_size
        width = model.config.max_blocks_per_seq
        self.tokens = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.block_tables = torch.full((batch_size, width), BlockTables.NULL_BLOCK, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.next_tokens = self._run()  # warm-up (all rows on the null block)
        if device.type == "cuda":
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._run()
            torch.cuda.current_stream(device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.next_tokens = self._run()
            self.graph.replay()
            synchronize(device)

    def _run(self) -> torch.Tensor:
        return self.model.decode(self.tokens, self.positions, self.block_tables, self.caches)

    def __call__(self, tokens: list[int], positions: list[int], block_tables: list[list[int]]) -> list[int]:
        """Greedy next token of each of the first ``len(tokens)`` rows; the rest of the batch is padding."""
        pad = self.batch_size - len(tokens)
        self.tokens.copy_(torch.tensor(tokens + [0] * pad))
        self.positions.copy_(torch.tensor(positions + [0] * pad))
        self.block_tables.copy_(torch.tensor(block_tables))
        if self.graph is not None:
            self.graph.replay()
            out = self.next_tokens
        else:
            out = self._run()
        return out.tolist()[: len(tokens)]


@dataclasses.dataclass
class Sizing:
    """How the engine sizes its KV cache after warm-up: to ``blocks``, else to ``share`` of what fits, else to what
    its ``request`` needs."""

    blocks: int | None = None
    """A fixed size (engines compared at equal KV)."""
    share: float | None = None
    """Fraction of the blocks that fit which this engine takes: sizing to the budget, as vLLM's
    ``--gpu-memory-utilization`` sizes to the device (below 1: leave room for another engine)."""
    request: tuple[int, int] | None = None
    """The longest prompt and the new tokens per sequence: the cache holds a full decode batch of such sequences
    (:meth:`Engine.blocks_for`)."""
    margin_bytes: int = 0
    margin_fraction: float = 0.0
    tenant: str = ""

    def __post_init__(self) -> None:
        if self.blocks is None and self.share is None and self.request is None:
            raise ValueError("a KV cache is sized to a number of blocks, a share of what fits or a request")


class Engine:
    """One model, its KV cache in hbmd buffers, and a fixed decode batch."""

    def __init__(
        self,
        client: Client,
        config: DecoderConfig,
        device: torch.device,
        *,
        weights_seed: int,
        batch_size: int,
        name: str = "engine",
        persistent: bool = False,
        weights: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """``weights``: the model's state dict, used as it is (a checkpoint's, or hbmd's shared views); else drawn from
        ``weights_seed``."""
        self.client, self.config, self.device = client, config, device
        self.name, self.persistent = name, persistent
        self.batch_size = batch_size
        self.weights_seed = weights_seed
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.timings: dict[str, float] = {}
        with self._timed("build_s"):
            if weights is None:
                self.model = Decoder(config, device, self.dtype, weights_seed)
            else:
                self.model = Decoder.from_state_dict(config, device, self.dtype, weights)
        self.num_params = sum(p.numel() for p in self.model.parameters())
        log(name, f"model {config.name} ({self.num_params / 1e6:.1f}M params, {device}) built in "
                  f"{ms(self.timings['build_s'])}")
        self.cache: PagedKVCache | None = None
        self.tables: BlockTables | None = None
        self.step_fn: DecodeStep | None = None
        self.available_at_sizing: int | None = None
        self.sized_to = ""
        """How the cache got its size: what the requests need, a share of what fits, a fixed size, attached."""

    @contextlib.contextmanager
    def _timed(self, key: str):
        """Record the block's wall time under ``key``, device work included."""
        synchronize(self.device)
        start = time.perf_counter()
        yield
        synchronize(self.device)
        self.timings[key] = time.perf_counter() - start

    @property
    def bytes_per_block(self) -> int:
        return PagedKVCache.bytes_per_block(self.config, self.dtype)

    def blocks_for(self, prompt_len: int, new_tokens: int) -> int:
        """The blocks a full decode batch of sequences of up to ``prompt_len + new_tokens`` tokens needs.

        The null block included (:class:`BlockTables` never hands it out), and
        rounded up to the whole granules per segment that committing them
        takes anyway.
        """
        per_sequence = -(-(prompt_len + new_tokens) // self.config.block_size)
        needed = BlockTables.NULL_BLOCK + 1 + self.batch_size * per_sequence
        return PagedKVCache.aligned_capacity(self.config, self.dtype, needed, self.client.granularity)

    # start

    def start(self, warmup_blocks: int, sizing: Sizing) -> None:
        """Reserve the cache, warm up on ``warmup_blocks`` blocks, then commit the final size.

        The reservation spans what fits (address space costs no memory), so a
        cache sized to its requests could still grow as far as the budget.
        """
        if sizing.blocks is not None:
            wanted = sizing.blocks
        elif sizing.share is None:
            wanted = self.blocks_for(*sizing.request)
        else:
            wanted = 0
        capacity = PagedKVCache.aligned_capacity(
            self.config,
            self.dtype,
            max(warmup_blocks, wanted, self._blocks_within(self.client.device_memory().available())),
            self.client.granularity,
        )
        self.cache = PagedKVCache.create(
            self.client, self.config, self.dtype, self.device, capacity, name=self.name if self.persistent else None
        )
        self.cache.commit(warmup_blocks)
        log(
            self.name,
            f"reserved {capacity} blocks of {format_bytes(self.bytes_per_block)} in {self.config.num_layers} "
            f"buffers; {warmup_blocks} committed for warm-up",
        )
        with self._timed("warmup_s"):
            self._warm_up()
        log(self.name, f"warmed up in {ms(self.timings['warmup_s'])} (a prefill of {self.config.max_model_len} "
                       f"tokens, the decode step {'captured in a CUDA graph' if self.step_fn.graph else 'eager'})")
        self.available_at_sizing = self.client.device_memory().available()
        if sizing.blocks is not None:
            blocks, why = wanted, "a fixed size"
        elif sizing.share is None:
            blocks, why = wanted, f"what {self.batch_size} sequences of up to {sum(sizing.request)} tokens need"
        else:
            blocks, why = min(capacity, self._blocks_to_commit(sizing)), f"{sizing.share:.0%} of what fits"
        self.sized_to = why
        log(self.name, f"committing {blocks} blocks ({format_bytes(blocks * self.bytes_per_block)}, {why}; "
                       f"{format_bytes(self.available_at_sizing)} left in the budget)")
        with self._timed("size_s"):
            # Right after warm-up, as vLLM does: one chunk per segment, the warm-up data discarded.
            self.cache.commit(blocks, defragment=True)
        self.tables = BlockTables(self.config.block_size, self.cache.num_blocks)
        log(
            self.name,
            f"KV cache sized to {blocks} blocks ({format_bytes(self.cache.physical_bytes)}, "
            f"{self.cache.num_chunks} chunks) in {ms(self.timings['size_s'])}",
        )

    def _blocks_within(self, num_bytes: int) -> int:
        return PagedKVCache.blocks_within(self.config, self.dtype, num_bytes, self.client.granularity)

    def _warm_up(self) -> None:
        """The activation peak (a prefill of the longest sequence) and the decode step, all on the null block."""
        longest = self.config.max_model_len
        tokens = torch.zeros(longest, dtype=torch.long, device=self.device)
        slots = torch.arange(longest, device=self.device) % self.config.block_size
        self.model.prefill(tokens, slots, self.cache.layers)
        self.step_fn = DecodeStep(self.model, self.cache.layers, self.batch_size, self.device)

    def _blocks_to_commit(self, sizing: Sizing) -> int:
        """Blocks this engine holds after sizing: what its pages hold now plus its share of what fits.

        :func:`kv_blocks_that_fit` says how many blocks the daemon can still
        give; two corrections make the commit succeed: the pages are counted
        in whole granules per segment (:meth:`PagedKVCache.blocks_within`),
        and where the daemon reports tenants, other tenants' unmet guaranteed
        minimums are not ours to take and our own tenant's maximum caps us.
        """
        per_block = self.bytes_per_block
        held_for_others, room = tenant_headroom(self.client, sizing.tenant)
        fit = kv_blocks_that_fit(
            self.client,
            per_block,
            margin_bytes=sizing.margin_bytes + held_for_others,
            margin_fraction=sizing.margin_fraction,
        )
        spare = int(fit * sizing.share) * per_block
        if room is not None:
            spare = min(spare, room)
        return self._blocks_within(self.cache.physical_bytes + spare)

    # resume

    def resume(self, state: DecodeState) -> None:
        """Attach the persistent KV buffers left by a dead worker and pick up its block tables."""
        with self._timed("attach_s"):
            self.cache = PagedKVCache.attach(self.client, self.config, self.dtype, self.device, self.name)
        self.tables = BlockTables(self.config.block_size, self.cache.num_blocks, state.block_tables)
        self.sized_to = "attached"
        log(
            self.name,
            f"attached {self.config.num_layers} buffers in {ms(self.timings['attach_s'])}: {self.cache.num_blocks} "
            f"blocks, {format_bytes(self.cache.physical_bytes)} in {self.cache.num_chunks} chunks, data intact",
        )

    def capture(self) -> None:
        """Build (and on a GPU capture) the decode step over the attached cache; writes only the null block."""
        with self._timed("warmup_s"):
            self.step_fn = DecodeStep(self.model, self.cache.layers, self.batch_size, self.device)

    # serve

    def prefill(self, prompts: list[list[int]], prompt_seed: int, prompt_len: int, new_tokens: int) -> DecodeState:
        """Prefill every prompt (made by :func:`make_prompts` from ``prompt_seed`` and ``prompt_len``) into the cache.

        Each sequence gets its first generated token.
        """
        if len(prompts) > self.batch_size:
            raise ValueError(f"{len(prompts)} prompts exceed the decode batch of {self.batch_size}")
        longest = max(len(p) for p in prompts) + new_tokens
        if longest > self.config.max_model_len:
            raise ValueError(f"sequences of {longest} tokens exceed max_model_len {self.config.max_model_len}")
        self.tables.clear()
        first = []
        start = time.perf_counter()
        for prompt in prompts:
            seq = self.tables.add_sequence()
            self.tables.reserve(seq, len(prompt))
            tokens = torch.tensor(prompt, device=self.device)
            slots = torch.tensor(self.tables.slots(seq, 0, len(prompt)), device=self.device)
            first.append(self.model.prefill(tokens, slots, self.cache.layers))
        first_tokens = [int(t) for t in first]
        self.timings["prefill_s"] = time.perf_counter() - start
        log(self.name, f"prefilled {len(prompts)} prompts ({sum(len(p) for p in prompts)} tokens) in "
                       f"{ms(self.timings['prefill_s'])}")
        return DecodeState(
            engine=self.name,
            config=self.config.name,
            weights_seed=self.weights_seed,
            prompt_seed=prompt_seed,
            prompt_len=prompt_len,
            prompt_lens=[len(p) for p in prompts],
            new_tokens=new_tokens,
            batch_size=self.batch_size,
            block_tables=self.tables.tables,
            seq_lens=[len(p) for p in prompts],
            generated=[[t] for t in first_tokens],
            last_tokens=first_tokens,
            step=0,
        )

    def decode(self, state: DecodeState, after_step: Callable[[DecodeState], None] | None = None) -> DecodeState:
        """Decode until every sequence has ``new_tokens`` tokens; ``after_step`` sees the state after each step.

        Crash-consistent at any instant: a step writes the K/V of position
        ``seq_lens[i]`` before the state says it is there, so a worker that
        dies between the two leaves a write the next one redoes identically.
        """
        start, steps = time.perf_counter(), 0
        last_said = start
        width = self.config.max_blocks_per_seq
        total = state.new_tokens - 1
        while not state.done:
            for seq, length in enumerate(state.seq_lens):
                self.tables.reserve(seq, length + 1)
            next_tokens = self.step_fn(state.last_tokens, state.seq_lens, self.tables.padded(self.batch_size, width))
            for seq, token in enumerate(next_tokens):
                state.generated[seq].append(token)
            state.seq_lens = [n + 1 for n in state.seq_lens]
            state.last_tokens = next_tokens
            state.block_tables = self.tables.tables
            state.step += 1
            steps += 1
            if time.perf_counter() - last_said > PROGRESS_EVERY_S:
                last_said = time.perf_counter()
                log(self.name, f"decode step {state.step} of {total}, {last_said - start:.1f} s so far")
            if after_step is not None:
                after_step(state)
        self.timings["decode_s"] = time.perf_counter() - start
        self.timings["decode_steps"] = steps
        log(self.name, f"decoded {steps} steps in {ms(self.timings['decode_s'])}")
        return state

    def time_recompute(self, prompts: list[list[int]], generated: list[list[int]]) -> float:
        """Seconds to rebuild a KV prefix without hbmd: prefill each prompt plus the tokens already in the cache.

        Runs into scratch tensors of the same layout, so the persistent cache
        is untouched; timed on a second pass, so that first-call costs
        (kernel selection, allocator growth) do not inflate it.
        """
        sequences = [p + g[:-1] for p, g in zip(prompts, generated)]
        num_blocks = 1 + sum(-(-len(s) // self.config.block_size) for s in sequences)
        scratch = [
            torch.empty(
                (2, num_blocks, self.config.block_size, self.config.num_kv_heads, self.config.head_dim),
                dtype=self.dtype,
                device=self.device,
            )
            for _ in range(self.config.num_layers)
        ]
        for _ in range(2):
            tables = BlockTables(self.config.block_size, num_blocks)
            synchronize(self.device)
            start = time.perf_counter()
            for sequence in sequences:
                seq = tables.add_sequence()
                tables.reserve(seq, len(sequence))
                slots = torch.tensor(tables.slots(seq, 0, len(sequence)), device=self.device)
                self.model.prefill(torch.tensor(sequence, device=self.device), slots, scratch)
            synchronize(self.device)
            elapsed = time.perf_counter() - start
        return elapsed

    def kv_summary(self) -> dict:
        """The cache as the daemon and a KV connector see it (a connector registers ``committed_shape`` per layer)."""
        return {
            "committed_shape": list(self.cache.committed_views()[0].shape),
            "buffers": len(self.cache.tensors),
            "segments": self.cache.num_segments,
            "num_blocks": self.cache.num_blocks,
            "capacity_blocks": self.cache.num_blocks_capacity,
            "bytes_per_block": self.bytes_per_block,
            "tokens": self.cache.num_blocks * self.config.block_size,
            "physical_bytes": self.cache.physical_bytes,
            "chunks": self.cache.num_chunks,
            "available_at_sizing": self.available_at_sizing,
            "sized_to": self.sized_to,
        }


def tenant_headroom(client: Client, tenant: str) -> tuple[int, int | None]:
    """Bytes held for other tenants' unmet guaranteed minimums, and what our tenant's maximum still allows (None: no
    maximum).

    Daemons without tenant reporting answer ``(0, None)``.
    """
    tenant = tenant or f"uid:{os.getuid()}"  # the daemon's name for a session that declares none
    tenants = getattr(client.status(), "tenants", None) or []
    held = sum(max(0, t.guaranteed_bytes - t.used_bytes) for t in tenants if t.name != tenant)
    mine = next((t for t in tenants if t.name == tenant), None)
    room = mine.max_bytes - mine.used_bytes if mine is not None and mine.max_bytes >= 0 else None
    return held, room


def config_named(name: str) -> DecoderConfig:
    try:
        return CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown model config {name!r}; choose from {', '.join(CONFIGS)}") from None
