"""A restart-chaos soak: the daemon restarted over and over while engines graft the KV cache their predecessors left
and a stalling peer streams at the control socket beside them (issue #61).

    python3 bench/chaos_soak.py [--seconds 180] [--out FILE]

On the host backend, under the systemd stand-in that keeps every chunk
(``tests/fake_systemd.py``), with a journal: every few seconds the daemon is
SIGKILLed and started again on what the store kept (a crash), SIGTERMed and
started again (an upgrade), or taken over by a successor (``--takeover``),
in turn. Meanwhile:

- **engines**, one after another, each a process: engine *g* makes its own
  persistent buffer of two segments, grafts the orphan engine *g-1* left,
  checks every byte of it against the pattern *g-1* wrote, writes its own
  pattern over all of it and exits, leaving its buffer an orphan for *g+1*;
- **a stalling peer**, a process streaming ZMTP PINGs on one control
  connection and trickling a message that never ends, a byte every 0.5 s,
  on another, connecting again after every restart;
- **an honest peer**, a client asking for status in a loop: the longest wait
  between two answers, over the whole run and away from the restarts (from
  a restart's start to a second after its daemon serves).

It reports restarts, grafts, bytes verified, wrong bytes (none may be), the
honest peer's failed calls (none may be) and its worst waits.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from common import RESULTS_DIR, metadata, today_utc, write_json
from hbmd.testing.restarts import CallsInALoop
from restart_bench import Instance

ENGINE = r"""
import ctypes, json, sys, time
from hbmd.client import Conflict, DaemonUnavailable, ExtensibleTensor, NotFound, connect

gen, run_dir = int(sys.argv[1]), sys.argv[2]
SEGMENT = 16 << 20

def expected(g, segment):
    tile = bytes((g * 7 + segment * 13 + i) % 251 for i in range(4099))  # not a power of two: offsets show
    return (tile * (SEGMENT // len(tile) + 1))[:SEGMENT]

started = time.monotonic()
while True:  # a new client is refused while a crashed daemon's successor starts (no socket activation here)
    try:
        client = connect("cpu", run_dir=run_dir, client_name=f"engine-{gen}", timeout=60, lease=False)
        break
    except DaemonUnavailable:
        if time.monotonic() - started > 60:
            raise
        time.sleep(0.1)
kv = ExtensibleTensor(2 * SEGMENT, "cpu", num_segments=2, client=client, name=f"kv-{gen}", persistent=True)
verified = wrong = 0
if gen:
    deadline = time.monotonic() + 60
    while True:
        try:
            kv.graft(f"kv-{gen - 1}")
            break
        except (Conflict, NotFound):  # its predecessor's session not ended yet across a restart
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    for segment in (0, 1):
        got = ctypes.string_at(kv.base_ptr + kv.segment_offsets[segment], SEGMENT)
        want = expected(gen - 1, segment)
        verified += SEGMENT
        if got != want:
            wrong += sum(a != b for a, b in zip(got, want))
else:
    kv.resize_per_segment_(SEGMENT)
for segment in (0, 1):
    ctypes.memmove(kv.base_ptr + kv.segment_offsets[segment], expected(gen, segment), SEGMENT)
print(json.dumps({"gen": gen, "grafted": bool(gen), "verified": verified, "wrong": wrong,
                  "seconds": round(time.monotonic() - started, 3)}), flush=True)
"""

STALLER = r"""
import json, select, signal, socket, struct, sys, time
path = sys.argv[1]
GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x01" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)
READY_BODY = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
READY = b"\x04" + bytes([len(READY_BODY)]) + READY_BODY
PINGS = b"\x04\x07\x04PING\x00\x00" * 8192

def connected():
    while True:
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            sock.sendall(GREETING + READY)
            sock.setblocking(False)
            return sock
        except OSError:
            sock.close()
            time.sleep(0.05)

counts = {"ping_bytes": 0, "trickled_bytes": 0, "reconnects": 0}
def report(*_):
    print(json.dumps(counts), flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, report)
streamer, trickler = connected(), connected()
trickler.send(b"\x02" + struct.pack(">Q", 1 << 20))  # a message of 1 MiB, a byte at a time
view, trickled_at = memoryview(PINGS), time.monotonic()
while True:
    writable = select.select([], [streamer], [], 0.1)[1]
    try:
        if writable:
            sent = streamer.send(view)
            counts["ping_bytes"] += sent
            view = view[sent:] if sent < len(view) else memoryview(PINGS)
    except OSError:
        streamer.close()
        streamer, view = connected(), memoryview(PINGS)
        counts["reconnects"] += 1
    if time.monotonic() - trickled_at >= 0.5:
        trickled_at = time.monotonic()
        try:
            counts["trickled_bytes"] += trickler.send(b"t")
        except OSError:
            trickler.close()
            trickler = connected()
            trickler.send(b"\x02" + struct.pack(">Q", 1 << 20))
"""


class Engines:
    """Engine processes one after another, on a thread: each grafts its predecessor's orphan and checks its bytes."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.results: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        gen = 0
        while not self._stop.is_set():
            engine = subprocess.run([sys.executable, "-c", ENGINE, str(gen), str(self.run_dir)],
                                    capture_output=True, text=True, timeout=300)
            if engine.returncode != 0:
                self.failures.append(f"engine {gen}: {engine.stderr.strip().splitlines()[-1:]}")
                return  # its successor would find no orphan of its own to graft
            self.results.append(json.loads(engine.stdout.strip().splitlines()[-1]))
            gen += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(400)


def soak(seconds: float, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    instance = Instance("host", kept=True, restartable=True, args=("--check-invariants",))
    control = os.fspath(instance.run_dir / "host" / "control.sock")
    staller = subprocess.Popen([sys.executable, "-c", STALLER, control], stdout=subprocess.PIPE, text=True)
    honest = instance.connect(client_name="honest", timeout=60)
    calls = CallsInALoop(honest)
    engines = Engines(instance.run_dir)
    restarts: list[tuple[str, float, float]] = []
    try:
        ends = time.monotonic() + seconds
        hows = ("crash", "upgrade", "takeover")
        while time.monotonic() < ends and not engines.failures:
            time.sleep(rng.uniform(2.0, 6.0))
            how = hows[len(restarts) % len(hows)]
            began = time.monotonic()
            {"crash": instance.crash, "upgrade": instance.upgrade, "takeover": instance.take_over}[how]()
            restarts.append((how, began, time.monotonic()))
    finally:
        engines.stop()
        gaps = calls.stop()
        staller.terminate()
        stalled = json.loads(staller.communicate(timeout=10)[0].strip().splitlines()[-1])
        honest.close()
        logs = "".join(path.read_text(errors="replace") for path in sorted(instance.run_dir.glob("hbmd-*.log")))
        instance.close()
    answered = calls.answered_at
    away = [b - a for a, b in itertools.pairwise(answered)
            if not any(a < serving + 1.0 and b > began for _, began, serving in restarts)]
    results = engines.results
    return {
        "seconds": seconds,
        "restarts": len(restarts),
        "restarts_by_kind": {how: sum(r[0] == how for r in restarts) for how in ("crash", "upgrade", "takeover")},
        "grafts": sum(r["grafted"] for r in results),
        "engines": len(results),
        "bytes_verified": sum(r["verified"] for r in results),
        "wrong_bytes": sum(r["wrong"] for r in results),
        "engine_failures": engines.failures,
        "staller": stalled,
        "honest_calls": len(gaps),
        "honest_failed_calls": len(calls.failures),
        "honest_worst_wait_s": round(max(gaps), 3),
        "honest_worst_wait_away_from_restarts_s": round(max(away), 3) if away else None,
        "honest_p99_wait_away_from_restarts_ms": round(sorted(away)[int(len(away) * 0.99)] * 1e3, 2) if away else None,
        "restart_to_serving_s_max": round(max((s - b for _, b, s in restarts), default=0.0), 3),
        "invariant_violations": logs.count("an invariant does not hold"),
        "tracebacks": logs.count("Traceback"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--seed", type=int, default=61)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / f"host-{today_utc()}-chaos-soak.json")
    args = parser.parse_args()
    result = {"metadata": metadata(), "soak": soak(args.seconds, args.seed)}
    print(json.dumps(result["soak"], indent=1))
    write_json(args.out, result)
    return 1 if result["soak"]["wrong_bytes"] or result["soak"]["engine_failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
