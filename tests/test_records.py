"""The checked records the journal and the kept KV index share: a check that fails on damage and on a torn tail, and
a write that writes everything."""

from __future__ import annotations

import os

import pytest
from hbmd.proto import records
from hbmd.proto.records import CHECK, checked, checksum, sealed, write_all

pytestmark = pytest.mark.unit


def test_a_sealed_part_checks_and_a_chain_goes_on_from_the_check_before():
    first = sealed(b"header")
    assert checked(first, 0, 6) == checksum(b"header")
    second = sealed(b"record", checksum(b"header"))
    assert checked(first + second, len(first), len(first) + 6, checksum(b"header")) == checksum(b"headerrecord")
    assert checked(first + second, len(first), len(first) + 6) is None  # not from the chain's value: no check


@pytest.mark.parametrize("cut", range(1, CHECK.size + 1))
def test_a_part_whose_check_was_cut_short_does_not_check(cut):
    assert checked(sealed(b"payload")[:-cut], 0, 7) is None


@pytest.mark.parametrize("at", range(7 + CHECK.size))
def test_one_byte_damaged_in_a_part_or_its_check_fails_it(at):
    damaged = bytearray(sealed(b"payload"))
    damaged[at] ^= 0x01
    assert checked(bytes(damaged), 0, 7) is None


@pytest.mark.parametrize("offset", [None, 3])
def test_a_short_write_is_followed_by_the_rest(tmp_path, monkeypatch, offset):
    """A write(2) may write less than it was given (a signal, a pipe, a full quota a byte at a time)."""
    path = tmp_path / "records"
    path.write_bytes(b"abc")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND if offset is None else os.O_WRONLY)
    short_write, short_pwrite = os.write, os.pwrite
    monkeypatch.setattr(records.os, "write", lambda fd, data: short_write(fd, data[:2]))
    monkeypatch.setattr(records.os, "pwrite", lambda fd, data, at: short_pwrite(fd, data[:2], at))
    try:
        write_all(fd, b"0123456789", offset)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"abc0123456789"
