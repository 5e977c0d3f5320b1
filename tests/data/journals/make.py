"""Make the journal an older hbmd leaves: ``python make.py OLD_PYTHONPATH OUT`` (see README.md).

Runs that checkout's daemon (host backend, ``--state-dir``, under a stand-in
for systemd's notify socket and FD store, so that it journals) and its
client (``client.py``), stops the daemon with SIGTERM under the live client,
and copies what the state directory holds to ``OUT``.
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))
from fake_systemd import FakeSystemd  # noqa: E402

old_path, out = sys.argv[1], Path(sys.argv[2])
root = Path(tempfile.mkdtemp(prefix="hbmd-j"))
(root / "run").mkdir()
(root / "state").mkdir()
systemd = FakeSystemd(root / "notify.sock")
env = {**os.environ, "PYTHONPATH": old_path, "HBMD_RUN_DIR": str(root / "run"), "NOTIFY_SOCKET": str(systemd.path)}
with open(root / "daemon.log", "w") as log:
    command = [sys.executable, "-m", "hbmd.daemon", "--backend", "host", "--run-dir", str(root / "run"),
               "--state-dir", str(root / "state"), "--budget", "256MiB"]
    daemon = subprocess.Popen(command, env=env, stdout=log, stderr=log)
try:
    deadline = time.monotonic() + 30
    while not systemd.saw("READY=1"):
        if time.monotonic() > deadline or daemon.poll() is not None:
            raise SystemExit((root / "daemon.log").read_text()[-2000:])
        time.sleep(0.05)
    client = subprocess.Popen([sys.executable, str(HERE / "client.py")], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert client.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    daemon.send_signal(signal.SIGTERM)
    daemon.wait(timeout=30)
    client.stdin.close()
    client.wait(timeout=60)
finally:
    if daemon.poll() is None:
        daemon.kill()
    print("parked:", sorted(systemd.names()))
    systemd.close()
shutil.copytree(root / "state", out, dirs_exist_ok=True)
shutil.rmtree(root)
