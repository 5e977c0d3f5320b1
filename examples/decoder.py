"""A compact Llama-style decoder whose attention reads and writes a paged KV cache.

The architecture is the real one (RMSNorm, rotary position embeddings,
grouped-query attention, SwiGLU MLP); the weights are seeded random numbers,
so two processes with the same config, seed and device build identical
models without downloading anything.

The KV cache of a layer is a tensor ``(2, num_blocks, block_size,
num_kv_heads, head_dim)``: K in ``[0]``, V in ``[1]``. The model never
allocates it: the engine passes one such tensor per layer (views over hbmd
buffers, or plain tensors), and each sequence's tokens live in the blocks its
block table lists, in order.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    """Longest sequence (prompt and generated tokens) the decode step is built for."""
    block_size: int
    """Tokens per KV-cache block."""
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


CONFIGS = {
    c.name: c
    for c in (
        # CI: runs in milliseconds on a laptop CPU.
        DecoderConfig(
            "tiny",
            num_layers=2,
            hidden_size=64,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=172,
            vocab_size=256,
            max_model_len=128,
            block_size=16,
        ),
        DecoderConfig(
            "small",
            num_layers=4,
            hidden_size=128,
            num_heads=8,
            num_kv_heads=4,
            intermediate_size=344,
            vocab_size=512,
            max_model_len=128,
            block_size=16,
        ),
        # The H200: about 0.7B and 0.2B parameters, Llama-like proportions.
        DecoderConfig(
            "gpu",
            num_layers=12,
            hidden_size=2048,
            num_heads=16,
            num_kv_heads=8,
            intermediate_size=5632,
            vocab_size=32000,
            max_model_len=4096,
            block_size=16,
        ),
        DecoderConfig(
            "gpu-small",
            num_layers=8,
            hidden_size=1024,
            num_heads=8,
            num_kv_heads=4,
            intermediate_size=2816,
            vocab_size=32000,
            max_model_len=4096,
            block_size=16,
        ),
        # Several GiB of weights (about 2.6B parameters, 4.9 GiB in bf16): the restart and share-weights figures.
        DecoderConfig(
            "gpu-large",
            num_layers=24,
            hidden_size=3072,
            num_heads=24,
            num_kv_heads=8,
            intermediate_size=8192,
            vocab_size=32000,
            max_model_len=4096,
            block_size=16,
        ),
    )
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Rotary(nn.Module):
    """Rotary embeddings (rotate-half form) from tables precomputed up to ``max_model_len``."""

    def __init__(self, head_dim: int, max_len: int, theta: float, device: torch.device) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_len, device=device, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x`` is ``(tokens, heads, head_dim)``, ``positions`` ``(tokens,)``."""
        cos, sin = self.cos[positions].unsqueeze(-2), self.sin[positions].unsqueeze(-2)
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``(..., kv_heads, head_dim)`` to ``(..., kv_heads * groups, head_dim)``: query head h reads KV head h //
    groups."""
    if groups == 1:
        return x
    *lead, kv_heads, head_dim = x.shape
    return x.unsqueeze(-2).expand(*lead, kv_heads, groups, head_dim).reshape(*lead, kv_heads * groups, head_dim)


def write_kv(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store ``k``/``v`` ``(tokens, kv_heads, head_dim)`` at ``slots`` (block * block_size + offset)."""
    kv_heads, head_dim = k.shape[-2:]
    cache[0].view(-1, kv_heads, head_dim).index_copy_(0, slots, k)
    cache[1].view(-1, kv_heads, head_dim).index_copy_(0, slots, v)


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        width = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, width, bias=False, device=device, dtype=dtype)
        self.o_proj = nn.Linear(
            config.num_heads * config.head_dim, config.hidden_size, bias=False, device=device, dtype=dtype
        )

    def _project(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary):
        q, k, v = self.qkv_proj(x).split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim],
            dim=-1,
        )
        q = rotary(q.unflatten(-1, (self.num_heads, self.head_dim)), positions)
        k = rotary(k.unflatten(-1, (self.num_kv_heads, self.head_dim)), positions)
        return q, k, v.unflatten(-1, (self.num_kv_heads, self.head_dim))

    def prefill(
        self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor, rotary: Rotary
    ) -> torch.Tensor:
        """One sequence's prompt ``x`` ``(tokens, hidden)``: causal attention over itself, K/V stored at ``slots``."""
        q, k, v = self._project(x, positions, rotary)
        write_kv(cache, slots, k, v)
        groups = self.num_heads // self.num_kv_heads
        # As (1, heads, tokens, head_dim): the 4-D form the fused attention kernels take.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            repeat_kv(k, groups).transpose(0, 1).unsqueeze(0),
            repeat_kv(v, groups).transpose(0, 1).unsqueeze(0),
            is_causal=True,
        )
        return self.o_proj(out.squeeze(0).transpose(0, 1).flatten(1))

    def decode(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        visible: torch.Tensor,
        cache: torch.Tensor,
        rotary: Rotary,
    ) -> torch.Tensor:
        """One new token per sequence ``x`` ``(batch, hidden)``: store its K/V, attend over the sequence's blocks.

        Attention is spelled out (two batched matmuls and a softmax, in
        float32) rather than left to ``scaled_dot_product_attention``: for a
        masked single-query batch torch 2.11 on the H200 picks cuDNN
        attention, whose output differed bitwise in 8 to 10 of 20 repeats of
        the same call, and a resumed worker must reproduce the tokens of one
        that never stopped. Batched matmuls are bitwise repeatable (cuBLAS's
        documented guarantee, and measured there).
        """
        q, k, v = self._project(x, positions, rotary)
        write_kv(cache, slots, k, v)
        batch, groups = x.shape[0], self.num_heads // self.num_kv_heads
        # Each sequence's blocks in table order, as (batch, kv_heads, blocks * block_size, head_dim).
        keys = cache[0][block_tables].flatten(1, 2).transpose(1, 2).float()
        values = cache[1][block_tables].flatten(1, 2).transpose(1, 2).float()
        # Query head h reads KV head h // groups: (batch, kv_heads, groups, head_dim).
        q = q.view(batch, self.num_kv_heads, groups, self.head_dim).float()
        scores = (q @ keys.transpose(-1, -2)) * self.head_dim**-0.5
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out = (probs @ values).to(x.dtype)
        return self.o_proj(out.reshape(batch, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: DecoderConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=False, device=device, dtype=dtype
        )
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_eps, device, dtype)
        self.attn = Attention(config, device, dtype)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_eps, device, dtype)
        self.mlp = MLP(config, device, dtype)


class Decoder(nn.Module):
    """The decoder with seeded random weights; :meth:`prefill` and :meth:`decode` return greedy next tokens."""

    def __init__(
        self,
        config: DecoderConfig,
        device: torch.device,
        dtype: torch.dtype,
        seed: int | None,
        tables_device: torch.device | None = None,
    ) -> None:
        """``seed`` None leaves the weights as allocated: for :meth:`from_state_dict`, which replaces them.

        ``tables_device``: where the tables computed rather than loaded (rotary, slot positions) live, by default
        ``device``.
        """
        super().__init__()
        self.config = config
        # Given its weight, the embedding skips its own random init, which on the meta device would import torch's
        # reference kernels: 1.3-1.8 s of a restarted worker's start on a 2-core host (engine.py restart).
        self.embed = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size, device=device, dtype=dtype),
        )
        self.layers = nn.ModuleList(DecoderLayer(config, device, dtype) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps, device, dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=device, dtype=dtype)
        tables_device = tables_device or device
        self.rotary = Rotary(config.head_dim, config.max_model_len, config.rope_theta, tables_device)
        # Token position of every slot of a gathered block table: the decode step's attention mask.
        self.register_buffer(
            "slot_positions",
            torch.arange(config.max_blocks_per_seq * config.block_size, device=tables_device),
            persistent=False,
        )
        if seed is not None:
            self._init_weights(seed)
        self.requires_grad_(False)

    @classmethod
    def from_state_dict(
        cls, config: DecoderConfig, device: torch.device, dtype: torch.dtype, state_dict: dict[str, torch.Tensor]
    ) -> Decoder:
        """The decoder over ``state_dict``'s tensors themselves, not copies (hbmd's read-only views stay shared).

        The parameters are made on the meta device, so no weights are drawn
        or allocated only to be replaced; the tables that are computed rather
        than loaded (rotary, slot positions) are made on ``device``.
        """
        model = cls(config, torch.device("meta"), dtype, None, tables_device=device)
        model.load_state_dict(state_dict, assign=True)
        model.requires_grad_(False)
        return model

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        # Drawn on the target device in registration order: same seed, same device kind, same weights.
        # Fan-in scaling (rather than Llama's 0.02) keeps random-weight greedy decoding from collapsing
        # into one repeated token, so "tokens identical" compares varied sequences.
        generator = torch.Generator(device=self.embed.weight.device).manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                continue
            std = 1.0 if param is self.embed.weight else param.shape[1] ** -0.5
            param.normal_(0.0, std, generator=generator)

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, slots: torch.Tensor, caches: list[torch.Tensor]) -> torch.Tensor:
        """Run one sequence's prompt ``tokens`` ``(T,)`` storing its K/V at ``slots``; the greedy next token (a 0-d
        tensor)."""
        positions = torch.arange(tokens.shape[0], device=tokens.device)
        h = self.embed(tokens)
        for layer, cache in zip(self.layers, caches):
            h = h + layer.attn.prefill(layer.input_norm(h), positions, slots, cache, self.rotary)
            h = h + layer.mlp(layer.post_attn_norm(h))
        return self.lm_head(self.norm(h[-1])).argmax(-1)

    @torch.inference_mode()
    def decode(
        self, tokens: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor, caches: list[torch.Tensor]
    ) -> torch.Tensor:
        """One decode step of a batch: ``tokens`` at ``positions`` ``(B,)``; ``block_tables``
        ``(B, max_blocks_per_seq)``.

        Only device-side indexing, no host synchronisation: the step can be
        captured in a CUDA graph with its inputs in static device tensors.
        Returns the greedy next token of every sequence ``(B,)``.
        """
        block_size = self.config.block_size
        block = block_tables.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1)
        slots = block * block_size + positions % block_size
        visible = (self.slot_positions.unsqueeze(0) <= positions.unsqueeze(1))[:, None, None, :]
        h = self.embed(tokens)
        for layer, cache in zip(self.layers, caches):
            h = h + layer.attn.decode(layer.input_norm(h), positions, slots, block_tables, visible, cache, self.rotary)
            h = h + layer.mlp(layer.post_attn_norm(h))
        return self.lm_head(self.norm(h)).argmax(-1)
