"""The takeover channel's messages: the wire form daemons before these types spoke, and every field checked on the way
in (a peer of the same uid may still be a faulty daemon)."""

from __future__ import annotations

import pytest
from hbmd.daemon.restart.handshake import (
    MAX_REASON_CHARS,
    FdNames,
    Offer,
    Refused,
    Serving,
    TakeoverRequest,
    answer_to_request,
)
from hbmd.proto.codec import unpackb

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("message", "wire"), [
    (TakeoverRequest(1, 1), b"\x82\xa8takeover\x01\xa8protocol\x01"),
    (Refused("busy"), b"\x81\xa7refused\xa4busy"),
    (Offer(5, 2), b"\x82\xabstate_bytes\x05\xa3fds\x02"),
    (FdNames(("c1", "listen-control")), b"\x92\xa2c1\xaelisten-control"),
    (Serving(), b"\x81\xa7serving\xc3"),
], ids=["request", "refused", "offer", "fd-names", "serving"])
def test_each_message_has_the_wire_form_of_takeover_wire_version_1_and_reads_back(message, wire):
    assert message.encode() == wire
    decoded = unpackb(wire)
    if isinstance(message, (Refused, Offer)):
        assert answer_to_request(decoded) == message
    else:
        assert type(message).decode(decoded) == message


@pytest.mark.parametrize("request_map", [
    {}, {"takeover": 1}, {"takeover": "1", "protocol": 1}, {"takeover": 1, "protocol": True},
    {"takeover": 1.0, "protocol": 1},
])
def test_a_malformed_request_is_refused_by_what_it_lacks(request_map):
    with pytest.raises(ValueError, match="malformed request: 'takeover' and 'protocol' must be integers"):
        TakeoverRequest.decode(request_map)


@pytest.mark.parametrize("offer", [
    {}, {"state_bytes": 1}, {"state_bytes": -1, "fds": 0}, {"state_bytes": 0, "fds": -3},
    {"state_bytes": True, "fds": 0}, {"state_bytes": 0, "fds": None}, {"state_bytes": 1.5, "fds": 0},
])
def test_an_offer_of_anything_but_two_counts_is_malformed(offer):
    with pytest.raises(ValueError, match="malformed offer"):
        answer_to_request(offer)


def test_any_refusal_refuses_its_reason_cut_to_a_log_line():
    assert answer_to_request({"refused": "x" * 5000}) == Refused("x" * MAX_REASON_CHARS)
    assert answer_to_request({"refused": [1, 2]}) == Refused("[1, 2]")
    assert unpackb(Refused("y" * 5000).encode()) == {"refused": "y" * MAX_REASON_CHARS}


@pytest.mark.parametrize(("names", "why"), [
    ("c1", "not a list of strings"), ([b"c1"], "not a list of strings"), ([1], "not a list of strings"),
    (["a:b"], "without ':'"), ([""], "1 to 255 characters"), (["x" * 256], "1 to 255 characters"),
    (["bell\a"], "printable ASCII"),
])
def test_fd_names_the_fd_store_would_refuse_are_refused(names, why):
    with pytest.raises(ValueError, match=why):
        FdNames.decode(names)


@pytest.mark.parametrize("word", [{}, {"serving": 1}, {"serving": "true"}, {"refused": "no"}])
def test_only_the_word_true_says_it_serves(word):
    with pytest.raises(ValueError, match="not the word that it serves"):
        Serving.decode(word)
