"""A kept KV cache's files and buffers, apart from vLLM: whose folder it is, which buffer a successor adopts, and what
a start that failed or a weight update leaves behind.

These parts of ``HBMD_VLLM_KEEP_KV`` import no vLLM, so they run wherever the suite runs; tests/test_vllm_keep.py
drives the rest under vLLM's own scheduler.
"""

from __future__ import annotations

import json
import os
import stat
import types

import pytest
from hbmd.client.kept_names import buffer_base
from hbmd.integrations import kv_index, vllm_keep
from hbmd.integrations.kv_index import IndexWriter, read_header
from hbmd.integrations.vllm_keep import KeepingOff, Scope

pytestmark = pytest.mark.ipc

MiB = 1 << 20


@pytest.fixture
def folder(monkeypatch, tmp_path):
    monkeypatch.setenv(vllm_keep.KEEP, "1")
    monkeypatch.setenv(vllm_keep.ENGINE, "e")
    monkeypatch.setenv(vllm_keep.INDEX_DIR, str(tmp_path / "index"))
    monkeypatch.setattr(vllm_keep, "_rank", None)
    return tmp_path / "index"


def test_the_index_folder_is_made_this_users_alone(folder):
    assert vllm_keep.index_dir() == folder
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700


def test_a_folder_another_user_made_first_is_refused_saying_whose_it_is(folder):
    folder.mkdir(mode=0o755)
    try:
        os.chown(folder, 65534, 65534)
    except PermissionError:
        pytest.skip("only root can give a folder to another user")
    with pytest.raises(KeepingOff, match="belongs to uid 65534, not to this engine's uid"):
        vllm_keep.index_dir()


def test_a_folder_others_may_write_or_a_link_in_its_place_is_refused(folder, tmp_path):
    folder.mkdir(mode=0o700)
    folder.chmod(0o777)
    with pytest.raises(KeepingOff, match=r"may be written by others \(mode 777\)"):
        vllm_keep.index_dir()
    folder.rmdir()
    (tmp_path / "theirs").mkdir(mode=0o700)
    folder.symlink_to(tmp_path / "theirs")
    with pytest.raises(KeepingOff, match="is not a folder"):
        vllm_keep.index_dir()


def test_a_note_is_this_users_alone_and_goes_through_no_link_planted_for_it(folder, tmp_path):
    vllm_keep.index_dir()
    target = tmp_path / "victim"
    target.write_text("theirs")
    path = folder / "e.rank0.json"
    path.symlink_to(target)
    assert vllm_keep.read_note(path) is None  # a link is not read as a note
    vllm_keep.write_note(path, {"buffer": "b"})
    assert target.read_text() == "theirs" and not path.is_symlink()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and vllm_keep.read_note(path) == {"buffer": "b"}


@pytest.mark.parametrize("engine", ["", "a/b", "../x", "a.b", "x" * 65, "é"])
def test_an_engine_name_that_could_name_another_engines_files_is_refused_at_start(monkeypatch, engine):
    monkeypatch.setenv(vllm_keep.KEEP, "1")
    monkeypatch.setenv(vllm_keep.ENGINE, engine)
    with pytest.raises(ValueError, match=vllm_keep.ENGINE):
        vllm_keep.check_settings()


def test_no_two_ranks_replicas_or_engines_share_a_buffer_name():
    places = [(engine, dp, rank) for engine in ("a", "a-rank0", "a-dp1", "a-rank0-dp1", "b")
              for dp in range(3) for rank in range(3)]
    names = {buffer_base(*place) for place in places}
    assert len(names) == len(places)
    scope = Scope("a", 1)
    kept = f"{buffer_base('a', 1, 2)}.0123456789ab"
    assert scope.kept_name(2, kept) and not scope.kept_name(1, kept) and not Scope("a", 0).kept_name(2, kept)
    assert not scope.kept_name(2, kept + "0") and not scope.kept_name(2, buffer_base("a", 1, 2))
    assert {Scope("a", 0).files(), Scope("a", 1).files(), Scope("a-dp1", 0).files()} == {"a", "a.dp1", "a-dp1"}


def orphan(daemon, name: str, size: int = 4 * MiB) -> None:
    """A persistent buffer named ``name`` left by a session that ended: what an engine killed mid-start leaves."""
    from hbmd.client import ExtensibleTensor

    with daemon.connect() as gone:
        ExtensibleTensor(size, "cpu", client=gone, name=name, persistent=True).resize_per_segment_(2 * MiB)


def index_of(folder, *ranks: str, gpu: str = "host") -> None:
    IndexWriter(folder / "e.index", {"key": {}, "ranks": [{"buffer": b, "gpu": gpu} for b in ranks]}).close()


def test_orphans_of_starts_that_failed_never_lock_the_engines_name_and_are_freed_by_the_next(folder, daemon, client):
    for generation in ("000000000001", "000000000002", "000000000003"):
        orphan(daemon, f"vllm-e-rank0.{generation}")  # three starts killed during warm-up: nothing describes them
    options = vllm_keep.kept_tensor_options(client, Scope("e", 0), 0)
    assert Scope("e", 0).kept_name(0, options["name"]) and options["persistent"]
    assert vllm_keep._rank.donor is None and "left no prefix index" in vllm_keep._rank.why_cold
    assert [b.name for b in client.buffers()] == []  # freed: nothing could ever adopt them


def test_the_buffer_the_index_describes_is_the_donor_and_other_orphans_go(folder, daemon, client):
    orphan(daemon, "vllm-e-rank0.00000000000a")
    orphan(daemon, "vllm-e-rank0.00000000000b")
    orphan(daemon, "vllm-f-rank0.00000000000c")  # another engine's: not this one's to free
    vllm_keep.index_dir()
    index_of(folder, "vllm-e-rank0.00000000000a")
    held = client.create_buffer(4 * MiB, name="vllm-e-rank0.00000000000d", persistent=True)  # a live engine's
    vllm_keep.kept_tensor_options(client, Scope("e", 0), 0)
    assert vllm_keep._rank.donor is not None and vllm_keep._rank.donor.name == "vllm-e-rank0.00000000000a"
    assert sorted(b.name for b in client.buffers()) == ["vllm-e-rank0.00000000000a", "vllm-e-rank0.00000000000d",
                                                         "vllm-f-rank0.00000000000c"]
    assert held.buffer_id in {b.buffer_id for b in client.buffers()}


@pytest.mark.parametrize("index, why", [
    (None, "left no prefix index"),
    ("damaged", "cannot be trusted"),
    ("withdrawn", "withdrew its prefix index: the weights were changed"),
    ("other gpu", "on another GPU"),
    ("gone", "is gone"),
])
def test_without_an_index_that_describes_a_buffer_of_its_own_a_rank_adopts_nothing_and_says_why(
        folder, daemon, client, index, why):
    orphan(daemon, "vllm-e-rank0.00000000000a")
    vllm_keep.index_dir()
    if index == "damaged":
        index_of(folder, "vllm-e-rank0.00000000000a")
        (folder / "e.index").write_bytes((folder / "e.index").read_bytes()[:-3])
    elif index == "withdrawn":
        kv_index.withdraw_all(folder / "e.index", "the weights were changed in place (Worker.reload_weights)")
    elif index == "other gpu":
        index_of(folder, "vllm-e-rank0.00000000000a", gpu="GPU-0000")
    elif index == "gone":
        index_of(folder, "vllm-e-rank0.00000000000f")
    vllm_keep.kept_tensor_options(client, Scope("e", 0), 0)
    assert vllm_keep._rank.donor is None and why in vllm_keep._rank.why_cold
    assert client.buffers() == []


def test_a_weight_update_withdraws_the_kept_index_and_says_so_in_the_ranks_note(folder, daemon, client):
    vllm_keep.kept_tensor_options(client, Scope("e", 0), 0)
    vllm_keep.note_created()
    index_of(folder, vllm_keep._rank.name)
    worker = types.SimpleNamespace(Worker=type("Worker", (), {"reload_weights": lambda self, *a: "reloaded"}))
    vllm_keep.patch_worker(worker)
    assert worker.Worker().reload_weights() == "reloaded"
    assert read_header(folder / "e.index") == {
        "withdrawn": "the weights were changed in place (Worker.reload_weights)"}
    note = json.loads((folder / "e.rank0.json").read_text())
    assert note["weights_changed"] == "the weights were changed in place (Worker.reload_weights)"
    model = types.SimpleNamespace(load_weights=lambda weights: len(weights))
    vllm_keep.watch_weights(model)  # a trainer's worker extension loads into the model directly
    index_of(folder, vllm_keep._rank.name)
    vllm_keep._rank.weights_changed = ""
    assert model.load_weights([1, 2]) == 2
    assert "withdrawn" in read_header(folder / "e.index")


def test_a_kept_cache_that_leaves_no_room_for_the_warm_up_is_freed_so_that_the_engine_starts(folder, daemon, client):
    orphan(daemon, "vllm-e-rank0.00000000000a", size=8 * MiB)
    vllm_keep.index_dir()
    index_of(folder, "vllm-e-rank0.00000000000a")
    vllm_keep.kept_tensor_options(client, Scope("e", 0), 0)
    assert vllm_keep._rank.donor is not None
    assert vllm_keep.make_room(client, RuntimeError("refused"))
    assert vllm_keep._rank.donor is None and "leaves too little of the budget" in vllm_keep._rank.why_cold
    assert client.buffers() == [] and not vllm_keep.make_room(client, RuntimeError("refused"))


@pytest.mark.cli
def test_hbmctl_frees_every_kept_cache_of_an_engine_and_none_a_running_engine_holds(folder, daemon, client):
    from helpers import hbmctl

    for name in ("vllm-e-rank0.00000000000a", "vllm-e-rank1.00000000000b", "vllm-e-rank0-dp1.00000000000c",
                 "vllm-e-rank0-rank0.00000000000d", "vllm-e-rank0"):
        orphan(daemon, name)  # three of engine e's generations, engine e-rank0's, and a buffer e did not keep
    client.create_buffer(4 * MiB, name="vllm-e-rank2.00000000000e", persistent=True)  # a running engine's

    def delete(engine: str):
        out = hbmctl("--run-dir", str(daemon.run_dir), "--json", "delete", "--engine", engine)
        return out.returncode, json.loads(out.stdout) if out.stdout else None, out.stderr

    code, freed, said = delete("e")
    assert code == 3 and "vllm-e-rank2.00000000000e is held by session" in said
    assert sorted(d["name"] for d in freed["deleted"]) == [
        "vllm-e-rank0-dp1.00000000000c", "vllm-e-rank0.00000000000a", "vllm-e-rank1.00000000000b"]
    assert freed["freed_bytes"] == 3 * 2 * MiB and [h["name"] for h in freed["held"]] == ["vllm-e-rank2.00000000000e"]
    assert sorted(b.name for b in client.buffers()) == [
        "vllm-e-rank0", "vllm-e-rank0-rank0.00000000000d", "vllm-e-rank2.00000000000e"]
    code, _, said = delete("f")
    assert code == 3 and "vLLM engine 'f' keeps no KV cache here" in said
