"""A soak of demotes under pressure: a demotable tenant's engine takes its buffers back, writes and puts them down
again, while another tenant's engine grows and frees as hard as it can.

Each of the batch engine's buffers is written only while taken back
(``set_idle(False)``) and put down idle after, so the daemon's demotes and
promotes race the engine's own turns and the other tenant's commits the whole
time. What must hold at every turn: a buffer taken back holds exactly what
was last written into it, wherever it has been since; nothing but the budget's
refusal (``OutOfBudget``) reaches either engine; the daemon serves to the end
and gives every byte back.

``HBMD_SOAK_S`` sets how long it runs (15 s here; hours on a node before a release).
"""

from __future__ import annotations

import os
import threading
import time

import pytest
from hbmd.client import ExtensibleTensor, OutOfBudget
from helpers import DEMOTABLE, MiB, filled, wait_until

pytestmark = [pytest.mark.ipc, pytest.mark.system, pytest.mark.torch]

SOAK_S = float(os.environ.get("HBMD_SOAK_S", "15"))
TIER = ("--host-budget", "96MiB", "--host-pool", "16MiB", "--host-piece", "8MiB")


class Engine(threading.Thread):
    """Runs ``turn`` until told to stop; what a turn raised other than a budget refusal ends it and is kept."""

    def __init__(self, name: str, turn) -> None:
        super().__init__(name=name)
        self.turn = turn
        self.stop = threading.Event()
        self.turns = self.refused = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    self.turn()
                except OutOfBudget:
                    self.refused += 1
                self.turns += 1
        except BaseException as exc:  # kept for the test to raise: a thread's exception is otherwise only printed
            self.error = exc


def taken_back(buffer: ExtensibleTensor) -> bool:
    try:
        buffer.set_idle(False)
    except OutOfBudget:
        return False
    return True


def test_demotes_under_pressure_lose_no_byte_written_and_crash_no_engine(start_daemon, tmp_path):
    config = tmp_path / "hbmd.toml"
    config.write_text(DEMOTABLE)
    daemon = start_daemon("--budget", "64MiB", *TIER, "--config", str(config), "--demote-idle", "0")
    batch = daemon.connect(client_name="batch", tenant="batch", lease=False)
    online = daemon.connect(client_name="online", tenant="online", lease=False)
    buffers = [ExtensibleTensor(32 * MiB, "cpu", client=batch, name=f"b{i}") for i in range(2)]
    last = [0, 0]
    wrong: list[tuple[int, str]] = []
    for index, buffer in enumerate(buffers):
        buffer.resize_(16 * MiB)
        buffer.segment_view(0)[:] = last[index] = index + 1
        buffer.set_idle()
    tiers_seen: set[str] = set()

    def batch_turn() -> None:
        index = batch_engine.turns % 2
        buffer = buffers[index]
        tiers_seen.add(buffer.tier)  # where it went while idle
        buffer.set_idle(False)  # refused while the device has no room: it stays down, idle, and is tried again
        if not filled(buffer.segment_view(0), last[index]):
            wrong.append((index, f"not the {last[index]} last written, after turn {batch_engine.turns}"))
        last[index] = last[index] % 250 + 1
        buffer.segment_view(0)[:] = last[index]
        buffer.set_idle()

    def online_turn() -> None:
        growing = ExtensibleTensor(64 * MiB, "cpu", client=online)
        try:
            growing.resize_(40 * MiB)  # more than the room the batch engine leaves: its idle buffers go down for it
            growing.segment_view(0)[:] = 7
        finally:
            growing.free()

    batch_engine, online_engine = Engine("batch", batch_turn), Engine("online", online_turn)
    for engine in (batch_engine, online_engine):
        engine.start()
    time.sleep(SOAK_S)
    for engine in (batch_engine, online_engine):
        engine.stop.set()
        engine.join(60)
    for engine in (batch_engine, online_engine):
        if engine.error is not None:
            raise engine.error
    print(f"demote soak: {SOAK_S:.0f}s, batch turns={batch_engine.turns} (refused {batch_engine.refused}), "
          f"online turns={online_engine.turns} (refused {online_engine.refused}), tiers seen {sorted(tiers_seen)}")
    assert wrong == []
    assert batch_engine.turns > 10 and online_engine.turns - online_engine.refused > 10  # both engines worked
    assert "host" in tiers_seen  # buffers were demoted under the writer's feet and came back
    for index, buffer in enumerate(buffers):
        wait_until(lambda b=buffer: taken_back(b))  # the online engine's memory is gone: there is room again
        assert buffer.tier == "device" and filled(buffer.segment_view(0), last[index])
    assert daemon.alive()
    for buffer in buffers:
        buffer.free()
    with daemon.connect(observer=True) as look:
        wait_until(lambda: (look.status().committed_bytes, look.status().host_bytes) == (0, 0))
    batch.close()
    online.close()
