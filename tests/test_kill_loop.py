"""Workers SIGKILLed at random points of attach, commit and both defragments: no byte of the persistent buffer
is lost, and no chunk, FD or session is left behind.

Each round a worker attaches the persistent buffer ``kv`` (two segments),
commits a granule of a scratch buffer of its own through the daemon (a lease
follows such a commit) and says it is ready, then
grows ``kv`` by one granule a segment (mostly onto leased granules, placed without
a round trip) or two (mostly in chunks it makes itself on credit), writes
a known pattern into what it committed and reports the size, defragments it
keeping the data, and grows and discards-defragments a scratch buffer of its
own, until it is killed after a random delay. The test then attaches ``kv``
and checks every byte: what an earlier round confirmed and what the dead
worker reported is intact, and the rest of what it committed holds the
pattern or zeros (a write the kill cut short), never anything else.
``HBMD_KILL_ROUNDS`` sets the number of rounds.
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from hbmd.client import ExtensibleTensor
from helpers import GRANULE, MiB, wait_until

pytestmark = pytest.mark.ipc

ROUNDS = int(os.environ.get("HBMD_KILL_ROUNDS", "40"))
SEGMENT = 32 * MiB
PAGE = 4096

WORKER = textwrap.dedent(
    """
    import ctypes, random, sys, time
    from hbmd.client import ExtensibleTensor, NotFound, connect

    def page_value(segment, offset):
        return (offset // 4096 + 7 * segment) % 251 + 1

    def write(t, segment, start, end):
        base = t.base_ptr + t.segment_offsets[segment]
        for page in range(start // 4096, end // 4096):
            ctypes.memset(base + page * 4096, page_value(segment, page * 4096), 4096)

    client = connect("cpu", client_name="kill-loop")
    try:
        kv = ExtensibleTensor.attach("kv", "cpu", client=client)
    except NotFound:
        kv = ExtensibleTensor(2 * SEGMENT, "cpu", num_segments=2, client=client, name="kv", persistent=True)
    def wait_for_lease():
        deadline = time.monotonic() + 2.0  # however slow the machine
        while client.leased_granules < 2 and time.monotonic() < deadline:
            time.sleep(0.002)

    rng = random.Random(int(sys.argv[1]))
    scratch = ExtensibleTensor(16 << 20, "cpu", client=client)
    scratch.resize_(2 << 20)  # a commit of one granule through the daemon: a lease follows it
    wait_for_lease()
    print("ready", flush=True)
    while True:
        choice = rng.random()
        if choice < 0.5 and kv.segment_sizes[0] < SEGMENT:
            old = kv.segment_sizes[0]
            if rng.random() < 0.8:
                wait_for_lease()  # most commits then place leased granules
            in_hand = client.leased_granules >= 2
            step = rng.choice((2 << 20, 4 << 20)) if old + (4 << 20) <= SEGMENT else 2 << 20
            sent = client.requests_sent
            kv.resize_per_segment_(old + step)
            for segment in (0, 1):
                write(kv, segment, old, old + step)
            # Written and reported after the commit returned: the daemon must have it whatever comes next.
            print("committed", kv.segment_sizes[0], int(client.requests_sent == sent), step, int(in_hand), flush=True)
        elif choice < 0.75:
            kv.defragment(preserve=True)
        elif scratch.num_bytes < (16 << 20):
            scratch.resize_(scratch.num_bytes + (2 << 20))
            scratch.defragment(preserve=False)
    """
).replace("SEGMENT", str(SEGMENT))


def expected_page(segment: int, offset: int) -> int:
    return (offset // PAGE + 7 * segment) % 251 + 1


def check(kv: ExtensibleTensor, confirmed: list[int]) -> tuple[int, int]:
    """(pages intact, pages the kill cut short); fails on any byte that is neither the pattern nor zero."""
    intact = cut = 0
    for segment, size in enumerate(kv.segment_sizes):
        data = ctypes.string_at(kv.base_ptr + kv.segment_offsets[segment], size)
        for start in range(0, size, PAGE):
            value = expected_page(segment, start)
            page = data[start : start + PAGE]
            if page == bytes([value]) * PAGE:
                intact += 1
                continue
            assert start >= confirmed[segment], f"segment {segment} page at {start} lost its data"
            assert page.replace(bytes([value]), b"").strip(b"\x00") == b"", (
                f"segment {segment} page at {start} is garbage"
            )
            cut += 1
    return intact, cut


def confirm(kv: ExtensibleTensor, confirmed: list[int]) -> list[int]:
    """Write the pattern over what the worker committed but may not have written; that is now confirmed too."""
    for segment, size in enumerate(kv.segment_sizes):
        base = kv.base_ptr + kv.segment_offsets[segment]
        for start in range(confirmed[segment], size, PAGE):
            ctypes.memset(base + start, expected_page(segment, start), PAGE)
    return list(kv.segment_sizes)


@pytest.mark.torch
@pytest.mark.system
def test_workers_killed_at_random_points_lose_no_byte_and_leak_nothing(daemon, client):
    rng = random.Random(20261202)
    env = dict(os.environ, HBMD_RUN_DIR=str(daemon.run_dir))
    confirmed = [0, 0]
    client.status()  # the daemon opens /proc/meminfo once, at the first status
    fds_before = daemon.open_fds()
    pages_checked = pages_cut = commits = granule_steps = in_hand = missed = leased = on_credit = 0
    started = time.monotonic()
    for round_number in range(ROUNDS):
        worker = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(round_number)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            if rng.random() < 0.2:
                time.sleep(rng.uniform(0, 0.3))  # may land inside the attach itself
            else:
                assert worker.stdout.readline().strip() == "ready"
                time.sleep(rng.uniform(0, 0.15))
        finally:
            worker.send_signal(signal.SIGKILL)
            status = worker.wait(10)
            errors = worker.stderr.read()
            # Each report is one write of a short line: whole, or (killed in the print) not there at all.
            reports = [line.split() for line in worker.stdout.read().splitlines() if line.startswith("committed ")]
            worker.stdout.close()
            worker.stderr.close()
        assert status == -signal.SIGKILL, f"round {round_number}: the worker died of its own: {errors[-2000:]}"
        kv = ExtensibleTensor.attach("kv", "cpu", client=client) if any(
            b.name == "kv" for b in client.buffers()
        ) else None
        if kv is None:  # killed before it created the buffer
            continue
        if reports:
            reported = int(reports[-1][1])
            assert kv.segment_sizes[0] >= reported, f"round {round_number}: commits that returned were lost"
            confirmed = [max(c, reported) for c in confirmed]
            commits += len(reports)
            granule_steps += sum(int(r[3]) == GRANULE for r in reports)
            in_hand += sum(int(r[4]) for r in reports if int(r[3]) == GRANULE)
            missed += sum(int(r[4]) and not int(r[2]) for r in reports if int(r[3]) == GRANULE)
            leased += sum(int(r[2]) for r in reports if int(r[3]) == GRANULE)
            on_credit += sum(int(r[2]) for r in reports if int(r[3]) != GRANULE)
        intact, cut = check(kv, confirmed)
        pages_checked += intact + cut
        pages_cut += cut
        confirmed = confirm(kv, confirmed)
        if kv.segment_sizes[0] == SEGMENT:
            kv.release_physical()
            confirmed = [0, 0]
        kv.detach()

        def settled() -> bool:
            status = client.status()
            return status.num_sessions == 1 and status.committed_bytes == kv.physical_bytes

        wait_until(settled, timeout=10)  # the dead worker's session and scratch buffer are gone
    assert daemon.alive()
    client.delete("kv")
    wait_until(lambda: daemon.open_fds() == fds_before, timeout=10)
    assert client.status().committed_bytes == 0
    assert in_hand > 0, f"none of {granule_steps} one-granule commits found two leased granules ready"
    assert not missed, f"{missed} of {in_hand} one-granule commits went to the daemon with the lease in hand"
    print(
        f"\nkill loop: rounds={ROUNDS}, commits reported={commits} ({leased} from the lease, {in_hand} of "
        f"{granule_steps} one-granule commits with it in hand, {on_credit} on credit), pages checked="
        f"{pages_checked}, pages cut short by the kill={pages_cut}, bytes lost=0, leaked sessions=0, leaked FDs=0, "
        f"{time.monotonic() - started:.1f}s"
    )
