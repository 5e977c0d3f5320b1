"""What hbmd adds to vLLM's key before it trusts sealed weights (issue #42), without vLLM: the checkpoint's files,
and whose unsealed claim on a weights name an engine waits for."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hbmd.integrations.weights_key import checkpoint_fields, files_changes, not_a_store, storer_name
from hbmd.proto.admin import SessionInfo

pytestmark = pytest.mark.unit

NAME = "vllm-weights:LlamaForCausalLM:float32:tp0of1:pp0of1:0123456789abcdef"


def checkpoint(folder: Path, weights: bytes = b"\x01" * 64, mtime_ns: int = 1_700_000_000_123_456_789) -> Path:
    """A folder with one weight file of ``weights``, modified at ``mtime_ns``."""
    folder.mkdir(parents=True)
    path = folder / "model.safetensors"
    path.write_bytes(weights)
    os.utime(path, ns=(mtime_ns, mtime_ns))
    return folder


def fields(folder: Path) -> dict:
    return checkpoint_fields(str(folder), [str(p) for p in folder.glob("*.safetensors")])


def test_the_fields_name_the_folder_and_each_file_with_what_a_copy_keeping_times_cannot_keep(tmp_path):
    folder = checkpoint(tmp_path / "llama")
    (folder / "model-2.safetensors").write_bytes(b"\x02" * 8)
    two = fields(folder)
    assert two["weights_dir"] == str(folder.resolve())
    assert [e["name"] for e in two["weights_files"]] == ["model-2.safetensors", "model.safetensors"]
    stat = (folder / "model.safetensors").stat()
    assert two["weights_files"][1] == {"name": "model.safetensors", "path": str(folder.resolve() / "model.safetensors"),
                                       "size": 64, "mtime_ns": 1_700_000_000_123_456_789, "device": stat.st_dev,
                                       "inode": stat.st_ino, "ctime_ns": stat.st_ctime_ns}


def test_a_file_put_in_place_as_cp_p_or_rsync_a_do_differs_though_its_size_and_times_are_the_same(tmp_path):
    folder = checkpoint(tmp_path / "llama")
    before = fields(folder)
    staged = checkpoint(tmp_path / "tuned", b"\x09" * 64) / "model.safetensors"  # same size, same mtime
    os.replace(staged, folder / "model.safetensors")
    changes = files_changes(before["weights_files"], fields(folder)["weights_files"])
    assert len(changes) == 1 and changes[0].startswith("model.safetensors: inode ")


def test_two_checkpoints_of_the_same_shapes_in_two_folders_differ(tmp_path):
    base, tuned = checkpoint(tmp_path / "base"), checkpoint(tmp_path / "tuned", b"\x09" * 64)
    assert fields(base) != fields(tuned)


def test_a_file_rewritten_in_place_differs_by_its_modification_time_even_at_the_same_size(tmp_path):
    folder = checkpoint(tmp_path / "llama")
    before = fields(folder)
    checkpoint_again = folder / "model.safetensors"
    checkpoint_again.write_bytes(b"\x07" * 64)
    os.utime(checkpoint_again, ns=(1_700_000_001_000_000_000,) * 2)
    after = fields(folder)
    assert after != before
    assert files_changes(before["weights_files"], after["weights_files"])[0].startswith(
        "model.safetensors: mtime_ns 1700000000123456789 -> 1700000001000000000")


def test_a_symlink_to_a_checkpoint_is_the_same_checkpoint(tmp_path):
    folder = checkpoint(tmp_path / "llama")
    (tmp_path / "current").symlink_to(folder)
    assert fields(tmp_path / "current") == fields(folder)


def test_a_hub_snapshot_is_named_by_its_revision_and_its_files_by_their_blobs(tmp_path):
    """The Hugging Face cache's layout: snapshots/<commit>/<file> links to blobs/<hash>; a new revision is a new
    snapshot folder whose links point at new blobs."""
    repo = tmp_path / "models--org--llama"
    (repo / "blobs").mkdir(parents=True)
    for blob, weights in (("aa11", b"\x01" * 64), ("bb22", b"\x02" * 64)):
        (repo / "blobs" / blob).write_bytes(weights)
    for commit, blob in (("c0ffee", "aa11"), ("decade", "bb22")):
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "model.safetensors").symlink_to(Path("../../blobs") / blob)
    old, new = fields(repo / "snapshots" / "c0ffee"), fields(repo / "snapshots" / "decade")
    assert old["weights_files"][0]["path"] == str((repo / "blobs" / "aa11").resolve())
    assert old["weights_dir"] != new["weights_dir"]
    assert files_changes(old["weights_files"], new["weights_files"])[0].startswith("model.safetensors: path ")


def test_a_missing_file_is_an_error_not_an_empty_fingerprint(tmp_path):
    with pytest.raises(FileNotFoundError):
        checkpoint_fields(str(tmp_path), [str(tmp_path / "model.safetensors")])


def test_changes_say_which_file_is_new_gone_or_rewritten(tmp_path):
    entry = {"name": "a.safetensors", "path": "/m/a.safetensors", "size": 10, "mtime_ns": 5}
    assert files_changes([entry], [entry]) == []
    assert files_changes([entry], [entry | {"name": "b.safetensors"}]) == [
        "b.safetensors is new", "a.safetensors is gone"]
    assert files_changes([entry], [entry | {"size": 11}]) == ["a.safetensors: size 10 -> 11"]
    # What a buffer recorded is read, not trusted: a record of another shape is no file at all.
    assert files_changes("garbage", [entry]) == ["a.safetensors is new"]
    assert files_changes([{"size": 1}, {"name": ["a.safetensors"]}, 7], [entry]) == ["a.safetensors is new"]


def session(client_name: str, connected_s: float = 1.0) -> SessionInfo:
    return SessionInfo(session_id=7, pid=4242, uid=1000, gid=1000, client_name=client_name, tenant="",
                       committed_bytes=0, reserved_bytes=0, num_buffers=1, num_chunks=0, connected_s=connected_s)


def test_an_engine_storing_these_weights_is_waited_for():
    assert storer_name(NAME) == "vllm-weights-store:0123456789abcdef"
    assert not_a_store(NAME, session(storer_name(NAME)), 600) == ""


def test_a_storer_older_than_an_engine_waits_is_not_waited_for_and_the_reason_names_it():
    """A process of the same user can take the name under a storer's session name and never seal: once it has held
    it for longer than an engine waits, no engine waits for it again, each loading from disk at once."""
    reason = not_a_store(NAME, session(storer_name(NAME), connected_s=601.0), 600)
    assert reason.startswith(f"{NAME} is held unsealed by session 7 (pid 4242, uid 1000, client "
                             "'vllm-weights-store:0123456789abcdef'); it has been unsealed for 601 s, longer than an "
                             "engine waits")
    assert not_a_store(NAME, session(storer_name(NAME), connected_s=59.0), 60) == ""


def test_a_young_session_holding_a_name_unsealed_longer_than_an_engine_waits_is_not_waited_for():
    """The daemon counts how long the name has been unsealed across the sessions that held it: a squatter handing
    it to a new session of its own does not make an engine wait again."""
    reason = not_a_store(NAME, session(storer_name(NAME), connected_s=5.0), 600, unsealed_s=900.0)
    assert "it has been unsealed for 900 s, longer than an engine waits for a store (600 s, wait_s)" in reason
    assert not_a_store(NAME, session(storer_name(NAME), connected_s=5.0), 600, unsealed_s=30.0) == ""


@pytest.mark.parametrize("client_name", ["python", "vllm-weights-store:fedcba9876543210", ""])
def test_a_name_held_by_anything_else_is_not_waited_for_and_the_reason_names_the_holder(client_name):
    reason = not_a_store(NAME, session(client_name), 600)
    assert reason.startswith(f"{NAME} is held unsealed by session 7 (pid 4242, uid 1000, client {client_name!r})")
    assert "not by an engine storing these weights (client 'vllm-weights-store:0123456789abcdef')" in reason


def test_the_storers_name_fits_a_session_name():
    longest = "vllm-weights:" + "A" * 48 + ":float8_e4m3fnuz:tp127of128:pp127of128:dp127of128:draft:0123456789abcdef"
    assert len(storer_name(longest)) <= 128
