"""A request is defined once: the protocol names each request's reply, the server registers one handler per request."""

from __future__ import annotations

import threading

import pytest
from hbmd import proto
from hbmd.daemon.server import HandlerTableError, Server, handler_table, handles

pytestmark = pytest.mark.unit


def build(server_class: type[Server]) -> Server:
    # The table is checked before anything else is touched: no state, sockets or backend are needed to see it fail.
    return server_class(None, None, lock=threading.Lock())  # type: ignore[arg-type]


def test_the_server_handles_every_request_of_the_protocol_once():
    table = handler_table(Server, proto.requests())
    assert set(table) == set(proto.requests())
    assert len(set(table.values())) == len(table)


def test_a_server_missing_a_handler_refuses_to_be_built():
    class LostCommit(Server):
        _commit = None

    with pytest.raises(HandlerTableError, match="no handler for buffer.commit"):
        build(LostCommit)


def test_a_handler_of_something_that_is_not_a_request_refuses_to_be_built():
    class HandlesAReply(Server):
        @handles(proto.Committed)  # type: ignore[arg-type]
        def _committed(self, conn, request_id, msg):
            return proto.Ack()

    with pytest.raises(HandlerTableError, match="not a request"):
        build(HandlesAReply)


def test_two_handlers_of_one_request_refuse_to_be_built():
    class TwoStatus(Server):
        @handles(proto.Status)
        def _status_again(self, conn, request_id, msg):
            return Server._status(self, conn, request_id, msg)

    with pytest.raises(HandlerTableError, match="handled twice"):
        build(TwoStatus)


def test_a_request_added_to_the_protocol_without_a_handler_is_caught():
    class Novel(proto.Request[proto.Ack]):
        pass

    with pytest.raises(HandlerTableError, match="Novel|no handler"):
        handler_table(Server, [*proto.requests(), Novel])
