"""vLLM 0.34 as the client: its own ExtensibleKVCache allocating through hbmd's host backend, and the plugin.

Needs vLLM 0.34 installed (integrations/README.md); skipped elsewhere.
"""

from __future__ import annotations

import copy
import inspect
import os
import subprocess
import sys

import pytest
from hbmd.client import ExtensibleTensor
from helpers import MiB, filled, torch

vllm_cache = pytest.importorskip("vllm.v1.worker.extensible_kv_cache", reason="vLLM is not installed")
from hbmd.integrations import vllm as plugin  # noqa: E402
from vllm.config import DeviceConfig, VllmConfig  # noqa: E402
from vllm.utils.extensible_tensor import ExtensibleTensor as VllmExtensibleTensor  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.ipc, pytest.mark.torch]

GRANULE = 2 * MiB
PAGE = 2 * 16 * (64 + 64) * 2  # 2 KV heads x 16 tokens x (K 64 + V 64) x fp16 = 8 KiB per layer and block
FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
SWA = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, sliding_window=128)


def public_members(cls: type) -> dict[str, object]:
    return {name: member for name, member in inspect.getmembers(cls) if not name.startswith("_")}


def test_hbmd_has_every_public_member_of_vllms_class_with_a_compatible_signature():
    ours = public_members(ExtensibleTensor)
    for name, theirs in public_members(VllmExtensibleTensor).items():
        assert name in ours, f"ExtensibleTensor lacks {name}"
        if isinstance(theirs, property):
            assert isinstance(ours[name], property), name
            continue
        expected = list(inspect.signature(theirs).parameters.values())
        got = list(inspect.signature(ours[name]).parameters.values())[: len(expected)]
        assert [(p.name, p.kind, p.default) for p in got] == [(p.name, p.kind, p.default) for p in expected], name
    expected = list(inspect.signature(VllmExtensibleTensor.__init__).parameters.values())
    got = list(inspect.signature(ExtensibleTensor.__init__).parameters.values())
    assert [(p.name, p.kind, p.default) for p in got[: len(expected)]] == [
        (p.name, p.kind, p.default) for p in expected
    ]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in got[len(expected) :])


def run_with_plugins(env: dict[str, str], argv: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    code = (
        f"import sys\nsys.argv = {['vllm', *argv]!r}\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vllm.v1.worker import extensible_kv_cache as m\n"
        "print(m.ExtensibleTensor.__module__ + '.' + m.ExtensibleTensor.__qualname__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("HBMD_VLLM", "VLLM_PLUGINS")} | env
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def test_the_plugin_is_inert_unless_the_operator_opts_in():
    out = run_with_plugins({})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "vllm.utils.extensible_tensor.ExtensibleTensor"


def test_hbmds_load_format_without_the_opt_in_stops_vllm_saying_how_to_turn_hbmd_on():
    out = run_with_plugins({}, ("serve", "m", "--load-format", "hbmd"))
    assert out.returncode != 0 and "hbmd's vLLM plugin is off: set HBMD_VLLM=1" in out.stderr, out.stderr
    assert plugin.asks_for_hbmd_loader(["vllm", "serve", "m", "--load_format=HBMD"])
    assert not plugin.asks_for_hbmd_loader(["vllm", "serve", "hbmd", "--load-format", "auto", "--model", "hbmd"])
    assert run_with_plugins({}, ("serve", "m", "--load-format", "auto")).returncode == 0


def test_with_the_opt_in_vllms_kv_cache_resolves_to_hbmd():
    out = run_with_plugins({"HBMD_VLLM": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "hbmd.integrations.vllm.hbmd_or_own.<locals>.kv_tensor"


def test_with_hbmd_required_no_daemon_stops_the_kv_cache_instead_of_falling_back_to_vllms_own(run_dir, monkeypatch):
    monkeypatch.setenv("HBMD_RUN_DIR", str(run_dir))  # no daemon serves there
    kv_tensor = plugin.hbmd_or_own(vllm_cache.ExtensibleTensor)
    with pytest.raises(ValueError, match="requires a cuda device"):  # by default: vLLM's own class, which needs CUDA
        kv_tensor(8 * MiB, "cpu")
    monkeypatch.setenv("HBMD_VLLM_REQUIRED", "1")
    with pytest.raises(plugin.HbmdRequired, match=r"hbmd is not reachable .* HBMD_VLLM_REQUIRED is on") as refusal:
        kv_tensor(8 * MiB, "cpu")
    assert str(run_dir) in str(refusal.value)  # the daemon looked for, named


def test_an_unknown_vllm_version_is_refused_clearly():
    plugin.check_version("0.34.0")
    for version in ("0.35.0", "1.0.0", "dev"):
        with pytest.raises(plugin.UnsupportedVllm, match=f"not {version}"):
            plugin.check_version(version)


@pytest.fixture
def vllm_on_hbmd(monkeypatch):
    """vLLM's KV cache module with its ExtensibleTensor name pointed at hbmd, as the plugin does."""
    cache = vllm_cache.ExtensibleKVCache
    monkeypatch.setattr(vllm_cache, "ExtensibleTensor", plugin.hbmd_or_own(vllm_cache.ExtensibleTensor))
    monkeypatch.setattr(cache, "commit", plugin.refusal_explained(cache.commit))
    monkeypatch.setattr(cache, "committable_blocks", plugin.capped_by_daemon(cache.committable_blocks, "may commit"))
    monkeypatch.setattr(cache, "release_physical", plugin.keeping_release(cache.release_physical))
    monkeypatch.setattr(cache, "recommit", plugin.waking(cache.recommit))
    monkeypatch.setattr(vllm_cache, "measure_kv_cache_blocks",
                        plugin.capped_by_daemon(vllm_cache.measure_kv_cache_blocks, "measured"))
    return vllm_cache


@pytest.fixture
def hbmd_cache(vllm_on_hbmd, daemon, monkeypatch):
    """The same, served by the ``daemon`` fixture's daemon."""
    monkeypatch.setenv("HBMD_RUN_DIR", str(daemon.run_dir))
    return vllm_on_hbmd


def planned(layout_name: str, groups, available: int):
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    config.cache_config.kv_cache_layout = layout_name  # the engine core resolves this on a GPU
    layout = config.cache_config.get_resolved_kv_cache_layout()
    kv_config = get_kv_cache_config_from_groups(config, groups, available)
    return layout, vllm_cache.pad_kv_cache_segments(kv_config, layout, GRANULE)


LAYOUTS = [
    ("per-layer segments", "LBHNC", [KVCacheGroupSpec([f"layers.{i}.attn" for i in range(4)], FULL)], 4 * PAGE * 300),
    ("one block-outermost segment", "BLHNC", [KVCacheGroupSpec([f"layers.{i}.attn" for i in range(4)], FULL)],
     4 * PAGE * 300),
    ("not block-compact", "LHBNC", [KVCacheGroupSpec([f"layers.{i}.attn" for i in range(4)], FULL)], 4 * PAGE * 300),
    ("two aliasing groups", "LBHNC", [KVCacheGroupSpec(["full.0", "full.1"], FULL),
                                      KVCacheGroupSpec(["swa.0", "swa.1"], SWA)], 2 * PAGE * 300),
]


@pytest.mark.parametrize("title, layout_name, groups, available", LAYOUTS, ids=[case[0] for case in LAYOUTS])
def test_vllms_own_kv_cache_runs_unchanged_on_hbmd(hbmd_cache, daemon, title, layout_name, groups, available):
    layout, config = planned(layout_name, groups, available)
    kv = hbmd_cache.ExtensibleKVCache(config, torch.device("cpu"), layout, export_handle_types=0)
    assert isinstance(kv.buffer, plugin.VllmExtensibleTensor)
    observer = daemon.connect(observer=True)
    (buffer,) = [b for b in observer.buffers() if b.name == plugin.buffer_name()]
    assert buffer.segment_capacities == kv.buffer.segment_capacities

    full = kv.allocate(kv.size)
    assert full.data_ptr() == kv.buffer.base_ptr and kv.num_committed_blocks == kv.min_committed_blocks
    kv.commit(10)
    stride = kv.segment_strides[0]
    first_segment = kv.buffer.segment_view(0)
    first_segment[:stride].fill_(7)
    kv.commit(300)
    assert kv.num_committed_blocks == 300 and filled(kv.buffer.segment_view(0)[:stride], 7)
    # vLLM's estimate assumes no granule is shared; where segments are not granule-aligned, shared ones count once.
    assert observer.status().committed_bytes == kv.physical_bytes <= kv.physical_bytes_for(300)

    kv.commit(300, defragment=True)
    assert all(kv.buffer.segments_backed_by_one_chunk([300 * s for s in kv.segment_strides]))
    kv.commit(20, defragment=True, shrink=True)
    assert kv.num_committed_blocks == 20 and observer.status().committed_bytes == kv.physical_bytes

    runner_config = copy.copy(config)
    runner_config.num_blocks = kv.num_committed_blocks
    views = kv.committed_views(runner_config, layout)
    if views is not None:
        view = next(iter(views.values()))
        view.fill_(1)
        assert view.untyped_storage().data_ptr() >= kv.buffer.base_ptr

    kv.release_physical()
    assert observer.status().committed_bytes == 0 and kv.num_committed_blocks == 20
    kv.recommit()
    assert observer.status().committed_bytes == kv.physical_bytes > 0
    if views is not None:
        assert bool((next(iter(views.values())) == 0).all())  # fresh zeroed pages at the same addresses
    kv.free()
    assert observer.status().committed_bytes == 0 and observer.buffers() == []


def four_layers(available: int):
    return planned("LBHNC", [KVCacheGroupSpec([f"layers.{i}.attn" for i in range(4)], FULL)], available)


def random_blocks(kv, num_blocks: int) -> list:
    """Fill the first ``num_blocks`` blocks of every segment with random bytes; the views written."""
    views = [kv.buffer.segment_view(s)[: num_blocks * kv.segment_strides[s]] for s in range(kv.buffer.num_segments)]
    for segment, view in enumerate(views):
        view.copy_(torch.randint(0, 255, view.shape, dtype=torch.uint8,
                                 generator=torch.Generator().manual_seed(segment)))
    return views


def cache_on_a_daemon(vllm_cache, start_daemon, monkeypatch, blocks: int, *daemon_args: str, **env: str):
    """A daemon started with ``daemon_args`` (a 256 MiB budget unless they say), ``env`` set, and vLLM's KV cache of
    four layers on it with ``blocks`` blocks committed: the daemon and the cache."""
    daemon = start_daemon("--budget", "256MiB", *daemon_args)
    for name, value in {"HBMD_RUN_DIR": str(daemon.run_dir), **env}.items():
        monkeypatch.setenv(name, value)
    layout, config = four_layers(4 * PAGE * blocks)
    kv = vllm_cache.ExtensibleKVCache(config, torch.device("cpu"), layout, export_handle_types=0)
    kv.allocate(kv.size)
    kv.commit(blocks)
    return daemon, kv


def kept_over_sleep(vllm_cache, start_daemon, monkeypatch, *daemon_args: str):
    """:func:`cache_on_a_daemon` with ``HBMD_VLLM_SLEEP=keep`` and 300 blocks of random bytes: the daemon, the cache and
    the views of its blocks."""
    daemon, kv = cache_on_a_daemon(vllm_cache, start_daemon, monkeypatch, 300, *daemon_args, HBMD_VLLM_SLEEP="keep")
    return daemon, kv, random_blocks(kv, 300)


def test_with_sleep_keep_vllms_kv_cache_sleeps_in_host_memory_and_wakes_with_its_blocks(vllm_on_hbmd, start_daemon,
                                                                                       monkeypatch):
    daemon, kv, blocks = kept_over_sleep(vllm_on_hbmd, start_daemon, monkeypatch, "--host-budget", "256MiB")
    written = [view.clone() for view in blocks]
    observer = daemon.connect(observer=True)
    worker_sleep = plugin.sleeping(lambda worker: kv.release_physical())  # vLLM's Worker.sleep, as the plugin wraps it

    worker_sleep(None)
    status = observer.status()
    assert kv.buffer.tier == "host" and status.committed_bytes == 0 and status.host_bytes > 0
    # As vLLM's own class says of a cache released by sleep: nothing on the device. So a weight update while the
    # engine sleeps borrows nothing of it ("Released by sleep"), which would discard the kept blocks.
    assert kv.physical_bytes == 0 and vllm_on_hbmd._release_for_weight_update(
        kv, None, reclaimable=True, fail_if_short=True) is False
    kv.recommit()  # vLLM's wake
    assert kv.buffer.tier == "device" and kv.num_committed_blocks == 300
    assert observer.status().committed_bytes == kv.physical_bytes and observer.status().host_bytes == 0
    assert all(torch.equal(view, kept) for view, kept in zip(blocks, written))  # the same addresses, the same bytes
    kv.free()


def test_with_sleep_keep_every_release_but_the_sleeps_discards_and_the_engine_starts_without_a_host_tier(
        vllm_on_hbmd, start_daemon, monkeypatch):
    daemon, kv, _ = kept_over_sleep(vllm_on_hbmd, start_daemon, monkeypatch)  # no host tier: keeping is refused
    observer = daemon.connect(observer=True)

    kv.commit(20, shrink=True)  # vLLM's warm-up remaps to a smaller size: a discard, never a demote
    assert kv.num_committed_blocks == 20 and kv.buffer.tier == "device"
    assert all(bool((kv.buffer.segment_view(s) == 0).all()) for s in range(kv.buffer.num_segments))
    kv.commit(300, defragment=True)
    assert all(kv.buffer.segments_backed_by_one_chunk([300 * s for s in kv.segment_strides]))
    kv.release_physical()  # release_kv_cache_memory: a discard too
    assert kv.buffer.tier == "device" and observer.status().committed_bytes == 0 and observer.status().host_bytes == 0
    kv.recommit()
    plugin.sleeping(lambda worker: kv.release_physical())(None)  # a sleep the daemon cannot keep: dropped, said
    assert kv.buffer.tier == "device" and observer.status().committed_bytes == 0
    kv.recommit()
    assert kv.num_committed_blocks == 300 and observer.status().committed_bytes == kv.physical_bytes
    kv.free()


def test_vllm_counts_no_kv_block_hbmd_would_not_back_and_its_own_block_pool_writes_every_one(hbmd_cache, daemon):
    from vllm.v1.core.block_pool import BlockPool

    layout, config = four_layers(512 * MiB)
    kv = hbmd_cache.ExtensibleKVCache(config, torch.device("cpu"), layout, export_handle_types=0)
    kv.allocate(kv.size)
    # vLLM's measure would take the whole reservation; the daemon's budget of 256 MiB does not hold it.
    measured = plugin.capped_by_daemon(lambda cache: cache.capacity_blocks, "measured after warm-up")(kv)
    assert 0 < measured < kv.capacity_blocks and kv.physical_bytes_for(measured) <= 256 * MiB
    kv.commit(measured, shrink=True)  # what vLLM's extend_kv_cache commits: the measured count, no fewer
    assert kv.num_committed_blocks == measured
    # vLLM's own block pool, built from that count as its scheduler does, hands out every block; a worker writes each.
    pool = BlockPool(measured, enable_caching=True, hash_block_size=16)
    handed = pool.get_new_blocks(pool.get_num_free_blocks())
    assert max(b.block_id for b in handed) == measured - 1
    for block in (0, *(b.block_id for b in handed)):
        for segment, stride in enumerate(kv.segment_strides):
            kv.buffer.segment_view(segment)[block * stride: (block + 1) * stride].fill_(block % 251 + 1)
    assert int(kv.buffer.segment_view(0)[(measured - 1) * kv.segment_strides[0]]) == (measured - 1) % 251 + 1
    with daemon.connect(observer=True) as observer:
        assert observer.status().committed_bytes == kv.physical_bytes <= 256 * MiB
    kv.free()


def test_growing_vllms_kv_cache_asks_the_daemon_nothing_but_the_commits(hbmd_cache, daemon, monkeypatch):
    from hbmd.client import Client

    layout, config = four_layers(4 * PAGE * 300)
    kv = hbmd_cache.ExtensibleKVCache(config, torch.device("cpu"), layout, export_handle_types=0)
    kv.allocate(kv.size)
    asked = []
    status = Client.status
    monkeypatch.setattr(Client, "status", lambda client: asked.append(client) or status(client))
    for blocks in range(2, 300, 7):  # growth in small steps, as warm-up's commits come
        kv.commit(blocks)
    assert kv.num_committed_blocks == 296 and asked == []
    kv.free()


def test_a_commit_hbmd_refuses_fails_naming_the_cause_and_changes_nothing(hbmd_cache, daemon):
    layout, config = four_layers(512 * MiB)
    kv = hbmd_cache.ExtensibleKVCache(config, torch.device("cpu"), layout, export_handle_types=0)
    kv.allocate(kv.size)
    kv.commit(10)
    with pytest.raises(plugin.KvCacheRefused, match="Another session committed since vLLM measured"):
        kv.commit(kv.capacity_blocks)
    assert kv.num_committed_blocks == 10 and kv.buffer.segment_sizes == [10 * s for s in kv.segment_strides]
    kv.free()


def test_a_wake_waits_for_its_blocks_then_fails_with_the_engine_asleep_and_wakes_once_they_are_free(
        vllm_on_hbmd, start_daemon, monkeypatch):
    daemon, kv = cache_on_a_daemon(vllm_on_hbmd, start_daemon, monkeypatch, 2000, "--budget", "64MiB",
                                   HBMD_VLLM_WAKE_WAIT_S="0.5")
    held = kv.physical_bytes
    kv.release_physical()  # asleep
    with daemon.connect() as other:  # another engine grows while this one sleeps
        grown = ExtensibleTensor(64 * MiB, "cpu", client=other)
        grown.resize_(64 * MiB - held + 2 * MiB)
        with pytest.raises(plugin.KvCacheRefused, match="The engine stays asleep"):
            kv.recommit()
        assert kv.num_committed_blocks == 2000 and kv.physical_bytes == 0  # nothing served short; a retry knows
        grown.free()
    kv.recommit()
    assert kv.num_committed_blocks == 2000 and kv.physical_bytes == held
    kv.free()


@pytest.mark.parametrize("how", ["takeover", "kill", "kill cold"])
def test_vllms_kv_cache_goes_on_across_a_daemon_restart(vllm_on_hbmd, start_daemon, run_dir, systemd, monkeypatch, how):
    state_dir = run_dir / "state"
    state_dir.mkdir()
    args = ("--budget", "256MiB", "--state-dir", str(state_dir))
    daemon = start_daemon(*args, env={"NOTIFY_SOCKET": str(systemd.path)})
    monkeypatch.setenv("HBMD_RUN_DIR", str(daemon.run_dir))
    layout, config = four_layers(4 * PAGE * 300)
    kv = vllm_on_hbmd.ExtensibleKVCache(config, torch.device("cpu"), layout, export_handle_types=0)
    kv.allocate(kv.size)
    kv.commit(100)
    stride = kv.segment_strides[0]
    kv.buffer.segment_view(0)[: 100 * stride].fill_(7)

    if how == "kill":
        daemon.kill()
        daemon = start_daemon(*args, **systemd.relaunch())
    elif how == "kill cold":
        daemon.kill()
        daemon = start_daemon("--budget", "256MiB")  # it knows nothing: the worker declares what it maps
    else:
        old = daemon
        daemon = start_daemon(*args, "--takeover", env={"NOTIFY_SOCKET": str(systemd.path)})
        assert old.proc.wait(10) == 0
    kv.commit(300)  # vLLM's next resize goes to the new daemon, on the same addresses
    assert filled(kv.buffer.segment_view(0)[: 100 * stride], 7)
    with daemon.connect(observer=True) as observer:
        assert observer.status().committed_bytes == kv.physical_bytes
        kv.release_physical()
        assert observer.status().committed_bytes == 0
        kv.recommit()
        assert observer.status().committed_bytes == kv.physical_bytes > 0
        kv.free()
        assert observer.buffers() == []
