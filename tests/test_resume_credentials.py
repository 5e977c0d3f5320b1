"""Resume credentials carry their own proof: a daemon that kept nothing starts a session over only for the process
that holds its credential, once."""

from __future__ import annotations

import os
import stat

import pytest
from hbmd.daemon.rundir import RESUME_KEY, resume_key
from hbmd.daemon.state.credentials import Credentials

pytestmark = pytest.mark.unit

KEY = bytes(range(32))


def test_only_a_credential_issued_to_that_session_of_that_uid_starts_it_over_and_only_once():
    credential = Credentials(KEY).issue(1000, 7)
    later = Credentials(KEY)  # the next run, same key
    assert not later.start_over(1001, 7, credential)  # another uid
    assert not later.start_over(1000, 8, credential)  # another session
    assert not later.start_over(1000, 7, credential[:-1] + ("0" if credential[-1] != "0" else "1"))  # forged
    assert not later.start_over(1000, 7, "0" * 32)  # what a 1.9 daemon issued, or anything made up
    assert not Credentials(b"k" * 32).start_over(1000, 7, credential)  # a key made anew
    assert later.start_over(1000, 7, credential)
    later.spend(credential)  # a session was opened on it
    assert not later.start_over(1000, 7, credential)


def test_the_key_outlasts_the_daemon_and_one_others_could_read_is_made_anew(tmp_path):
    directory = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        key = resume_key(directory)
        assert resume_key(directory) == key and len(key) == 32
        assert stat.S_IMODE((tmp_path / RESUME_KEY).stat().st_mode) == 0o600
        (tmp_path / RESUME_KEY).chmod(0o640)
        assert resume_key(directory) != key
        (tmp_path / RESUME_KEY).unlink()
        (tmp_path / RESUME_KEY).symlink_to(tmp_path / "elsewhere")
        assert len(resume_key(directory)) == 32 and not (tmp_path / "elsewhere").exists()
    finally:
        os.close(directory)
