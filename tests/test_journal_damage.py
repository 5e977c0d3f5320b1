"""One damaged journal record loses that session or buffer, logged, never the others and never the daemon (issue #51).

A real daemon journals three sessions (an engine with a lease, a KV cache
grown in steps and a persistent buffer; a loader whose weights are sealed; a
reader of them) and an orphan, and stops with its chunks parked. Each
mutation below damages one thing in a copy of that journal: a byte flipped,
bytes inserted, a torn end, or one record rewritten with a field dropped, of
the wrong type, out of range or naming another's id. A daemon restarted over
each, with the chunks passed back, must start, keep its invariants, restore
every record the damage did not touch, and name at WARNING what it lost.

What one lost record takes with it is by design: a session whose buffer did
not come back is not resumed (its process maps memory the daemon no longer
counts: it starts over and declares it), and a session that did not come
back takes its anonymous buffers with it, as a session's end does.
"""

from __future__ import annotations

import copy
import os
import random
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import DaemonProcess
from fake_systemd import FakeSystemd
from hbmd.daemon.restart.persist import Journal
from helpers import MiB, wait_until

pytestmark = [pytest.mark.ipc, pytest.mark.torch]

ARGS = ("--budget", "256MiB")

ENGINE = """
from hbmd.client import ExtensibleTensor, connect

c = connect("cpu", client_name="engine")
kv = ExtensibleTensor(64 << 20, "cpu", num_segments=2, client=c)
for step in range(1, 4):
    kv.resize_per_segment_(step * (4 << 20))
notes = ExtensibleTensor(16 << 20, "cpu", client=c, name="notes", persistent=True)
notes.resize_(4 << 20)
print("ready", flush=True)
input()
"""

LOADER = """
from hbmd.client import ExtensibleTensor, connect

c = connect("cpu", client_name="loader", lease=False)
weights = ExtensibleTensor(8 << 20, "cpu", client=c, name="weights", persistent=True)
weights.resize_(6 << 20)
weights.seal()
orphan = ExtensibleTensor(8 << 20, "cpu", client=c, name="orphan", persistent=True)
orphan.resize_(4 << 20)
orphan.detach()
print("ready", flush=True)
input()
"""

READER = """
from hbmd.client import ExtensibleTensor, connect

c = connect("cpu", client_name="reader", lease=False)
weights = ExtensibleTensor.attach("weights", "cpu", client=c, readonly=True)
print("ready", flush=True)
input()
"""


class Journaled:
    """What the first daemon journaled: the bytes, the chunks it parked (our own copies) and its records."""

    def __init__(self, journal: bytes, store: dict[str, list[int]], image: dict) -> None:
        self.bytes = journal
        self.store = store
        self.image = image
        self.sessions = {int(i): r for i, r in image["sessions"].items()}
        self.buffers = {int(i): r for i, r in image["buffers"].items()}

    def takes_with_it(self, kind: str, record_id: int) -> set[tuple[str, int]]:
        """What losing one record loses: itself, and what depends on it (see the module's docstring)."""
        lost = {(kind, record_id)}
        if kind == "b" and record_id in self.buffers:
            buffer = self.buffers[record_id]
            sessions = {int(buffer["owner"])} | {int(s) for s, _ in buffer["readers"]}
            lost |= {("s", s) for s in sessions - {0}}
        for _, session_id in [k for k in lost if k[0] == "s"]:
            lost |= {("b", i) for i, b in self.buffers.items() if int(b["owner"]) == session_id and not b["persistent"]}
        return lost


@pytest.fixture(scope="module")
def journaled(tmp_path_factory):
    import tempfile

    from conftest import Worker

    run_dir = Path(tempfile.mkdtemp(prefix="hbmd-", dir="/tmp"))
    state_dir = run_dir / "state"
    state_dir.mkdir()
    systemd = FakeSystemd(run_dir / "notify.sock")
    daemon = DaemonProcess(run_dir, *ARGS, "--state-dir", str(state_dir), env={"NOTIFY_SOCKET": str(systemd.path)})
    daemon.start()
    workers = []
    try:
        for code in (ENGINE, LOADER, READER):
            worker = Worker(daemon, code)
            workers.append(worker)
            assert worker.readline().strip() == "ready", worker.stderr_tail()
        journal = Journal(state_dir / "host.journal")
        wait_until(lambda: len(journal.read()["sessions"]) == 3 and len(journal.read()["buffers"]) == 4)
        for worker in workers:
            # Stopped, not gone: the restarted daemons keep their sessions waiting, and none is resumed.
            os.kill(worker.proc.pid, signal.SIGSTOP)
        assert daemon.stop() == 0
        with systemd.lock:
            store = {name: [os.dup(fd) for fd in fds] for name, fds in systemd.store.items()}
        yield Journaled(journal.path.read_bytes(), store, journal.read())
    finally:
        for worker in workers:
            worker.kill()
        daemon.kill()
        systemd.close()
        for fds in locals().get("store", {}).values():
            for fd in fds:
                os.close(fd)


def restart_over(journaled: Journaled, journal: bytes, where: Path) -> tuple[set[tuple[str, int]], str]:
    """Start a daemon over ``journal`` and the parked chunks; returns what it restored and its log. Asserts it
    started, held its invariants while asked, and stopped cleanly."""
    state_dir = where / "state"
    state_dir.mkdir(parents=True)
    (state_dir / "host.journal").write_bytes(journal)
    systemd = FakeSystemd(where / "notify.sock")
    with systemd.lock:
        systemd.store.update({name: [os.dup(fd) for fd in fds] for name, fds in journaled.store.items()})
    daemon = DaemonProcess(where, *ARGS, "--state-dir", str(state_dir), **systemd.relaunch())
    try:
        daemon.start()
        with daemon.connect(observer=True) as look:
            restored = {("s", s.session_id) for s in look.sessions() if s.resuming}
            restored |= {("b", b.buffer_id) for b in look.buffers()}
            look.status()
        assert daemon.stop() == 0, daemon.log()[-3000:]
        return restored, daemon.log()
    finally:
        daemon.kill()
        systemd.close()


def byte_mutations(journal: bytes) -> list[tuple[str, bytes]]:
    """Single faults of the bytes: a flipped byte at 30 places, garbage inserted at 4, a torn end, garbage after."""
    size = len(journal)
    flips = sorted({size * k // 30 for k in range(30)} | {size - 1})
    mutations = [(f"byte {at} flipped", journal[:at] + bytes([journal[at] ^ 0x5A]) + journal[at + 1:]) for at in flips]
    garbage = random.Random(51).randbytes(16)
    mutations += [(f"16 bytes inserted at {at}", journal[:at] + garbage + journal[at:])
                  for at in (size * k // 5 for k in range(1, 5))]
    mutations += [(f"torn {cut} bytes before the end", journal[:-cut]) for cut in (1, 7, 40)]
    mutations += [("garbage after the end", journal + garbage)]
    return mutations


def record_mutations(journaled: Journaled) -> list[tuple[str, dict, set[tuple[str, int]]]]:
    """Single faults of one record, rewritten as the daemon writes records: each with the records it touches."""
    sessions, buffers = journaled.sessions, journaled.buffers
    by_name = {b["name"]: i for i, b in buffers.items()}
    chunk_of_kv = buffers[by_name[""]]["chunks"][0][0]
    session_faults = [("uid", None), ("credential", None), ("pid", "x"), ("lease", 5), ("lease", [[1, 2, 3]]),
                      ("answer", [1, 2]), ("credit", -(2 * MiB)), ("credit", 1 << 60), ("tenant", 7), ("id", -3)]
    buffer_faults = [("capacity", None), ("chunks", None), ("owner", None), ("sizes", [-1]), ("capacity", 1 << 62),
                     ("capacities", [1 << 62]), ("chunks", [[chunk_of_kv, 0, 2 * MiB]]),
                     ("chunks", [[99, 1 << 40, 2 * MiB]]), ("chunks", [[99, 0, 12345]]), ("readers", [["x"]]),
                     ("held", [1, 2]), ("host", "x"), ("sealed", "maybe"), ("name", "notes"), ("owner", 999),
                     ("uid", -5), ("pending", [[7, 0, 2 * MiB]])]
    mutations = []
    for kind, records, faults in (("s", sessions, session_faults), ("b", buffers, buffer_faults)):
        for record_id in records:
            for field, value in faults:
                image = copy.deepcopy(journaled.image)
                changed = image["sessions" if kind == "s" else "buffers"][record_id]
                if value is None:
                    changed.pop(field, None)
                else:
                    changed[field] = value
                what = "dropped" if value is None else f"= {value!r}"[:40]
                touched = {(kind, record_id)}
                if field == "chunks" and value and value[0][0] == chunk_of_kv:
                    touched.add(("b", by_name[""]))  # two buffers now claim one chunk: either may be the one lost
                if field == "name" and value == "notes":
                    touched.add(("b", by_name["notes"]))
                mutations.append((f"{kind} {record_id} {field} {what}", image, touched))
        other = {"s": sessions, "b": buffers}[kind]
        first, second = list(other)[:2]
        image = copy.deepcopy(journaled.image)
        image["sessions" if kind == "s" else "buffers"][first]["id"] = second  # two records of one id
        mutations.append((f"{kind} {first} takes the id of {second}", image, {(kind, first), (kind, second)}))
    return mutations


def check(journaled: Journaled, what: str, restored: set[tuple[str, int]], log: str,
          touched: set[tuple[str, int]] | None) -> str:
    """An empty string where the restart kept what it should; else why not."""
    every = {("s", i) for i in journaled.sessions} | {("b", i) for i in journaled.buffers}
    lost = every - restored
    if touched is None:  # a fault of the bytes: any one record may be the one it hit
        candidates = [journaled.takes_with_it(*record) for record in every] + [set()]
        may_lose = next((c for c in candidates if lost <= c), None)
    else:
        may_lose = set().union(*(journaled.takes_with_it(*record) for record in touched))
    if may_lose is None or not lost <= may_lose:
        return f"{what}: lost {sorted(lost)}"
    reported = [line for line in log.splitlines() if "WARNING" in line or "ERROR" in line]
    for kind, record_id in lost:
        name = f"{'session' if kind == 's' else 'buffer'} {record_id}"
        if not any(name in line for line in reported):
            return f"{what}: lost {name} without a warning naming it"
    if restored - every:
        return f"{what}: restored {sorted(restored - every)}, which were never journaled"
    return ""


@pytest.mark.system
def test_the_untouched_journal_restores_everything(journaled, tmp_path):
    restored, _ = restart_over(journaled, journaled.bytes, tmp_path)
    assert restored == {("s", i) for i in journaled.sessions} | {("b", i) for i in journaled.buffers}
    assert len(journaled.sessions) == 3 and len(journaled.buffers) == 4


@pytest.mark.system
def test_one_damaged_record_loses_that_record_alone(journaled, tmp_path):
    runs: list[tuple[str, bytes, set[tuple[str, int]] | None]] = [
        (what, data, None) for what, data in byte_mutations(journaled.bytes)
    ]
    for what, image, touched in record_mutations(journaled):
        path = tmp_path / f"image-{len(runs)}"
        Journal(path).rewrite(image)
        runs.append((what, path.read_bytes(), touched))

    def run(index: int) -> str:
        what, data, touched = runs[index]
        try:
            restored, log = restart_over(journaled, data, tmp_path / f"run-{index}")
        except Exception as exc:  # the daemon did not start, died or broke an invariant
            return f"{what}: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"
        return check(journaled, what, restored, log, touched)

    with ThreadPoolExecutor(3) as pool:
        failures = [f for f in pool.map(run, range(len(runs))) if f]
    assert not failures, f"{len(failures)} of {len(runs)} mutations:\n" + "\n".join(failures)
