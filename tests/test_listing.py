"""Lists of sessions and buffers come in pages, and a lookup asks for one name: whatever another uid makes, root's
``hbmctl buffers`` and ``hbmctl weights`` and an engine's weights lookup still work, each reply far below the frame
limit.

The other uid makes the largest listing the per-uid limits let it: as many buffers as it may hold, as many of them
with the most segments as its segments allow, every segment size a 9-byte integer on the wire, each buffer named as
root's weights. Before pages, 16 such buffers made every listing 10.5 MB, which no client reads (issue 51).
"""

from __future__ import annotations

import json
import os

import pytest
from hbmd import proto
from helpers import MiB, hbmctl

pytestmark = pytest.mark.ipc

NOBODY = 65534
WEIGHTS = "weights"

HOSTILE = f"""
import os
from hbmd.client import connect
from hbmd.daemon.state import Limits
from hbmd.proto import MAX_SEGMENTS

os.setgroups([])
os.setgid({NOBODY})
os.setuid({NOBODY})  # everything is imported before: the checkout need not be open to uid 65534
client = connect("cpu", client_name="hostile", timeout=60)
limits = Limits()
widest = (limits.segments_per_uid - limits.buffers_per_uid) // (MAX_SEGMENTS - 1)  # the others take one each
for _ in range(widest):
    client.create_buffer(MAX_SEGMENTS << 34, MAX_SEGMENTS, name={WEIGHTS!r})  # segments of 16 GiB: 9 bytes a size
for _ in range(limits.buffers_per_uid - widest):
    client.create_buffer(1 << 34, 1, name={WEIGHTS!r})
print("made", client.session_id, flush=True)
input()
"""


@pytest.fixture
def hostile(start_daemon, spawn_worker, run_dir):
    """A daemon, root's client holding its sealed weights, and uid 65534's session holding the worst listing."""
    if os.getuid() != 0:
        pytest.skip("needs root to make buffers as a second uid")
    os.chmod(run_dir, 0o755)
    daemon = start_daemon("--budget", "64MiB", "--group", "nogroup")
    client = daemon.connect(client_name="root")
    weights = client.create_buffer(4 * MiB, 1, name=WEIGHTS, persistent=True)
    client.commit(weights.buffer_id, 2 * MiB).close()
    client.seal(weights.buffer_id)
    worker = spawn_worker(daemon, HOSTILE)
    made = worker.readline(timeout=120).split()
    assert made[0] == "made", made
    yield daemon, client, weights.buffer_id, int(made[1])
    client.close()


@pytest.mark.system
def test_another_uids_buffers_never_break_roots_listing(hostile):
    daemon, client, weights_id, _ = hostile
    listed = client.buffers()
    assert len(listed) == 1 + 1024 and sum(b.owner_uid == NOBODY for b in listed) == 1024
    assert len({b.buffer_id for b in listed}) == len(listed)  # each once, across pages
    buffers = hbmctl("--run-dir", str(daemon.run_dir), "--json", "buffers")
    assert buffers.returncode == 0, buffers.stderr
    assert len(json.loads(buffers.stdout)["buffers"]) == len(listed)
    weights = hbmctl("--run-dir", str(daemon.run_dir), "--json", "weights")
    assert weights.returncode == 0, weights.stderr
    assert [w["buffer_id"] for w in json.loads(weights.stdout)["weights"]] == [weights_id]


@pytest.mark.system
def test_every_page_stays_far_below_the_frame_limit(hostile):
    _, client, _, _ = hostile
    after, pages = 0, 0
    while True:
        page = client.call(proto.ListBuffers(after=after))
        pages += 1
        assert len(proto.encode_frames(page, 1)[1]) < proto.MAX_FRAME_BYTES // 2
        if not page.more:
            break
        after = page.buffers[-1].buffer_id
    assert pages > 1


@pytest.mark.system
def test_a_lookup_by_name_is_one_small_answer(hostile):
    """How an engine finds its weights: by name and owner, never by reading every user's buffers."""
    _, client, weights_id, _ = hostile
    page = client.call(proto.ListBuffers(name=WEIGHTS, owner_uid=os.getuid()))
    assert [b.buffer_id for b in page.buffers] == [weights_id] and not page.more
    assert [b.buffer_id for b in client.buffers(name=WEIGHTS, owner_uid=os.getuid())] == [weights_id]
    assert len(client.buffers(name=WEIGHTS, owner_uid=NOBODY)) == 1024


@pytest.mark.system
def test_sessions_are_listed_in_pages_and_asked_for_one_by_one(hostile):
    _, client, _, hostile_session = hostile
    assert {s.session_id for s in client.sessions()} == {client.session_id, hostile_session}
    (mine,) = client.sessions(client.session_id)
    assert mine.uid == os.getuid() and mine.client_name == "root"
    page = client.call(proto.ListSessions(after=client.session_id))
    assert client.session_id not in [s.session_id for s in page.sessions] and not page.more


@pytest.mark.system
def test_a_page_holds_at_most_its_bound_of_buffers(daemon, client):
    made = [client.create_buffer(2 * MiB, 1).buffer_id for _ in range(proto.MAX_LISTED + 5)]
    first = client.call(proto.ListBuffers())
    assert len(first.buffers) == proto.MAX_LISTED and first.more
    assert [b.buffer_id for b in client.buffers()] == made
