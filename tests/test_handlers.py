"""A request is defined once: the protocol names each request's reply, the server's handler classes register one
handler per request."""

from __future__ import annotations

import threading

import pytest
from hbmd import proto
from hbmd.daemon.server import HandlerTableError, Server, handler_table, handles
from hbmd.daemon.server.admin import AdminRequests
from hbmd.daemon.server.buffers import BufferRequests
from hbmd.daemon.server.session import SessionRequests

pytestmark = pytest.mark.unit


def build(*classes: type) -> Server:
    class Rebuilt(Server):
        HANDLER_CLASSES = classes

    # The table is checked before anything else is touched: no state, sockets or backend are needed to see it fail.
    return Rebuilt(None, None, lock=threading.Lock())  # type: ignore[arg-type]


def test_the_server_handles_every_request_of_the_protocol_once():
    table = handler_table(Server.HANDLER_CLASSES, proto.requests())
    assert set(table) == set(proto.requests())


def test_each_family_of_requests_is_handled_in_its_own_module():
    where = {kind: cls for kind, (cls, _) in handler_table(Server.HANDLER_CLASSES, proto.requests()).items()}
    for kind, cls in where.items():
        family = kind.__module__.rpartition(".")[2]
        assert cls.__module__ == f"hbmd.daemon.server.{family}", f"{kind.KIND} is handled in {cls.__module__}"


def test_one_handler_answers_both_ways_of_asking_for_a_commit():
    table = handler_table(Server.HANDLER_CLASSES, proto.requests())
    assert table[proto.Commit] == table[proto.CommitSegments] == (BufferRequests, "commit")


def test_a_server_missing_a_handler_refuses_to_be_built():
    class LostCommit(BufferRequests):
        commit = None

    with pytest.raises(HandlerTableError, match=r"no handler for buffer\.commit, buffer\.commit_segments"):
        build(AdminRequests, LostCommit, SessionRequests)


def test_a_server_missing_a_family_refuses_to_be_built():
    with pytest.raises(HandlerTableError, match=r"no handler for session\.reclaim_done"):
        build(AdminRequests, BufferRequests)


def test_a_handler_of_something_that_is_not_a_request_refuses_to_be_built():
    class HandlesAReply(AdminRequests):
        @handles(proto.Committed)  # type: ignore[arg-type]
        def committed(self, conn, request_id, msg):
            return proto.Ack()

    with pytest.raises(HandlerTableError, match=r"HandlesAReply\.committed handles .*not a request"):
        build(HandlesAReply, BufferRequests, SessionRequests)


def test_two_handlers_of_one_request_refuse_to_be_built():
    class TwoStatus(SessionRequests):
        @handles(proto.Status)
        def status_again(self, conn, request_id, msg):
            return proto.Ack()

    with pytest.raises(HandlerTableError, match=r"admin\.status is handled twice"):
        build(AdminRequests, BufferRequests, TwoStatus)


def test_a_handler_naming_one_request_twice_refuses_to_be_built():
    class Stutter(SessionRequests):
        @handles(proto.ReclaimDone, proto.ReclaimDone)
        def reclaim_done(self, conn, request_id, msg):
            return proto.Ack()

    with pytest.raises(HandlerTableError, match="handled twice"):
        build(AdminRequests, BufferRequests, Stutter)


def test_a_request_added_to_the_protocol_without_a_handler_is_caught():
    class Novel(proto.Request[proto.Ack]):
        pass

    with pytest.raises(HandlerTableError, match=r"Novel|no handler"):
        handler_table(Server.HANDLER_CLASSES, [*proto.requests(), Novel])


def test_a_handler_must_name_a_request():
    with pytest.raises(TypeError):
        handles()
