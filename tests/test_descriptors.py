"""The handle plane's descriptors, watched by one epoll that the loop's ZeroMQ poll watches as one descriptor."""

from __future__ import annotations

import select
import socket

import pytest
import zmq
from hbmd.daemon.server.connection import Descriptors

pytestmark = pytest.mark.unit


@pytest.fixture
def descriptors():
    watched = Descriptors()
    yield watched
    watched.close()


@pytest.fixture
def pair():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    yield ours, theirs
    ours.close()
    theirs.close()


def test_only_the_ready_descriptors_are_reported_and_until_they_are_read(descriptors, pair):
    ours, theirs = pair
    quiet, other = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        descriptors.register(ours.fileno(), select.EPOLLIN)
        descriptors.register(quiet.fileno(), select.EPOLLIN)
        assert descriptors.ready() == []
        theirs.send(b"placement")
        assert descriptors.ready() == [(ours.fileno(), select.EPOLLIN)]
        assert descriptors.ready() == [(ours.fileno(), select.EPOLLIN)]  # level-triggered: unread, still ready
        ours.recv(64)
        assert descriptors.ready() == []
    finally:
        quiet.close()
        other.close()


def test_a_peer_that_hangs_up_is_reported_whatever_was_asked(descriptors, pair):
    ours, theirs = pair
    descriptors.register(ours.fileno(), select.EPOLLIN)
    theirs.close()
    [(fd, events)] = descriptors.ready()
    assert fd == ours.fileno() and events & select.EPOLLHUP


def test_room_to_send_is_reported_only_while_asked_for(descriptors, pair):
    ours, _ = pair
    descriptors.register(ours.fileno(), select.EPOLLIN | select.EPOLLOUT)
    assert descriptors.ready() == [(ours.fileno(), select.EPOLLOUT)]
    descriptors.register(ours.fileno(), select.EPOLLIN)  # changed, not registered twice
    assert descriptors.ready() == []
    descriptors.register(ours.fileno(), select.EPOLLIN)  # the same again: nothing to change
    assert descriptors.ready() == []


def test_an_unregistered_descriptor_is_not_reported_and_unregistering_twice_is_harmless(descriptors, pair):
    ours, theirs = pair
    descriptors.register(ours.fileno(), select.EPOLLIN)
    theirs.send(b"datagram")
    descriptors.unregister(ours.fileno())
    descriptors.unregister(ours.fileno())
    assert descriptors.ready() == []
    descriptors.register(ours.fileno(), select.EPOLLIN)  # watched again, as a resumed session's socket would be
    assert descriptors.ready() == [(ours.fileno(), select.EPOLLIN)]


def test_the_zeromq_poll_sees_the_epoll_ready_when_one_of_its_descriptors_is(descriptors, pair):
    ours, theirs = pair
    descriptors.register(ours.fileno(), select.EPOLLIN)
    poller = zmq.Poller()
    poller.register(descriptors.fileno(), zmq.POLLIN)
    assert poller.poll(0) == []
    theirs.send(b"hello")
    assert poller.poll(1000) == [(descriptors.fileno(), zmq.POLLIN)]
