"""The table of every place hbmd touches vLLM (integrations/vllm_compat.py) against the installed vLLM.

The first test is the alarm for the next vLLM: an entry that no longer matches fails here, by name. The others show
that a moved signature refuses the whole plugin at ``register()``, naming it, with nothing of vLLM patched.
Needs vLLM 0.34 installed (integrations/README.md); skipped elsewhere.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap

import pytest

vllm_cache = pytest.importorskip("vllm.v1.worker.extensible_kv_cache", reason="vLLM is not installed")
from hbmd.integrations import vllm as plugin  # noqa: E402
from hbmd.integrations import vllm_compat  # noqa: E402
from hbmd.integrations.vllm_front_end import ENGINE_CORE  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.engine.utils import CoreEngineProcManager  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.unit, pytest.mark.torch]


def test_every_touch_point_matches_the_installed_vllm():
    problems = {point.name: problem for point in vllm_compat.TABLE if (problem := vllm_compat.mismatch(point))}
    assert problems == {}


def test_every_private_touch_point_says_why_it_must_be_private():
    unexplained = [point.name for point in vllm_compat.TABLE
                   if any(part.startswith("_") for part in point.symbol.split(".")) and not point.private]
    assert unexplained == []


def unpatched() -> dict[str, object]:
    cache = vllm_cache.ExtensibleKVCache
    return {"ExtensibleTensor": vllm_cache.ExtensibleTensor, "commit": cache.__dict__["commit"],
            "recommit": cache.__dict__["recommit"], "measure": vllm_cache.measure_kv_cache_blocks}


@pytest.mark.parametrize("where, symbol, moved", [
    (vllm_cache.ExtensibleKVCache, "commit", lambda self, blocks, defragment=False, shrink=False: None),
    (BlockPool, "_insert_block_hash", lambda self, block_hash, block: None),
    (vllm_cache, "extend_kv_cache", lambda runner, num_blocks: None),
], ids=["commit", "seeding", "final sizing"])
def test_a_signature_moved_in_vllm_refuses_the_whole_plugin_naming_it(monkeypatch, caplog, where, symbol, moved):
    monkeypatch.setenv("HBMD_VLLM", "1")
    monkeypatch.delenv("HBMD_VLLM_KEEP_KV", raising=False)
    monkeypatch.delenv("HBMD_VLLM_REQUIRED", raising=False)
    monkeypatch.setattr(where, symbol, moved)
    monkeypatch.setattr(plugin.log, "handlers", [caplog.handler])  # vLLM's logger does not propagate
    before = unpatched()
    plugin.register()  # by default the engine runs without hbmd, saying why
    assert f"{symbol} takes (" in caplog.text and "patches nothing" in caplog.text
    assert "This engine runs without hbmd (HBMD_VLLM_REQUIRED=1 stops it instead)" in caplog.text
    assert unpatched() == before
    monkeypatch.setenv("HBMD_VLLM_REQUIRED", "1")
    with pytest.raises(plugin.HbmdRequired, match=f"{symbol} takes .* where hbmd expects") as refusal:
        plugin.register()
    assert "Unset HBMD_VLLM" in str(refusal.value) and "HBMD_VLLM_REQUIRED is on" in str(refusal.value)
    assert unpatched() == before


def test_a_symbol_gone_from_vllm_refuses_the_plugin_naming_it(monkeypatch):
    monkeypatch.setenv("HBMD_VLLM", "1")
    monkeypatch.setenv("HBMD_VLLM_REQUIRED", "1")
    monkeypatch.delattr(vllm_cache, "registers_kv_cache_memory")
    gone = r"no vllm\.v1\.worker\.extensible_kv_cache\.registers_kv_cache_memory"
    with pytest.raises(plugin.HbmdRequired, match=gone):
        plugin.register()
    assert not hasattr(vllm_cache.ExtensibleTensor, "__wrapped__")


def test_the_gpu_workers_entries_are_read_from_its_source_where_it_is_not_loaded(monkeypatch):
    """Only vLLM's worker process loads its GPU worker module (loading it runs the platform's kernel set-up): the
    plugin checks it without loading it, and a moved signature is still named."""
    monkeypatch.delitem(sys.modules, vllm_compat.WORKER, raising=False)
    sleep = next(point for point in vllm_compat.TABLE if point.symbol == "Worker.sleep")
    measure = next(point for point in vllm_compat.TABLE if point.module == vllm_compat.WORKER
                   and point.symbol == "measure_kv_cache_blocks")
    assert vllm_compat.mismatch(sleep) is None and vllm_compat.mismatch(measure) is None
    moved = dataclasses.replace(sleep, expects=("self", "depth"))
    assert vllm_compat.mismatch(moved) == (f"{vllm_compat.WORKER}.Worker.sleep takes (self, level), where hbmd expects "
                                           "(self, depth)")
    assert vllm_compat.WORKER not in sys.modules


def test_vllm_names_its_engine_core_processes_as_hbmd_looks_for_them():
    """An engine core ends with its front end only where its process has the name vLLM gives it
    (``integrations/vllm_front_end.py``): a vLLM that names it otherwise leaves it running, as vLLM does."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(CoreEngineProcManager.__init__)))
    names = [keyword.value for node in ast.walk(tree) if isinstance(node, ast.Call)
             for keyword in node.keywords if keyword.arg == "name"]
    texts = [part.value for name in names for part in ast.walk(name)
             if isinstance(part, ast.Constant) and isinstance(part.value, str)]
    assert texts and all(text.startswith(ENGINE_CORE) for text in texts)
