"""Small helpers shared by the test modules."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable

from hbmd.daemon.clock import Clock
from hbmd.proto.errors import Conflict
from hbmd.testing.spawn import wait_until  # the tests' one polling helper

try:
    import torch
except ImportError:  # the tests that read it are marked ``torch``: they skip without it (conftest.py)
    torch = None

MiB = 1 << 20


class ManualClock(Clock):
    """The daemon's clock as a test drives it: it moves only by :meth:`advance`, both its times at once. Both start
    far from the system's, so that a part that read the system's clock instead of this one is caught out."""

    def __init__(self) -> None:
        self.monotonic_now = 1_000_000.0
        self.unix_now = 1_800_000_000.0

    def monotonic(self) -> float:
        return self.monotonic_now

    def unix(self) -> float:
        return self.unix_now

    def advance(self, seconds: float) -> None:
        self.monotonic_now += seconds
        self.unix_now += seconds


def filled(view, value: int) -> bool:
    """Whether every byte of ``view`` is ``value``: exact, where a mean would pass a mix of values, or a chunk
    mapped from another buffer that happens to hold the same average."""
    return bool((view == value).all())
GRANULE = 2 * MiB
DEMOTABLE = '[[tenants]]\nname = "batch"\ndemote = 1\n\n[[tenants]]\nname = "online"\n'
"""A daemon config with a tenant whose idle buffers are demoted under pressure ("batch") and one that is not."""


def cuda_vmm_status() -> tuple[bool, str]:
    """Whether this machine can run the GPU tier: a driver, a device, POSIX-FD VMM allocations, CUDA torch."""
    from hbmd import driver

    try:
        driver.init()
        if driver.device_count() == 0:
            return False, "no CUDA device"
        handle = driver.create(0, driver.granularity(0), rdma=False)
        try:
            os.close(driver.export_fd(handle))
        finally:
            driver.release(handle)
    except Exception as exc:  # any failure here means: not a GPU machine for these tests
        return False, f"CUDA VMM with POSIX-FD handles unavailable: {exc}"
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "torch has no CUDA"
    return True, ""


def hbmctl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``hbmctl ARGS`` as an operator runs it: a subprocess, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "hbmd.client.ctl", *args], capture_output=True, text=True, timeout=timeout
    )


def descriptors_where(test: Callable[[str], bool]) -> int:
    """How many of this process's descriptors ``test`` picks, given each one's ``/proc/self/fd/N`` path. Unlike a
    count of all of them, one that picks the tests' own is not moved by the sockets, pipes and eventfds that threads
    earlier tests left running in the process open and close (one closed meanwhile is not counted)."""
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            held += test(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # closed meanwhile: another thread's
            pass
    return held


def chunks_held() -> int:
    """How many descriptors this process holds on host-backend chunks: the sealed memfds of :mod:`hbmd.memfd`, made by
    a daemon or by a client."""
    return descriptors_where(lambda path: os.readlink(path).startswith("/memfd:hbmd-"))


def parked_names(state_dir, buffer_name: str, instance: str = "host") -> set[str]:
    """The FD-store names of the chunks of the buffer named ``buffer_name``, as its daemon journaled them."""
    from hbmd.daemon.restart.persist import Journal, chunk_name

    journal = Journal(state_dir / f"{instance}.journal")
    if not journal.path.exists():
        return set()
    buffers = [b for b in journal.read()["buffers"].values() if b["name"] == buffer_name]
    return {chunk_name(chunk[0]) for b in buffers for chunk in (*b["chunks"], *b["pending"])}


class GpuKvCache:
    """A 1 GiB two-segment KV cache on the GPU, grown as an engine grows it (2 MiB steps from the lease, then
    larger ones through the daemon), with 7 and 9 written in each segment: what a GPU restart test keeps alive."""

    def __init__(self, client) -> None:
        import torch
        from hbmd.client import ExtensibleTensor

        self.kv = ExtensibleTensor(1 << 30, "cuda", num_segments=2, client=client)
        for step in range(1, 9):
            self.kv.resize_per_segment_(step * GRANULE if step <= 4 else (step - 4) * 32 * MiB)
        self.view = self.kv.full_view()
        self.base = self.view.data_ptr()
        self.view[: 64 * MiB] = 7
        self.view[512 * MiB : 576 * MiB] = 9
        torch.cuda.synchronize()

    def intact(self) -> bool:
        return (filled(self.view[: 64 * MiB], 7)
                and filled(self.view[512 * MiB : 576 * MiB], 9))

    def grows_on(self) -> None:
        """Grow it further after the restart: at the same address, with its data, and writable where it grew."""
        self.kv.resize_per_segment_(256 * MiB)
        assert self.kv.full_view().data_ptr() == self.base
        assert self.intact()
        self.kv.full_view()[128 * MiB : 256 * MiB] = 3
        assert filled(self.kv.full_view()[128 * MiB : 256 * MiB], 3)

    def free(self) -> None:
        del self.view
        self.kv.free()


class HostEngine:
    """An engine's buffers on the host backend, as a restart test keeps them alive: a 64 MiB two-segment KV cache
    grown in 2 MiB steps (onto leased granules where the client has a lease) with 7 and 9 written in each segment,
    and 6 MiB of persistent weights reading 5."""

    def __init__(self, client) -> None:
        from hbmd.client import ExtensibleTensor

        self.kv = ExtensibleTensor(64 * MiB, "cpu", num_segments=2, client=client)
        for step in range(1, 5):
            self.kv.resize_per_segment_(step * GRANULE)
        self.weights = ExtensibleTensor(16 * MiB, "cpu", client=client, name="weights", persistent=True)
        self.weights.resize_(6 * MiB)
        self.weights.full_view()[: 6 * MiB] = 5
        self.view = self.kv.full_view()
        self.view[: 8 * MiB] = 7
        self.view[32 * MiB : 40 * MiB] = 9

    def intact(self) -> bool:
        return (filled(self.view[: 8 * MiB], 7)
                and filled(self.view[32 * MiB : 40 * MiB], 9)
                and filled(self.weights.full_view()[: 6 * MiB], 5))

    def grows_on(self) -> None:
        """Grow the KV cache to 12 MiB a segment (24 MiB with the weights' 6 committed: 30): its data stays, and
        what it gained takes writes."""
        self.kv.resize_per_segment_(12 * MiB)
        assert self.intact()
        self.kv.full_view()[8 * MiB : 12 * MiB] = 3
        assert filled(self.kv.full_view()[8 * MiB : 12 * MiB], 3)

    def free(self) -> None:
        del self.view
        self.kv.free()
        self.weights.free()


def credited(client, tensor, first: int, at_least: int) -> None:
    """Grow ``tensor`` to ``first`` bytes through the daemon, so that the session is granted credit (twice that, where
    the budget has room), and wait until ``at_least`` bytes of it have come."""
    tensor.resize_(first)
    wait_until(lambda: client.leasing.credit_covers(at_least), timeout=10)


def daemon_view(client, tensor):
    """The daemon's record of ``tensor``'s buffer (:class:`~hbmd.proto.BufferInfo`)."""
    (info,) = [b for b in client.buffers() if b.buffer_id == tensor.buffer_id]
    return info


HOLDER = """
import os, subprocess, sys, time
from hbmd.client import NotFound, connect

c = connect("cpu", client_name="holder")
try:
    with c.attach("kv") as attached:
        info = attached.reply.buffer
except NotFound:
    info = c.create_buffer(16 << 20, name="kv", persistent=True)
    c.commit(info.buffer_id, 4 << 20).close()
helper = sys.stdin.readline().strip()
if helper == "fork":
    child = os.fork()
    if child == 0:
        time.sleep(30)  # a helper that never speaks to hbmd
        os._exit(0)
elif helper == "inherit":
    # A helper holding the handle socket itself, as a forked child would without the client's fork hook.
    child = subprocess.Popen(["sleep", "30"], pass_fds=[c._core.handles.sock.fileno()]).pid
else:
    child = 0
print(os.getpid(), child, c.session_id, info.buffer_id, flush=True)
sys.stdin.readline()
"""


def spawn_holder(spawn_worker, daemon, helper: str = "none"):
    worker = spawn_worker(daemon, HOLDER)
    worker.send(helper)
    pid, child, session_id, buffer_id = map(int, worker.readline().split())
    return worker, pid, child, session_id, buffer_id


def attach_within(client, seconds: float) -> float:
    """Attach ``kv`` (without mapping it) as soon as the daemon lets go of it; the seconds that took."""
    started = time.monotonic()
    while True:
        try:
            client.attach("kv").close()
            return time.monotonic() - started
        except Conflict:
            if time.monotonic() - started > seconds:
                raise
            time.sleep(0.01)
