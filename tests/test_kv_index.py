"""The kept KV cache's index file: what a successor reads is what the writer published and did not withdraw."""

from __future__ import annotations

import errno
import fcntl
import os
import random

import pytest
from hbmd.integrations import kv_index
from hbmd.integrations.kv_index import IndexWriter, NotAnIndex, Published, Superseded, read_index

pytestmark = pytest.mark.unit

HEADER = {"key": {"model": "m", "block_size": 16}, "buffers": [7]}


def test_what_is_published_and_not_withdrawn_is_read_back_with_its_header(tmp_path):
    writer = IndexWriter(tmp_path / "e.index", HEADER)
    writer.publish(1, b"h1", 16)
    writer.publish(2, b"h2", 32)
    writer.publish(3, b"h3", 48)
    writer.withdraw(2)
    assert writer.published(1) == b"h1" and writer.published(2) is None and writer.published(9) is None
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


def test_a_file_cut_anywhere_short_of_what_its_writer_committed_is_refused_whole(tmp_path):
    """A cut at a record boundary is an index as an earlier moment wrote it: a block withdrawn since, and written
    on, would read as published. So no cut of a committed index reads at all."""
    writer = IndexWriter(tmp_path / "e.index", HEADER)
    for block_id in range(1, 6):
        writer.publish(block_id, b"h" * 20, 16)
    writer.flush()
    writer.withdraw(2)
    writer.withdraw(4)
    writer.flush()
    writer.close()
    data = (tmp_path / "e.index").read_bytes()
    assert read_index(tmp_path / "e.index").blocks.keys() == {1, 3, 5}
    for cut in range(1, len(data)):
        (tmp_path / "cut.index").write_bytes(data[:cut])
        with pytest.raises(NotAnIndex):
            read_index(tmp_path / "cut.index")


def test_no_single_byte_changed_anywhere_in_an_index_reads_as_an_index(tmp_path):
    writer = IndexWriter(tmp_path / "e.index", HEADER, {7: Published(b"adopted", 32)})
    for block_id in range(1, 5):
        writer.publish(block_id, bytes([block_id]) * 36, 16 * block_id)
    writer.withdraw(3)
    writer.flush()
    writer.clear()
    writer.publish(9, b"after", 16)
    writer.flush()
    writer.close()
    data = (tmp_path / "e.index").read_bytes()
    rng = random.Random(3)
    for at in range(len(data)):
        damaged = bytearray(data)
        damaged[at] ^= rng.randrange(1, 256)
        (tmp_path / "damaged.index").write_bytes(damaged)
        with pytest.raises(NotAnIndex):
            read_index(tmp_path / "damaged.index")


def test_a_flush_its_writer_did_not_live_to_commit_stands_up_to_a_record_cut_short(tmp_path, monkeypatch):
    """Killed between its records and its commit, a writer's step never ran: what the records say is as true as
    what the commit covers, and a record cut short ends them."""
    writer = IndexWriter(tmp_path / "e.index", HEADER)
    writer.publish(1, b"h1" * 16, 16)
    writer.flush()
    committed = (tmp_path / "e.index").read_bytes()
    writer.withdraw(1)
    writer.publish(5, b"h5" * 16, 32)
    writer.publish(6, b"h6" * 16, 32)
    real_write_all = kv_index._write_all
    monkeypatch.setattr(kv_index, "_write_all", lambda fd, data, offset: None)  # the commit never written
    writer.flush()
    monkeypatch.setattr(kv_index, "_write_all", real_write_all)
    writer.close()
    data = (tmp_path / "e.index").read_bytes()
    index = read_index(tmp_path / "e.index")
    assert not index.torn and index.blocks == {5: Published(b"h5" * 16, 32), 6: Published(b"h6" * 16, 32)}
    states = [{1}, set(), {5}, {5, 6}]  # what the writer published after each of its records, in order
    for end in range(len(committed), len(data)):
        (tmp_path / "torn.index").write_bytes(data[:end])
        assert set(read_index(tmp_path / "torn.index").blocks) in states, end


def test_an_index_of_an_older_hbmd_is_refused_saying_so(tmp_path):
    (tmp_path / "e.index").write_bytes(b"hbmd-kv-index 1\n{}\n")
    with pytest.raises(NotAnIndex, match="older hbmd"):
        read_index(tmp_path / "e.index")


def test_a_withdrawn_index_publishes_nothing_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(kv_index, "COMPACT_AT_BYTES", 256)
    writer = IndexWriter(tmp_path / "e.index", HEADER, {1: Published(b"h1", 16)})
    kv_index.withdraw_all(tmp_path / "e.index", "the weights were updated in place")
    index = read_index(tmp_path / "e.index")
    assert index.header == {"withdrawn": "the weights were updated in place"} and index.blocks == {}
    with pytest.raises(Superseded, match="withdrawn"):  # its writer finds out at its next rewrite, and stops
        for step in range(100):
            writer.publish(step % 3, b"x" * 30, 16)
            writer.flush()
    writer.close()
    assert read_index(tmp_path / "e.index").blocks == {}


def test_a_new_index_replaces_the_old_in_one_step_with_what_it_adopted(tmp_path):
    old = IndexWriter(tmp_path / "e.index", HEADER)
    old.publish(1, b"h1", 16)
    old.flush()
    new = IndexWriter(tmp_path / "e.index", {"key": {}, "buffers": [8]}, {1: Published(b"h1", 16)})
    old.publish(9, b"late", 16)  # the predecessor's last words go to the file it opened, not to the new one
    old.flush()
    index = read_index(tmp_path / "e.index")
    assert index.header["buffers"] == [8] and index.blocks == {1: Published(b"h1", 16)}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.index", "e.index.lock"]
    old.close()
    new.close()


@pytest.mark.parametrize("damage", [b"", b"hbmd-kv-index 3\n{}\n", b"hbmd-kv-index 2\n",
                                    b"hbmd-kv-index 2\n" + bytes(40),
                                    b"not an index at all, but long enough to hold a header and a commit"])
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


def test_an_index_that_grows_past_its_bound_is_rewritten_with_what_it_publishes_and_read_back_the_same(
        tmp_path, monkeypatch):
    monkeypatch.setattr(kv_index, "COMPACT_AT_BYTES", 4096)
    rng = random.Random(7)
    path = tmp_path / "e.index"
    writer = IndexWriter(path, HEADER, {1: Published(b"adopted", 16)})
    model = {1: Published(b"adopted", 16)}
    records = largest = 0
    for step in range(3000):
        block_id = rng.randrange(1, 17)
        if rng.random() < 0.6:
            model[block_id] = Published(rng.randbytes(rng.randrange(1, 40)), 16 * rng.randrange(1, 9))
            writer.publish(block_id, model[block_id].block_hash, model[block_id].num_tokens)
        elif rng.random() < 0.99:
            model.pop(block_id, None)
            writer.withdraw(block_id)
        else:
            model.clear()
            writer.clear()
        if rng.random() < 0.3:
            records += len(writer.pending)
            writer.flush()
            assert read_index(path).blocks == model, step
            largest = max(largest, path.stat().st_size)
    writer.close()
    # Sixteen blocks of short hashes publish well under a quarter of 4096 bytes: the file never grows past that.
    assert largest <= 4096 and records > 10 * largest  # appended, it would be ten times the largest it was
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.index", "e.index.lock"]


def test_a_writer_whose_index_a_successor_replaced_writes_no_more_and_leaves_the_successors_alone(
        tmp_path, monkeypatch):
    monkeypatch.setattr(kv_index, "COMPACT_AT_BYTES", 1024)
    path = tmp_path / "e.index"
    old = IndexWriter(path, HEADER)
    new = IndexWriter(path, {"key": {}, "buffers": [8]}, {3: Published(b"h3", 16)})
    with pytest.raises(Superseded, match="another engine's index"):
        for block_id in range(1000):
            old.publish(block_id % 50, b"x" * 30, 16)
            old.flush()
    old.remove()  # a writer abandoning its index takes only its own
    index = read_index(path)
    assert index.header["buffers"] == [8] and index.blocks == {3: Published(b"h3", 16)}
    new.remove()
    assert not path.exists()


def test_a_rewrite_the_disk_refuses_changes_nothing_and_the_next_flush_has_it_all(tmp_path, monkeypatch):
    monkeypatch.setattr(kv_index, "COMPACT_AT_BYTES", 256)
    path = tmp_path / "e.index"
    writer = IndexWriter(path, HEADER)
    for block_id in range(10):
        writer.publish(block_id, b"h" * 20, 16)
    writer.flush()
    before = path.read_bytes()
    for block_id in range(5):
        writer.withdraw(block_id)
    for _ in range(30):  # past four times what it publishes: the next flush rewrites
        writer.publish(99, b"churn", 16)
        writer.withdraw(99)
    real_write = os.pwrite

    def full(fd, data, offset):
        if os.fstat(fd).st_ino != os.fstat(writer.fd).st_ino:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data, offset)

    monkeypatch.setattr(kv_index.os, "pwrite", full)
    with pytest.raises(OSError, match="No space"):
        writer.flush()
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["e.index", "e.index.lock"]
    monkeypatch.setattr(kv_index.os, "pwrite", real_write)
    writer.flush()
    assert read_index(path).blocks == {i: Published(b"h" * 20, 16) for i in range(5, 10)}
    writer.close()


def test_a_rewrite_left_half_done_by_a_killed_writer_is_cleared_by_the_next(tmp_path):
    (tmp_path / "e.index.new-99999").write_bytes(b"hbmd-kv-index 2\nP")
    (tmp_path / "f.index.new-99999").write_bytes(b"another engine's")
    IndexWriter(tmp_path / "e.index", HEADER).close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.index", "e.index.lock", "f.index.new-99999"]


def test_a_writer_hung_in_a_rewrite_holds_no_other_writer_past_the_lock_wait(tmp_path, monkeypatch):
    monkeypatch.setattr(kv_index, "LOCK_WAIT_S", 0.2)
    path = tmp_path / "e.index"
    writer = IndexWriter(path, HEADER)
    hung = os.open(tmp_path / "e.index.lock", os.O_RDWR)
    fcntl.flock(hung, fcntl.LOCK_EX)  # another process's writer, stopped between its lock and its rename
    try:
        with pytest.raises(TimeoutError, match="held by another writer"):
            IndexWriter(path, HEADER)
        writer.publish(1, b"h1", 16)
        with pytest.raises(TimeoutError):
            writer.compact()
    finally:
        os.close(hung)
    writer.compact()
    assert read_index(path).blocks == {1: Published(b"h1", 16)}
    writer.close()


def test_a_flush_cut_short_writes_the_rest_before_it_returns(tmp_path, monkeypatch):
    """A withdrawal must be on disk before its step runs, however few bytes one write(2) took."""
    path = tmp_path / "e.index"
    writer = IndexWriter(path, HEADER)
    for block_id in range(1, 4):
        writer.publish(block_id, b"h" * 20, 16)
    writer.withdraw(2)
    real_write = os.pwrite
    monkeypatch.setattr(kv_index.os, "pwrite", lambda fd, data, offset: real_write(fd, bytes(data[:7]), offset))
    writer.flush()
    monkeypatch.setattr(kv_index.os, "pwrite", real_write)
    assert not writer.pending and read_index(path).blocks == {1: Published(b"h" * 20, 16), 3: Published(b"h" * 20, 16)}
    writer.close()
