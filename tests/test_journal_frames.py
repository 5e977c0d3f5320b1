"""The journal's frames: one byte damaged anywhere loses one record, named; earlier versions are read too."""

from __future__ import annotations

import logging

import msgpack
import pytest
from hbmd.daemon.restart.journal import Journal, frame

pytestmark = pytest.mark.unit


def session(session_id: int) -> dict:
    return {"id": session_id, "name": f"engine-{session_id}", "holds": [session_id * 10]}


def buffer(buffer_id: int, chunks: list) -> dict:
    return {"id": buffer_id, "name": f"kv-{buffer_id}", "sizes": [len(chunks)], "chunks": chunks, "held": []}


def growth(buffer_id: int, since: int, chunks: list) -> dict:
    return {"id": buffer_id, "since": since, "sizes": [since + len(chunks)], "chunks": chunks, "held": [], "host": []}


RECORDS = [
    ("meta", 0, {"version": 7, "instance": "host"}),
    ("s", 1, session(1)), ("s", 2, session(2)), ("s", 3, session(3)),
    ("b", 10, buffer(10, [[1, 0, 2]])), ("b", 20, buffer(20, [[2, 0, 2]])),
    ("b+", 10, growth(10, 1, [[3, 2, 2]])), ("-s", 3, 3), ("b+", 10, growth(10, 2, [[4, 4, 2]])),
]


def read(tmp_path, data: bytes) -> dict:
    path = tmp_path / "host.journal"
    path.write_bytes(data)
    return Journal(path).read()


def kept(image: dict) -> set[tuple[str, int]]:
    return {("session", i) for i in image["sessions"]} | {("buffer", i) for i in image["buffers"]}


def test_every_byte_flipped_loses_at_most_the_one_record_it_hit_and_names_it(tmp_path, caplog):
    data = b"".join(frame(*record) for record in RECORDS)
    whole = read(tmp_path, data)
    assert kept(whole) == {("session", 1), ("session", 2), ("buffer", 10), ("buffer", 20)}
    assert [c[0] for c in whole["buffers"][10]["chunks"]] == [1, 3, 4]
    for at in range(len(data)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, "hbmd.persist"):
            image = read(tmp_path, data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1:])
        lost = kept(whole) - kept(image)
        assert len(lost) <= 1, (at, lost)
        for what, record_id in lost:
            assert f"{what} {record_id}" in caplog.text, (at, caplog.text)
        for what, record_id in kept(image):
            table = image["sessions" if what == "session" else "buffers"]
            assert table[record_id] == whole["sessions" if what == "session" else "buffers"][record_id], at


def test_a_growth_that_follows_a_lost_one_loses_its_buffer_and_not_the_others(tmp_path, caplog):
    frames = [frame(*record) for record in RECORDS]
    del frames[6]  # the first growth of buffer 10, gone whole: the next one must not pass unseen
    with caplog.at_level(logging.WARNING, "hbmd.persist"):
        image = read(tmp_path, b"".join(frames))
    assert kept(image) == {("session", 1), ("session", 2), ("buffer", 20)}
    assert "buffer 10 'kv-10' is lost: its record cannot be replayed" in caplog.text


def test_a_torn_last_record_loses_that_record_alone(tmp_path, caplog):
    data = b"".join(frame(*record) for record in RECORDS[:6])
    with caplog.at_level(logging.WARNING, "hbmd.persist"):
        image = read(tmp_path, data[:-20])
    assert kept(image) == {("session", 1), ("session", 2), ("session", 3), ("buffer", 10)}
    assert "buffer 20 is lost: the journal ends inside it (a torn write)" in caplog.text


def test_a_journal_of_version_6_is_read_and_a_record_it_cannot_replay_loses_that_buffer_alone(tmp_path, caplog):
    image = {"meta": {"version": 6}, "sessions": {1: session(1)}, "buffers": {10: buffer(10, [[1, 0, 2]])}}
    stream = [["image", image], ["b", buffer(20, [[2, 0, 2]])], ["b+", {"id": 30, "sizes": [1], "chunks": [[5, 0, 2]],
                                                                         "held": []}],
              ["b+", {"id": 10, "sizes": [2], "chunks": [[3, 2, 2]], "held": []}], ["-s", 7]]
    with caplog.at_level(logging.WARNING, "hbmd.persist"):
        read_back = read(tmp_path, b"".join(msgpack.packb(r) for r in stream))
    assert kept(read_back) == {("session", 1), ("buffer", 10), ("buffer", 20)}
    assert [c[0] for c in read_back["buffers"][10]["chunks"]] == [1, 3]
    assert "buffer 30 is lost: its record cannot be replayed" in caplog.text


def test_a_journal_of_version_6_that_stops_decoding_keeps_what_came_before(tmp_path, caplog):
    stream = b"".join(msgpack.packb(r) for r in [["s", session(1)], ["b", buffer(10, [[1, 0, 2]])]])
    with caplog.at_level(logging.WARNING, "hbmd.persist"):
        image = read(tmp_path, stream + b"\xc1" + msgpack.packb(["s", session(2)]))
    assert kept(image) == {("session", 1), ("buffer", 10)}
    assert "cannot be read" in caplog.text
