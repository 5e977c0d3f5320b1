"""The kept KV cache's index file: what a successor reads is what the writer published and did not withdraw."""

from __future__ import annotations

import os

import pytest
from hbmd.integrations.kv_index import IndexWriter, NotAnIndex, Published, read_index

pytestmark = pytest.mark.unit

HEADER = {"key": {"model": "m", "block_size": 16}, "buffers": [7]}


def test_what_is_published_and_not_withdrawn_is_read_back_with_its_header(tmp_path):
    writer = IndexWriter(tmp_path / "e.index", HEADER)
    writer.publish(1, b"h1", 16)
    writer.publish(2, b"h2", 32)
    writer.publish(3, b"h3", 48)
    writer.withdraw(2)
    assert read_index(tmp_path / "e.index").blocks == {}  # nothing reaches the file before a flush
    writer.flush()
    index = read_index(tmp_path / "e.index")
    assert index.header == HEADER and not index.torn
    assert index.blocks == {1: Published(b"h1", 16), 3: Published(b"h3", 48)}
    writer.clear()
    writer.publish(2, b"h2'", 16)
    writer.flush()
    assert read_index(tmp_path / "e.index").blocks == {2: Published(b"h2'", 16)}
    writer.close()


def test_a_record_cut_short_is_ignored_and_those_before_it_stand(tmp_path):
    writer = IndexWriter(tmp_path / "e.index", HEADER)
    writer.publish(1, b"h1" * 16, 16)
    writer.publish(5, b"h5" * 16, 32)
    writer.flush()
    writer.close()
    data = (tmp_path / "e.index").read_bytes()
    for cut in range(1, 43):
        (tmp_path / "cut.index").write_bytes(data[:-cut])
        index = read_index(tmp_path / "cut.index")
        assert index.torn and index.blocks == {1: Published(b"h1" * 16, 16)}, cut


def test_a_new_index_replaces_the_old_in_one_step_with_what_it_adopted(tmp_path):
    old = IndexWriter(tmp_path / "e.index", HEADER)
    old.publish(1, b"h1", 16)
    old.flush()
    new = IndexWriter(tmp_path / "e.index", {"key": {}, "buffers": [8]}, {1: Published(b"h1", 16)})
    old.publish(9, b"late", 16)  # the predecessor's last words go to the file it opened, not to the new one
    old.flush()
    index = read_index(tmp_path / "e.index")
    assert index.header["buffers"] == [8] and index.blocks == {1: Published(b"h1", 16)}
    assert [p.name for p in tmp_path.iterdir()] == ["e.index"]
    old.close()
    new.close()


@pytest.mark.parametrize("damage", [b"", b"hbmd-kv-index 2\n{}\n", b"hbmd-kv-index 1\n{not json\n",
                                    b"hbmd-kv-index 1\n[1, 2]\n", b"hbmd-kv-index 1\n{\"key\": 1}"])
def test_a_file_that_is_not_an_index_is_refused_whole(tmp_path, damage):
    (tmp_path / "e.index").write_bytes(damage)
    with pytest.raises(NotAnIndex):
        read_index(tmp_path / "e.index")


def test_an_unknown_record_or_an_oversized_hash_ends_what_is_trusted(tmp_path):
    writer = IndexWriter(tmp_path / "e.index", HEADER)
    writer.publish(1, b"h1", 16)
    writer.flush()
    writer.close()
    with open(tmp_path / "e.index", "ab") as f:
        f.write(b"P" + (2).to_bytes(4, "little") + (16).to_bytes(4, "little") + (5000).to_bytes(2, "little"))
        f.write(b"x" * 5000)
    index = read_index(tmp_path / "e.index")
    assert index.torn and index.blocks == {1: Published(b"h1", 16)}
    with pytest.raises(ValueError, match="longer than"):
        IndexWriter(tmp_path / "f.index", HEADER).publish(1, b"x" * 5000, 16)


def test_the_index_is_this_users_alone_and_no_link_planted_there_is_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    IndexWriter(tmp_path / "e.index", HEADER).close()
    assert os.stat(tmp_path / "e.index").st_mode & 0o777 == 0o600
    (tmp_path / "e.index").unlink()
    (tmp_path / "e.index").symlink_to(target)
    IndexWriter(tmp_path / "e.index", HEADER).close()  # replaced by rename: the link goes, its target stays
    assert target.read_text() == "keep" and not (tmp_path / "e.index").is_symlink()
