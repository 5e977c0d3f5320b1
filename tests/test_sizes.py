"""Sizes as operators write them (``proto.units.parse_size``): exact, and never a fraction of a byte."""

from __future__ import annotations

import pytest
from hbmd.proto.units import parse_size

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("text, size", [
    ("4096", 4096), ("4096B", 4096), ("1.0", 1), ("1.5GiB", 3 << 29), ("0.5KiB", 512), ("1.1KiB", 1126),
    ("9007199254740993", 2**53 + 1),  # a float would read 2**53
    ("1.000000000000000001PiB", 1 << 50),
])
def test_a_size_is_read_exactly_and_rounded_down_to_whole_bytes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["1.5", "0.5B", "2097152.5", "1.50b"])
def test_a_fraction_of_a_byte_is_no_size(text):
    with pytest.raises(ValueError, match="a fraction of a byte"):
        parse_size(text)


@pytest.mark.parametrize("text", ["-1", "nan", "inf", "1e-300", "1e3", "", "MiB"])
def test_signs_exponents_and_words_are_no_size(text):
    with pytest.raises(ValueError, match="expected a number with an optional unit"):
        parse_size(text)


def test_a_percentage_is_exact_of_any_total_and_digits_are_bounded():
    assert parse_size("90%", 2**60 + 10) == (2**60 + 10) * 9 // 10
    assert parse_size("9" * 64) == int("9" * 64)
    with pytest.raises(ValueError, match="400 digits"):
        parse_size("9" * 400 + "GiB")
