"""The names of the KV buffers a vLLM engine keeps for its successor (``HBMD_VLLM_KEEP_KV``): the one rule the vLLM
plugin names them by and ``hbmctl delete --engine`` finds them by.

A worker's buffer is ``vllm-<engine>-rank<R>`` (``-dp<D>`` after it in data-parallel replica D > 0, so that no
engine name makes one replica's name another's); a kept one adds a random generation, ``.<12 hex digits>``, new at
every start, so that two starts, or one before and one after the daemon lost its state, never share a name.
"""

from __future__ import annotations

import re

GENERATION_HEX = 12


def buffer_base(engine: str, dp: int, rank: int) -> str:
    """The name of the KV buffer of worker ``rank`` of data-parallel replica ``dp`` of ``engine``."""
    return f"vllm-{engine}-rank{rank}" + (f"-dp{dp}" if dp else "")


def is_kept(name: str, engine: str, dp: int | None = None, rank: int | None = None) -> bool:
    """Whether ``name`` is a kept KV buffer of ``engine`` (of replica ``dp`` and rank ``rank`` where given), of any
    generation."""
    ranks = r"\d+" if rank is None else str(rank)
    replicas = r"(-dp\d+)?" if dp is None else (f"-dp{dp}" if dp else "")
    pattern = f"vllm-{re.escape(engine)}-rank{ranks}{replicas}\\.[0-9a-f]{{{GENERATION_HEX}}}"
    return re.fullmatch(pattern, name) is not None
