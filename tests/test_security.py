"""Attacks on a real daemon by its peers and by other users of the machine (see SECURITY.md).

Each test sends the attack to a real ``hbmd`` subprocess and checks that the
daemon refused it, stayed up with its books balanced, kept its FD count flat
and held no memory outside its budget.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import MiB

pytestmark = pytest.mark.ipc

NOBODY = 65534


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
