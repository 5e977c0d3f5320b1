"""One session floods the daemon with the costliest messages it can build; another session does not notice.

The flooders and the engine are :mod:`hbmd.testing.flood`'s: placements the
daemon must refuse (handle plane), refused hellos each naming a tenant of
its own, or pipelined commits the budget refuses (control plane), on one
control connection or on 64, as the engine's uid or as another. Meanwhile an
engine commits and asks for status every 100 ms, newcomers connect and an
operator runs ``hbmctl status``, and at the end the daemon is sent SIGTERM.
What is checked here holds whatever else loads the machine: no call of the
engine, no newcomer and no ``hbmctl`` fails or times out, a refused hello
leaves no tenant behind, and SIGTERM ends the daemon. How much the flood
slows the engine's calls, against the same daemon's calls alone in the same
run, is ``bench/flood_bench.py``'s measure: an absolute latency on a shared
machine measures its other load as much as the daemon.
``HBMD_FLOOD_SECONDS`` sets how long each flood is measured (default 8).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest
from hbmd.client import ExtensibleTensor
from hbmd.testing.flood import FLOODS, Flooder, can_flood_as_nobody, engine_calls
from helpers import GRANULE, MiB, hbmctl

pytestmark = [pytest.mark.flood, pytest.mark.ipc, pytest.mark.torch]  # the engine grows through its views

FLOOD_SECONDS = float(os.environ.get("HBMD_FLOOD_SECONDS", "8"))
OPERATOR_EVERY_S = 1.5


@pytest.mark.parametrize("flood", list(FLOODS))
def test_a_flood_on_one_plane_fails_no_call_of_another_peer(start_daemon, run_dir, flood):
    if not can_flood_as_nobody(flood):
        pytest.skip("needs root to flood as a second uid")
    as_nobody = FLOODS[flood][2]
    if as_nobody:
        os.chmod(run_dir, 0o755)
    daemon = start_daemon("--budget", "128MiB", *(("--group", "nogroup") if as_nobody else ()))
    engine = daemon.connect(client_name="engine", resume_timeout=1)  # the daemon is stopped for good at the end
    kv = ExtensibleTensor(32 * MiB, "cpu", client=engine)
    kv.resize_(GRANULE)  # the first view loads torch: not the daemon's time
    flooder = Flooder(run_dir, flood)
    ends = time.monotonic() + FLOOD_SECONDS
    errors: list[str] = []
    newcomers: list[str] = []
    operators: list[int] = []

    def operate() -> None:
        """A newcomer connects and an operator asks for status, now and then, beside the engine."""
        while time.monotonic() < ends:
            try:
                daemon.connect(client_name="newcomer", timeout=5).close()
                newcomers.append("answered")
                operators.append(hbmctl("--run-dir", str(daemon.run_dir), "--timeout", "5", "status").returncode)
            except Exception as exc:  # every failure is counted, not just the first
                errors.append(f"newcomer: {type(exc).__name__}: {exc}")
            time.sleep(OPERATOR_EVERY_S)  # an operator's pace, not a wait for a state

    operator = threading.Thread(target=operate)
    try:
        operator.start()
        calls, failed = engine_calls(kv, FLOOD_SECONDS)
        errors += failed
        operator.join()
        squatted = [t.name for t in engine.status().tenants if t.name.startswith("squat-")]
    finally:
        flooder.kill()
    daemon.proc.send_signal(signal.SIGTERM)
    try:
        daemon.proc.wait(10)
    except subprocess.TimeoutExpired:
        pass  # reported below
    engine.close()
    print(f"flood of {flood}: {len(calls)} calls, max {max(calls) * 1e3:.1f} ms, {len(errors)} errors "
          "(bench/flood_bench.py times them against the same daemon's calls alone)")
    assert errors == []  # every call answered within its client's timeout, the engine's and the newcomers'
    assert squatted == []  # a refused hello leaves no tenant behind
    assert newcomers and operators and set(operators) == {0}
    assert daemon.proc.returncode is not None, "the daemon did not exit within 10 s of SIGTERM"
