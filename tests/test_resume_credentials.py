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


def cold_start(before: Credentials, key: bytes = KEY) -> Credentials:
    """The daemon after ``before`` restarted with nothing kept: a new line, the instance directory naming the last."""
    after = Credentials(key)
    after.use_key(key, before.line)
    return after


def kept_restart(before: Credentials) -> Credentials:
    """The daemon after ``before`` restarted restoring its journal (or took over from it)."""
    after = Credentials(KEY)
    after.restored(before.record())
    after.use_key(KEY, before.line)
    return after


def test_only_a_credential_issued_to_that_session_of_that_uid_and_process_starts_it_over_and_only_once():
    first = Credentials(KEY)
    first.use_key(KEY, "")
    credential = first.issue(1000, 7, 4242)
    later = cold_start(first)
    assert not later.start_over(1001, 7, 4242, credential)  # another uid
    assert not later.start_over(1000, 8, 4242, credential)  # another session
    assert not later.start_over(1000, 7, 4243, credential)  # another process of the uid, which read it
    assert not later.start_over(1000, 7, 4242, credential[:-1] + ("0" if credential[-1] != "0" else "1"))  # forged
    assert not later.start_over(1000, 7, 4242, "0" * 32)  # what a 1.9 daemon issued, or anything made up
    assert not cold_start(first, b"k" * 32).start_over(1000, 7, 4242, credential)  # a key made anew
    assert later.start_over(1000, 7, 4242, credential)
    later.spend(7, credential)  # a session was opened on it
    assert not later.start_over(1000, 7, 4242, credential)
    assert not kept_restart(later).start_over(1000, 7, 4242, credential)  # spent, as the journal says


def test_a_session_its_own_line_of_daemons_ended_never_starts_over():
    """Its daemon restarted keeping the state, and ended the session its stopped process did not resume in time: the
    credential is of the line that ended it (issue #61)."""
    first = Credentials(KEY)
    first.use_key(KEY, "")
    credential = first.issue(1000, 7, 4242)
    assert not first.start_over(1000, 7, 4242, credential)  # this daemon's own: resumed, or ended
    kept = kept_restart(first)
    assert kept.line == first.line and not kept.start_over(1000, 7, 4242, credential)
    kept.lost(7)  # its journal's record was damaged: its client starts it over, once
    assert kept_restart(kept).start_over(1000, 7, 4242, credential)


def test_a_credential_starts_over_only_after_the_cold_start_that_follows_its_line():
    """The starts over outlive a cold start: the next one lets only the line just before it start over, so a
    credential cannot be replayed after every cold restart."""
    first = Credentials(KEY)
    first.use_key(KEY, "")
    credential = first.issue(1000, 7, 4242)
    second = cold_start(first)
    assert second.start_over(1000, 7, 4242, credential)
    third = cold_start(second)
    assert not third.start_over(1000, 7, 4242, credential)
    assert third.start_over(1000, 3, 4242, second.issue(1000, 3, 4242))


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
