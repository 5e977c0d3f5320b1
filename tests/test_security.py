"""Attacks on a real daemon by its peers and by other users of the machine (see SECURITY.md).

Each test sends the attack to a real ``hbmd`` subprocess and checks that the
daemon refused it, stayed up with its invariants holding, kept its FD count flat
and held no memory outside its budget.
"""

from __future__ import annotations

import json
import logging
import os
import site
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_systemd import FakeSystemd
from hbmd import proto
from hbmd.client import ExtensibleTensor, HbmdError, InvalidRequest
from hbmd.client.transport import ControlChannel, HandleChannel
from hbmd.daemon.logs import formatter
from hbmd.daemon.restart.persist import Journal
from hbmd.daemon.server import (
    HELLO_TIMEOUT_S,
    MAX_FDS_IN_FLIGHT,
    MAX_PENDING_HELLOS,
    MAX_PENDING_HELLOS_PER_UID,
    MAX_QUEUED_BATCHES,
    MAX_TENANTS_LISTED,
)
from hbmd.proto.instance import InstancePaths
from helpers import MiB, filled, hbmctl, wait_until
from test_admission import nobody_can_run_python, nobody_python  # noqa: F401 - a fixture, and its interpreter

pytestmark = pytest.mark.ipc

NOBODY = 65534


@pytest.fixture
def start_daemon(start_daemon):
    """Daemons without leases: these tests count the daemon's descriptors exactly, and each leased granule is a
    memfd the daemon holds (hostile placements and the descriptors of leases: test_leases.py)."""
    return lambda *args, **launch: start_daemon(*args, "--lease", "0", **launch)


def as_root_only(reason: str) -> None:
    if os.getuid() != 0:
        pytest.skip(f"needs root to act as a second uid: {reason}")


def start_refused(run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hbmd.daemon", "--backend", "host", "--run-dir", str(run_dir), "--budget", "64MiB"],
        capture_output=True, text=True, timeout=60,
    )


def assert_one_line_refusal(out: subprocess.CompletedProcess, *words: str) -> None:
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert "ERROR" in line and all(w in line for w in words), line


# 1. A run directory prepared by another user.


def test_an_instance_directory_planted_by_another_user_is_refused_and_nothing_is_followed(run_dir, tmp_path):
    as_root_only("the planted directory must belong to someone else")
    os.chmod(run_dir, 0o1777)  # like /tmp: anyone may create entries, only their owner may move them
    secret = tmp_path / "root-only"
    secret.write_text("root's secret\n")
    os.chmod(secret, 0o600)
    created_through_link = tmp_path / "made-through-the-lock-link"
    os.chmod(tmp_path, 0o755)
    plant = (
        f"umask 0; mkdir -m 0777 {run_dir}/host && ln -s {secret} {run_dir}/host/instance.tmp"
        f" && ln -s {created_through_link} {run_dir}/host/lock"
    )
    subprocess.run(["sh", "-c", plant], user=NOBODY, group=NOBODY, extra_groups=[], check=True, timeout=60)

    out = start_refused(run_dir)

    assert_one_line_refusal(out, f"{run_dir}/host", "belongs to uid 65534")
    assert secret.read_text() == "root's secret\n" and stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert not created_through_link.exists()
    assert (run_dir / "host").stat().st_uid == NOBODY  # refused, not taken over


def test_a_run_directory_others_can_write_is_refused(run_dir):
    os.chmod(run_dir, 0o777)  # not sticky: anyone could swap the instance directory for a link
    assert_one_line_refusal(start_refused(run_dir), "writable by others", "not sticky")
    assert not (run_dir / "host").exists()


def test_a_run_directory_of_another_user_is_refused(run_dir):
    as_root_only("the run directory must belong to someone else")
    os.chown(run_dir, NOBODY, NOBODY)
    assert_one_line_refusal(start_refused(run_dir), "belongs to uid 65534")


def test_an_own_instance_directory_others_could_write_is_refused(run_dir):
    (run_dir / "host").mkdir()
    os.chmod(run_dir / "host", 0o777)
    assert_one_line_refusal(start_refused(run_dir), "writable by others")


def test_a_file_as_run_directory_is_a_one_line_refusal(run_dir):
    (run_dir / "file").write_text("")
    assert_one_line_refusal(start_refused(run_dir / "file"), "not a directory")


def test_a_run_directory_reached_through_another_users_link_is_refused(run_dir):
    as_root_only("the link must belong to someone else")
    real = run_dir / "real"
    real.mkdir()
    os.chmod(run_dir, 0o1777)
    link = run_dir / "via"
    os.symlink(real, link)
    os.lchown(link, NOBODY, NOBODY)  # in a sticky directory its owner may point it anywhere, any time
    assert_one_line_refusal(start_refused(link), f"{link} belongs to uid 65534")

def test_the_daemon_makes_its_files_itself(start_daemon, run_dir):
    os.chmod(run_dir, 0o1777)
    daemon = start_daemon("--budget", "64MiB")
    directory = run_dir / "host"
    st = directory.stat()
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o750
    info = (directory / "instance.json").stat()
    assert info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o644
    assert not (directory / "instance.tmp").exists()
    with daemon.connect() as c:
        assert c.status().budget_bytes == 64 * MiB


# What every attack must leave behind: a live daemon, invariants holding, no FD and no byte beyond its budget.


def daemon_memory(daemon) -> int:
    """Bytes really allocated in the memfds the daemon holds: each chunk's, and nothing else."""
    held = 0
    for fd in os.listdir(f"/proc/{daemon.pid}/fd"):
        try:
            if os.readlink(f"/proc/{daemon.pid}/fd/{fd}").startswith("/memfd:"):
                held += os.stat(f"/proc/{daemon.pid}/fd/{fd}").st_blocks * 512
        except FileNotFoundError:
            pass  # closed while we looked
    return held


def assert_intact(daemon, client, fds_before: int, committed: int = 0) -> None:
    """``client``: one connected before ``fds_before`` was counted, so its own sockets are in the count."""
    assert daemon.alive()
    status = client.status()
    assert status.committed_bytes == committed <= status.budget_bytes
    wait_until(lambda: daemon.open_fds() == fds_before, timeout=10)  # a closed peer's sockets go a moment later
    assert daemon_memory(daemon) == committed
    assert "an invariant does not hold" not in daemon.log()


def settled_fds(daemon, client) -> int:
    """The daemon's FD count once ``client`` is connected and served."""
    client.status()
    return daemon.open_fds()


# 2. Memory outside the budget, through a chunk's FD.

FILLER = """
import os, sys
from hbmd.client import connect
c = connect("cpu")
buffer = c.create_buffer(64 << 20, 1)
tries = []

def fill(chunk, fd):
    for name, attempt in [
        ("fallocate past the end", lambda: os.posix_fallocate(fd, chunk.size, 1 << 30)),
        ("grow", lambda: os.ftruncate(fd, 1 << 30)),
        ("shrink", lambda: os.ftruncate(fd, 0)),
    ]:
        try:
            attempt()
            tries.append(name + ": done")
        except OSError as exc:
            tries.append(name + ": " + exc.strerror)
    tries.append("size " + str(os.fstat(fd).st_size))
    kept.append(os.dup(fd))

kept = []
with c.commit(buffer.buffer_id, 2 << 20) as delivery:
    for chunk, fd in delivery:
        fill(chunk, fd)
c.free(buffer.buffer_id)
tries.append("kept copy holds " + str(os.fstat(kept[0]).st_blocks * 512))
print("; ".join(tries), flush=True)
"""


def test_a_client_cannot_grow_or_fill_a_chunk_beyond_the_budget(daemon, client, spawn_worker):
    fds_before = settled_fds(daemon, client)
    worker = spawn_worker(daemon, FILLER)
    tries = worker.readline()
    assert worker.wait() == 0
    assert tries == (
        "fallocate past the end: Operation not permitted; grow: Operation not permitted; "
        "shrink: Operation not permitted; size 2097152; kept copy holds 0"
    )
    wait_until(lambda: client.status().num_sessions == 1)
    assert_intact(daemon, client, fds_before)


@pytest.mark.torch
def test_a_preserving_defragment_twice_keeps_the_data(daemon, client):
    fds_before = settled_fds(daemon, client)
    t = ExtensibleTensor(64 * MiB, "cpu", client=client)
    t.resize_(4 * MiB)
    t.full_view()[: 4 * MiB] = 1
    t.resize_(8 * MiB)
    t.full_view()[4 * MiB : 8 * MiB] = 2
    t.defragment(preserve=True)
    assert t.num_chunks == 1
    t.resize_(12 * MiB)
    t.full_view()[8 * MiB : 12 * MiB] = 3
    t.defragment(preserve=True)
    assert t.num_chunks == 1 and t.physical_bytes == 12 * MiB
    view = t.full_view()
    assert all(filled(view[i * 4 * MiB : (i + 1) * 4 * MiB], i + 1) for i in range(3))
    assert_intact(daemon, client, fds_before + 1, committed=12 * MiB)  # one chunk, one memfd
    t.free()
    assert_intact(daemon, client, fds_before)


# 5. A tenant name declared to escape the uid's limit.

ESCAPE = """
import json, site, sys
for path in json.loads(sys.argv[1]):
    site.addsitedir(path)
from hbmd.client import ExtensibleTensor, HbmdError, connect
out = {}
for tenant in ("anything-else", "open"):
    try:
        c = connect("cpu", tenant=tenant, timeout=5)
    except HbmdError as exc:
        out[tenant] = type(exc).__name__
        continue
    t = ExtensibleTensor(64 << 20, "cpu", client=c)
    t.resize_(8 << 20)
    try:
        t.resize_(10 << 20)
        out[tenant] = "past its max"
    except HbmdError as exc:
        out[tenant] = type(exc).__name__ + " " + exc.details.get("tenant", "")
print(json.dumps(out), flush=True)
"""


@pytest.mark.system
@pytest.mark.torch  # the other uid's process writes through tensor views
def test_a_declared_tenant_name_does_not_lift_the_uids_max(nobody_can_run_python, start_daemon, run_dir):
    config = run_dir / "tenants.toml"
    config.write_text(f'[[tenants]]\nuid = {NOBODY}\nmax = "8MiB"\n\n[[tenants]]\nname = "open"\nmax = "128MiB"\n')
    daemon = start_daemon("--budget", "256MiB", "--config", str(config), "--group", "nogroup")
    with daemon.connect() as client:
        fds_before = settled_fds(daemon, client)
        outcome = json.loads(run_as_nobody(run_dir, ESCAPE))
        assert outcome == {"anything-else": f"OutOfBudget uid:{NOBODY}", "open": "PermissionDenied"}
        assert_intact(daemon, client, fds_before)


# 3. FDs in flight: a session that never reads its handle socket.


class NeverReads:
    """A session whose peer never reads its handle socket (the client library's listener would): its two channels,
    raw."""

    def __init__(self, daemon) -> None:
        paths = InstancePaths.of(daemon.run_dir, daemon.instance)
        self.handles = HandleChannel(paths, 5)
        welcome = self.handles.handshake(proto.Hello(list(proto.PROTOCOL_VERSION), os.getpid(), "greedy"))
        self.control = ControlChannel(paths, welcome.token, 5, session=self.handles)

    def call(self, request):
        return self.control.call(request)

    def create_buffer(self, capacity: int, num_segments: int) -> proto.BufferInfo:
        return self.call(proto.CreateBuffer(capacity, num_segments)).buffer

    def status(self) -> proto.StatusReply:
        return self.call(proto.Status())

    def close(self) -> None:
        self.control.close()
        self.handles.close()


@pytest.mark.torch
@pytest.mark.system
def test_a_session_that_never_reads_its_fds_is_held_and_refused_more_while_others_are_served(daemon, client):
    fds_before = settled_fds(daemon, client)
    honest = ExtensibleTensor(64 * MiB, "cpu", client=client)
    greedy = NeverReads(daemon)
    # 64 segments each backed by a chunk of its own: every discarding defragment sends all 64 FDs again.
    buffer = greedy.create_buffer(64 * 4 * MiB, 64)
    greedy.call(proto.Commit(buffer.buffer_id, 2 * MiB))
    asked = 64
    with pytest.raises(HbmdError, match="wait unread on this session's handle socket") as refused:
        for _ in range(2 * MAX_QUEUED_BATCHES):
            greedy.call(proto.Defragment(buffer.buffer_id, False))
            asked += 64
            if asked % (64 * 64) == 0:
                honest.resize_(honest.num_bytes + 2 * MiB)  # a session of the same uid still gets its FDs
    assert refused.value.retryable
    assert 64 * MAX_QUEUED_BATCHES < asked <= 64 * MAX_QUEUED_BATCHES + MAX_FDS_IN_FLIGHT + 64
    # Every request that delivers chunks is refused alike: the repair of a failed map (Remap) and a commit too.
    for request in (proto.Remap(buffer.buffer_id), proto.Commit(buffer.buffer_id, 4 * MiB)):
        with pytest.raises(HbmdError, match="wait unread on this session's handle socket"):
            greedy.call(request)
    assert honest.num_bytes == asked // (64 * 64) * 2 * MiB >= 2 * MiB
    honest.full_view()[: honest.num_bytes] = 5
    assert filled(honest.full_view()[: honest.num_bytes], 5)
    assert greedy.status().num_sessions == 2  # held, not ended: ending it would not give its FDs back
    warnings = [line for line in daemon.log().splitlines() if "WARNING" in line]
    assert any("holding FDs for session" in line for line in warnings) and len(warnings) < 10  # rate-limited
    greedy.close()
    wait_until(lambda: client.status().num_sessions == 1)
    assert_intact(daemon, client, fds_before + honest.num_chunks, committed=honest.num_bytes)


def test_sessions_per_uid_are_capped(start_daemon):
    daemon = start_daemon("--max-sessions-per-uid", "3")
    sessions = [daemon.connect() for _ in range(3)]
    with pytest.raises(HbmdError, match="already has 3 sessions") as refused:
        daemon.connect()
    assert refused.value.retryable
    sessions.pop().close()
    wait_until(lambda: sessions[0].status().num_sessions == 2)
    sessions.append(daemon.connect())
    for c in sessions:
        c.close()


FORGED = "eng\x1b[2J\x1b]0;owned\x07\x1b[31mFAKE\r\nx"
"""A name that clears the screen, retitles the terminal, turns red and forges a line after it."""


@pytest.mark.parametrize("client_name", [FORGED, "a" * 129, "a" * 500], ids=["control-characters", "129", "500"])
def test_a_client_name_that_could_forge_log_lines_or_terminal_output_is_refused_at_hello(daemon, client, client_name):
    with pytest.raises(InvalidRequest, match="client name must be at most 128 printable characters"):
        daemon.connect(client_name=client_name)
    longest = daemon.connect(client_name="a" * 128)
    assert [s.client_name for s in client.sessions()] == ["test", "a" * 128]
    longest.close()
    log = daemon.log()
    assert all(line.isprintable() for line in log.splitlines()) and "a" * 129 not in log


@pytest.mark.parametrize("client_name", [FORGED, "eng\u202eevil", "a" * 129], ids=["escape", "bidi-override", "129"])
def test_a_refused_hello_naming_a_new_tenant_leaves_no_tenant_behind(daemon, client, client_name):
    """Each refused hello named a tenant nobody had named: none is recorded, and the checked invariants still hold."""
    before = [t.name for t in client.status().tenants]
    for n in range(50):
        with pytest.raises(InvalidRequest, match="client name"):
            daemon.connect(client_name=client_name, tenant=f"squat-{n}")
    assert [t.name for t in client.status().tenants] == before
    assert daemon.proc.poll() is None, daemon.log()[-2000:]


def test_a_hello_refused_for_too_many_sessions_leaves_no_tenant_behind(start_daemon):
    daemon = start_daemon("--budget", "64MiB", "--max-sessions-per-uid", "2")
    first, second = daemon.connect(), daemon.connect()
    with pytest.raises(HbmdError, match="already has 2 sessions"):
        daemon.connect(tenant="never-seen")
    assert "never-seen" not in [t.name for t in first.status().tenants]
    second.close()
    with daemon.connect(tenant="now-seen"):
        assert "now-seen" in [t.name for t in first.status().tenants]
    wait_until(lambda: "now-seen" not in [t.name for t in first.status().tenants])
    first.close()
    assert daemon.proc.poll() is None, daemon.log()[-2000:]


@pytest.mark.parametrize("log_format", ["text", "journal", "json"])
def test_the_daemon_log_shows_a_message_a_peer_could_have_shaped_on_one_line_escaped(log_format):
    record = logging.LogRecord("hbmd", logging.INFO, __file__, 1, "session %d opened (%s)", (3, FORGED), None)
    line = formatter(log_format).format(record)
    assert "\n" not in line and "\x1b" not in line and "\r" not in line
    assert r"session 3 opened (eng\x1b[2J\x1b]0;owned\x07\x1b[31mFAKE\r\nx)" in line.replace(r"\\", "\\")


def as_nobody_with_fds(limit: int) -> list[str]:
    """``python -m hbmd.daemon`` as uid 65534 under a hard RLIMIT_NOFILE of ``limit``: without root's
    exemption, the kernel refuses it (ETOOMANYREFS) more FDs in flight than that, to everyone."""
    code = (
        "import os, resource, runpy, site; "
        f"[site.addsitedir(p) for p in {site.getsitepackages()!r}]; "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit})); "
        f"os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY}); "
        "runpy.run_module('hbmd.daemon', run_name='__main__', alter_sys=True)"
    )
    return [*nobody_python(), "-c", code]


HONEST = """
import json, site, sys
for path in json.loads(sys.argv[1]):
    site.addsitedir(path)
from hbmd.client import ExtensibleTensor, connect
c = connect("cpu", timeout=10)
t = ExtensibleTensor(64 << 20, "cpu", num_segments=8, client=c)
t.resize_per_segment_(4 << 20)
for i in range(8):
    t.segment_view(i)[:] = 7
print(t.num_chunks, sorted({v for i in range(8) for v in t.segment_view(i).unique().tolist()}), flush=True)
"""


@pytest.mark.system
@pytest.mark.torch  # the other uid's process writes through tensor views
def test_sessions_that_never_read_cannot_starve_another_uid_of_fds_in_flight(
    nobody_can_run_python, start_daemon, run_dir
):
    os.chown(run_dir, NOBODY, NOBODY)
    daemon = start_daemon("--budget", "2GiB", command=as_nobody_with_fds(1024))
    client = daemon.connect()
    fds_before = settled_fds(daemon, client)
    greedy = []
    for _ in range(8):  # unread, 8 x 320 FDs would be far past the 1024 the kernel allows the daemon's user
        c = daemon.connect(client_name="greedy")
        buffer = c.create_buffer(64 * 4 * MiB, 64)
        c.call(proto.Commit(buffer.buffer_id, 2 * MiB))
        for _ in range(4):
            c.call(proto.Defragment(buffer.buffer_id, False))
        greedy.append(c)
    assert run_as_nobody(run_dir, HONEST) == "8 [7]"  # another uid's commit is delivered whole
    assert not any("too many FDs in flight" in line for line in daemon.log().splitlines())
    for c in greedy:
        c.close()
    wait_until(lambda: client.status().num_sessions == 1)
    assert_intact(daemon, client, fds_before)
    client.close()

# 7. Descriptors run out; peers that never say hello.


def limited_fds(limit: int) -> list[str]:
    """``python -m hbmd.daemon`` under a hard RLIMIT_NOFILE of ``limit``."""
    code = (
        "import resource, runpy, sys; "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit})); "
        "runpy.run_module('hbmd.daemon', run_name='__main__', alter_sys=True)"
    )
    return [sys.executable, "-c", code]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_chunks_past_the_fd_limit_are_refused_whole_and_retryably(start_daemon):
    daemon = start_daemon("--budget", "1GiB", command=limited_fds(256))
    with daemon.connect() as client:
        fds_before = settled_fds(daemon, client)
        many = ExtensibleTensor(256 * 4 * MiB, "cpu", num_segments=256, client=client)
        with pytest.raises(MemoryError, match="RLIMIT_NOFILE 256") as refused:
            many.resize_per_segment_(2 * MiB)  # 256 chunks: more than 256 descriptors leave room for
        assert refused.value.retryable and many.num_chunks == 0
        few = ExtensibleTensor(64 * 4 * MiB, "cpu", num_segments=64, client=client)
        few.resize_per_segment_(2 * MiB)
        assert_intact(daemon, client, fds_before + 64, committed=128 * MiB)
        assert "Traceback" not in daemon.log()


@pytest.mark.torch
@pytest.mark.system
def test_hello_less_connections_are_bounded_and_timed_out_without_starving_anyone(daemon, client):
    fds_before = settled_fds(daemon, client)
    paths = InstancePaths.of(daemon.run_dir, "host")
    silent = []
    for _ in range(400):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(str(paths.handles))
        silent.append(sock)
    with daemon.connect() as late:  # served at once, however many wait
        t = ExtensibleTensor(8 * MiB, "cpu", client=late)
        t.resize_(8 * MiB)
        assert t.physical_bytes == 8 * MiB
        t.free()
    assert daemon.open_fds() <= fds_before + 2 * MAX_PENDING_HELLOS_PER_UID + 2  # a socket and a pidfd each
    cpu = cpu_seconds(daemon.pid)
    wait_until(lambda: daemon.open_fds() == fds_before, timeout=HELLO_TIMEOUT_S + 5)
    assert cpu_seconds(daemon.pid) - cpu < 1.0  # waited, did not spin
    closed_early = sum(1 for sock in silent if b"sent no hello yet" in sock.recv(4096))
    assert closed_early >= 400 - MAX_PENDING_HELLOS_PER_UID
    for sock in silent:
        sock.close()
    assert_intact(daemon, client, fds_before)


SILENT = """
import socket
import sys
import time

path, count = sys.argv[1], int(sys.argv[2])
socks = []
for _ in range(count):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(path)
    socks.append(sock)
print(len(socks), flush=True)
time.sleep(600)
"""
SILENT_UIDS = tuple(range(65534, 65526, -1))


@pytest.mark.system
def test_hello_less_connections_of_many_uids_are_bounded_in_all_and_timed_out(
    nobody_can_run_python, start_daemon, run_dir
):
    """Eight uids each open their bound of connections that never say hello: 512 connections, two descriptors each,
    were all held before (issue #61). At most :data:`MAX_PENDING_HELLOS` are held in all, an honest client is
    served meanwhile, and every one is closed within the hello's time."""
    daemon = start_daemon("--budget", "64MiB", "--group", "nogroup")
    client = daemon.connect()
    fds_before = settled_fds(daemon, client)
    path = str(InstancePaths.of(run_dir, "host").handles)
    silent = [subprocess.Popen([*nobody_python(), "-c", SILENT, path, str(MAX_PENDING_HELLOS_PER_UID)], user=uid,
                               group=NOBODY, extra_groups=[], stdout=subprocess.PIPE, text=True)
              for uid in SILENT_UIDS]
    try:
        assert [int(p.stdout.readline()) for p in silent] == [MAX_PENDING_HELLOS_PER_UID] * len(SILENT_UIDS)
        client.status()  # every connect above is accepted by now: the loop served them before this request
        assert daemon.open_fds() <= fds_before + 2 * MAX_PENDING_HELLOS
        with daemon.connect() as late:  # served at once, however many wait
            buffer = late.create_buffer(8 * MiB, 1)
            late.commit(buffer.buffer_id, 8 * MiB)
            assert late.status().committed_bytes == 8 * MiB
        wait_until(lambda: daemon.open_fds() == fds_before, timeout=HELLO_TIMEOUT_S + 5)
        assert "connections without a hello" in daemon.log()
    finally:
        for process in silent:
            process.kill()
            process.wait(10)
    assert_intact(daemon, client, fds_before)
    client.close()


@pytest.mark.system
def test_out_of_descriptors_a_newcomer_is_refused_clearly_and_the_loop_does_not_spin(start_daemon):
    daemon = start_daemon("--max-sessions-per-uid", "1000", command=limited_fds(128))
    client = daemon.connect()
    fds_before = settled_fds(daemon, client)
    sessions = []
    with pytest.raises(HbmdError) as refused:
        for _ in range(200):
            sessions.append(daemon.connect(timeout=5))
    assert refused.value.retryable
    assert "out of file descriptors (RLIMIT_NOFILE 128)" in str(refused.value)
    cpu = cpu_seconds(daemon.pid)
    for _ in range(20):  # knocking while there is no descriptor to spare
        with pytest.raises(HbmdError, match="out of file descriptors"):
            daemon.connect(timeout=5)
    time.sleep(1)  # the span its CPU time is measured over: a loop that spins on the refused connects uses it all
    assert cpu_seconds(daemon.pid) - cpu < 1.0
    for c in sessions:
        c.close()
    wait_until(lambda: client.status().num_sessions == 1)
    with daemon.connect() as again:
        assert again.status().num_sessions == 2
    assert_intact(daemon, client, fds_before)
    assert sum("out of file descriptors" in line for line in daemon.log().splitlines()) <= 3  # rate-limited
    client.close()


def daemon_rss(daemon) -> int:
    for line in Path(f"/proc/{daemon.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def test_buffers_and_their_segments_per_uid_are_capped(start_daemon):
    daemon = start_daemon("--max-buffers-per-uid", "20")
    with daemon.connect() as client:
        fds_before = settled_fds(daemon, client)
        rss_before = daemon_rss(daemon)
        widest = [client.create_buffer(1 << 12, 1 << 12) for _ in range(16)]  # 2**16 segments: the most allowed
        with pytest.raises(MemoryError, match="16 buffers of 65536 segments"):
            client.create_buffer(1 << 16, 1)  # 16 buffers are within the 20 allowed; one more segment is not
        client.free(widest[0].buffer_id)
        for _ in range(5):
            client.create_buffer(1 << 20, 1)
        with pytest.raises(MemoryError, match="already holds 20 buffers") as refused:
            client.create_buffer(1 << 20, 1)
        assert refused.value.retryable
        assert daemon_rss(daemon) - rss_before < 256 * MiB
        assert_intact(daemon, client, fds_before)


# 4. A full state directory; persistent buffers without end.


def fill(filler) -> None:
    """Write ``filler`` until its filesystem is full."""
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass  # full
    finally:
        os.close(fd)


@pytest.fixture
def full_state_dir(run_dir):
    """A 64 KiB tmpfs as the state directory, filled up by a file the test can remove."""
    as_root_only("mounting a small filesystem")
    state_dir = run_dir / "state"
    state_dir.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(state_dir)]
    if subprocess.run(mount, capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    filler = state_dir / "filler"
    fill(filler)
    yield state_dir, filler
    subprocess.run(["umount", "-l", str(state_dir)], check=False)


@pytest.mark.torch
@pytest.mark.system
def test_a_restart_after_the_journal_could_not_be_written_is_cold_and_loses_nothing_mapped(start_daemon, run_dir,
                                                                                          full_state_dir):
    """The state directory fills after a buffer was journaled; one made since is not. A restart that keeps the FD
    store must not resume the session from the journal (it would come back without the new buffer, whose memory its
    process still maps): it starts cold, and the client declares both again."""
    state_dir, filler = full_state_dir
    filler.unlink()
    systemd = FakeSystemd(run_dir / "notify.sock")
    try:
        flags = ("--budget", "64MiB", "--state-dir", str(state_dir))
        daemon = start_daemon(*flags, env={"NOTIFY_SOCKET": str(systemd.path)})
        wait_until(lambda: systemd.saw("READY=1"))
        client = daemon.connect()
        journaled = ExtensibleTensor(16 * MiB, "cpu", client=client, name="journaled", persistent=True)
        journaled.resize_(4 * MiB)
        journaled.full_view()[: 4 * MiB] = 3
        fill(filler)
        for _ in range(200):  # changes until the journal's last page, partly free when the disk filled, is full too
            if "persistence degraded" in daemon.log():
                break
            ExtensibleTensor(2 * MiB, "cpu", client=client).free()
        assert "persistence degraded" in daemon.log()
        late = ExtensibleTensor(16 * MiB, "cpu", client=client)
        late.resize_(8 * MiB)
        late.full_view()[: 8 * MiB] = 5
        assert (state_dir / "host.journal.stale").exists() and not (state_dir / "host.journal").exists()
        daemon.kill()
        filler.unlink()
        daemon = start_daemon(*flags, **systemd.relaunch())
        wait_until(lambda: "this start is cold" in daemon.log())
        late.resize_(10 * MiB)  # the client started over and declared what it maps: the late buffer is known
        assert filled(late.full_view()[: 8 * MiB], 5) and filled(journaled.full_view()[: 4 * MiB], 3)
        assert client.status().committed_bytes == 14 * MiB  # counted once each, nothing beyond the budget unseen
        assert not (state_dir / "host.journal.stale").exists()
        client.close()
    finally:
        systemd.close()


@pytest.mark.torch
def test_a_full_state_directory_degrades_persistence_and_the_daemon_serves_on(start_daemon, run_dir, full_state_dir):
    state_dir, filler = full_state_dir
    systemd = FakeSystemd(run_dir / "notify.sock")
    try:
        daemon = start_daemon("--state-dir", str(state_dir), env={"NOTIFY_SOCKET": str(systemd.path)})
        client = daemon.connect()
        fds_before = settled_fds(daemon, client)
        kv = ExtensibleTensor(16 * MiB, "cpu", client=client, name="kv", persistent=True)
        kv.resize_(4 * MiB)
        wait_until(lambda: "persistence degraded" in daemon.log())
        kv.resize_(8 * MiB)  # still served
        assert kv.physical_bytes == 8 * MiB and client.status().committed_bytes == 8 * MiB
        assert sum("persistence degraded" in line for line in daemon.log().splitlines()) == 1
        filler.unlink()
        kv.resize_(10 * MiB)  # the next change writes the journal again
        journal = Journal(state_dir / "host.journal")
        wait_until(lambda: journal.path.exists() and [b["name"] for b in journal.read()["buffers"].values()] == ["kv"])
        wait_until(lambda: "persistence restored" in daemon.log())
        # Its chunks, and the journal, open to append since it could be written again.
        assert_intact(daemon, client, fds_before + kv.num_chunks + 1, committed=10 * MiB)
        kv.free()
        client.close()
    finally:
        systemd.close()


def test_persistent_buffers_per_uid_are_capped(start_daemon):
    daemon = start_daemon("--max-persistent-per-uid", "3")
    with daemon.connect() as client:
        kept = [ExtensibleTensor(2 * MiB, "cpu", client=client, name=f"kv{i}", persistent=True) for i in range(3)]
        with pytest.raises(MemoryError, match="already has 3 persistent buffers"):
            ExtensibleTensor(2 * MiB, "cpu", client=client, name="kv3", persistent=True)
        ExtensibleTensor(2 * MiB, "cpu", client=client).free()  # anonymous ones are not counted
        kept.pop().free()
        ExtensibleTensor(2 * MiB, "cpu", client=client, name="kv3", persistent=True)


# 8. An admin frees another user's orphan.

ORPHAN_MAKER = """
import json, site, sys
for path in json.loads(sys.argv[1]):
    site.addsitedir(path)
from hbmd.client import ExtensibleTensor, HbmdError, connect
c = connect("cpu", timeout=5)
kv = ExtensibleTensor(16 << 20, "cpu", client=c, name="kv", persistent=True)
kv.resize_(8 << 20)
try:
    c.delete("roots-kv", owner_uid=0)
    print("deleted root's buffer", flush=True)
except HbmdError as exc:
    print(type(exc).__name__, flush=True)
"""


def run_as_nobody(run_dir: Path, code: str) -> str:
    out = subprocess.run(
        [*nobody_python(), "-c", code, json.dumps(site.getsitepackages())],
        env=dict(os.environ, HBMD_RUN_DIR=str(run_dir)), user=NOBODY, group=NOBODY, extra_groups=[],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.system
@pytest.mark.torch  # the other uid's process writes through tensor views
def test_an_admin_deletes_another_users_orphan_and_a_user_cannot(nobody_can_run_python, start_daemon, run_dir):
    daemon = start_daemon("--budget", "256MiB", "--group", "nogroup")
    with daemon.connect() as root:
        fds_before = settled_fds(daemon, root)
        mine = ExtensibleTensor(8 * MiB, "cpu", client=root, name="roots-kv", persistent=True)
        mine.resize_(2 * MiB)
        assert run_as_nobody(run_dir, ORPHAN_MAKER) == "PermissionDenied"
        assert root.status().committed_bytes == 10 * MiB  # its orphan, and root's buffer untouched

        own = hbmctl("--run-dir", str(run_dir), "delete", "kv")
        assert own.returncode == 3 and "no persistent buffer named 'kv' for uid 0" in own.stderr
        theirs = hbmctl("--run-dir", str(run_dir), "--json", "delete", "--uid", str(NOBODY), "kv")
        assert theirs.returncode == 0, theirs.stderr
        assert json.loads(theirs.stdout)["freed_bytes"] == 8 * MiB
        assert f"deleted persistent buffer 'kv' of uid {NOBODY}" in daemon.log()
        assert_intact(daemon, root, fds_before + mine.num_chunks, committed=2 * MiB)
        mine.free()


# 6. A flood of tenant names.


def raw_session(paths: InstancePaths, tenant: str) -> socket.socket:
    """A session opened by hand on the handle plane, declaring ``tenant``; it lasts as long as the socket."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(str(paths.handles))
    sock.send(proto.encode_datagram(proto.Hello([1, 1], os.getpid(), "flood", tenant)))
    assert isinstance(proto.decode_datagram(sock.recv(4096)), proto.Welcome)
    return sock


@pytest.mark.system
def test_a_flood_of_tenant_names_is_listed_within_bounds_and_forgotten(start_daemon):
    daemon = start_daemon("--max-sessions-per-uid", "2000")
    client = daemon.connect()
    fds_before = settled_fds(daemon, client)
    paths = InstancePaths.of(daemon.run_dir, "host")
    flood = [raw_session(paths, f"tenant-{i}") for i in range(MAX_TENANTS_LISTED + 100)]
    status = client.status()
    assert len(status.tenants) == MAX_TENANTS_LISTED and status.tenants_left_out == 101  # and uid:0's own
    for sock in flood:
        sock.close()
    wait_until(lambda: client.status().num_sessions == 1)
    status = client.status()
    assert [t.name for t in status.tenants] == [f"uid:{os.getuid()}"] and status.tenants_left_out == 0
    assert_intact(daemon, client, fds_before)
    client.close()


# 9. What a peer learns, and what the command line lets through.

PEEK = """
import json, site, sys
for path in json.loads(sys.argv[1]):
    site.addsitedir(path)
from hbmd.client import HbmdError, connect
c = connect("cpu", timeout=5)
out = {"tenants": [t.name for t in c.status().tenants]}
for buffer_id in (int(sys.argv[2]), 999999):
    try:
        c.free(buffer_id)
        out[str(buffer_id)] = "freed"
    except HbmdError as exc:
        out[str(buffer_id)] = [type(exc).__name__, str(exc).replace(str(buffer_id), "N")]
print(json.dumps(out), flush=True)
"""


@pytest.mark.system
@pytest.mark.torch  # the other uid's process writes through tensor views
def test_a_user_sees_only_its_own_tenants_and_cannot_tell_others_buffer_ids(
    nobody_can_run_python, start_daemon, run_dir
):
    daemon = start_daemon("--budget", "256MiB", "--group", "nogroup")
    with daemon.connect(tenant="secret-team") as root:
        fds_before = settled_fds(daemon, root)
        hidden = ExtensibleTensor(8 * MiB, "cpu", client=root)
        hidden.resize_(2 * MiB)
        out = json.loads(run_as_nobody(run_dir, PEEK.replace("sys.argv[2]", str(hidden.buffer_id))))
        assert out["tenants"] == [f"uid:{NOBODY}"]
        assert out[str(hidden.buffer_id)] == out["999999"] == ["NotFound", "no buffer N in this session"]
        wait_until(lambda: root.status().num_sessions == 1)
        assert [t.name for t in root.status().tenants] == ["secret-team"]  # the stranger's went with its session
        assert hidden.physical_bytes == 2 * MiB
        assert_intact(daemon, root, fds_before + 1, committed=2 * MiB)


@pytest.mark.parametrize(
    "args, config, message",
    [
        (["--budget", "9999999TiB"], None, "is more than the"),
        (["--reclaim-timeout", "nan"], None, "not a positive number of seconds"),
        (["--reclaim-timeout", "-5"], None, "not a positive number of seconds"),
        ([], b"tenants = 5\n", "tenants must be an array of tables"),
        ([], b"access = 5\n", "access must be a table"),
        ([], b"\xff\xfe = 1\n", "not UTF-8"),
        (["--max-sessions-per-uid", "0"], None, "not a positive number"),
        (["--lease", "3MiB"], None, "whole number of 2.0 MiB granules"),
        (["--lease", "lots"], None, "--lease: bad size"),
    ],
)
@pytest.mark.system
def test_bad_options_are_one_line_usage_errors(run_dir, args, config, message):
    if config is not None:
        (run_dir / "bad.toml").write_bytes(config)
        args = [*args, "--config", str(run_dir / "bad.toml")]
    out = subprocess.run(
        [sys.executable, "-m", "hbmd.daemon", "--backend", "host", "--run-dir", str(run_dir), *args],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert message in line, line

