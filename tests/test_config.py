"""The TOML config: access rules and tenant limits, and the admission they drive (unit level)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hbmd.daemon.backends.host import HostBackend
from hbmd.daemon.config import FORMAT, Access, ConfigError, parse_config
from hbmd.daemon.state import State
from hbmd.proto.errors import OutOfBudget, OutOfDeviceMemory, PermissionDenied
from helpers import MiB

pytestmark = pytest.mark.unit

GiB = 1 << 30
EXAMPLE = """
[access]
allow_uids = [1000]
allow_gids = [2000]

[[tenants]]
name = "big"
uids = [1000]
max = "80GiB"
guaranteed = "40GiB"

[[tenants]]
uid = 1001
max = "25%"
"""


def test_the_example_config_parses():
    config = parse_config(EXAMPLE, total_bytes=128 * GiB, budget_bytes=120 * GiB)
    big, by_uid = config.tenants
    assert (big.name, big.uids, big.max_bytes, big.guaranteed_bytes) == ("big", frozenset({1000}), 80 * GiB, 40 * GiB)
    assert (by_uid.name, by_uid.uid, by_uid.max_bytes, by_uid.guaranteed_bytes) == ("uid:1001", 1001, 32 * GiB, 0)
    assert config.access.admits(1000, {1000}) and config.access.admits(1234, {1234, 2000})
    assert not config.access.admits(1234, {1234}) and config.access.admits(0, {0})


def test_the_format_help_and_the_readme_show_is_a_config_the_daemon_takes():
    config = parse_config(FORMAT, total_bytes=128 * GiB, budget_bytes=120 * GiB)
    assert [(t.name, t.max_bytes, t.guaranteed_bytes, t.demote) for t in config.tenants] == [
        ("llama-70b", 80 * GiB, 40 * GiB, None), ("uid:1001", 64 * GiB, 0, None), ("batch", None, 0, 1)
    ]
    shown = subprocess.run([sys.executable, "-m", "hbmd.daemon", "--help"], capture_output=True, text=True, timeout=60)
    assert all(line.strip() in shown.stdout for line in FORMAT.splitlines())
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert f"```toml\n{FORMAT}```" in readme


@pytest.mark.parametrize(
    "text, match",
    [
        ("[access]\nallow_uids = 'x'", "list of non-negative integers"),
        ("[access]\nfrobnicate = 1", "unknown key"),
        ("[nonsense]\n", "unknown section"),
        ("[[tenants]]\nmax = '1GiB'", "exactly one of name or uid"),
        ("[[tenants]]\nname = 'a'\nuid = 3", "exactly one of name or uid"),
        ("[[tenants]]\nname = 'a'\nmax = 'lots'", "tenants\\[0\\].max"),
        ("[[tenants]]\nname = 'a'\nmax = '1GiB'\nguaranteed = '2GiB'",
         r"guaranteed \(2.0 GiB\) exceeds max \(1.0 GiB\)"),
        ("[[tenants]]\nname = 'a'\n[[tenants]]\nname = 'a'", "configured twice"),
        ("[[tenants]]\nname = 'a'\nguaranteed = '100GiB'", "over the budget"),
        ("[[tenants]]\nname = 'uid:7'", "not starting with 'uid:'"),
        ("[[tenants]]\nname = 'a'\ndemote = -1", "demote must be a non-negative integer"),
        ("[[tenants]]\nname = 'a'\ndemote = true", "demote must be a non-negative integer"),
        ("[[tenants]]\nname = 'a'\ndemote = 1\nguaranteed = '1GiB'", "never demoted"),
        ("this is = not toml =", "config"),
        ("[access]\nallow_uids = " + "[" * 5000 + "]" * 5000, "nested too deep"),
        ("x = " + "{a = " * 5000 + "1" + "}" * 5000, "nested too deep"),
    ],
)
def test_bad_configs_name_what_is_wrong(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(text, total_bytes=128 * GiB, budget_bytes=64 * GiB)


def test_no_access_rules_admit_everyone():
    assert Access().admits(4321, {4321})


@pytest.fixture
def state():
    config = parse_config(
        """
        [[tenants]]
        name = "a"
        max = "64MiB"
        guaranteed = "32MiB"
        [[tenants]]
        name = "b"
        uids = [1000]
        guaranteed = "64MiB"
        """,
        total_bytes=1 << 40,
        budget_bytes=256 * MiB,
    )
    return State(HostBackend(), 256 * MiB, config)


def commit(state, session, size):
    buf = state.buffers.create(session, size, 1)
    return state.commit(session, buf.buffer_id, size)


def test_a_tenant_cannot_burst_past_its_max(state):
    a = state.open_session(1, 1000, 1000, "", "a")
    commit(state, a, 60 * MiB)
    with pytest.raises(OutOfBudget, match="tenant 'a'") as info:
        commit(state, a, 8 * MiB)
    assert info.value.details["budget"] == 64 * MiB and info.value.details["used"] == 60 * MiB
    assert state.tenants.by_name["a"].used_bytes == 60 * MiB


def test_others_cannot_eat_into_a_guaranteed_minimum(state):
    other = state.open_session(2, 1002, 1002, "", "")
    # 256 MiB budget, 32 + 64 MiB guaranteed to a and b: 160 MiB for everyone else.
    commit(state, other, 160 * MiB)
    with pytest.raises(OutOfBudget, match="held for other tenants' guaranteed minimums") as info:
        commit(state, other, 2 * MiB)
    assert info.value.details["held"] == 96 * MiB
    b = state.open_session(3, 1000, 1000, "", "b")
    commit(state, b, 64 * MiB)  # its guarantee is there
    a = state.open_session(4, 1000, 1000, "", "a")
    commit(state, a, 32 * MiB)
    assert state.tenants.committed_bytes == 256 * MiB


def test_a_restricted_tenant_name_is_refused_to_other_uids(state):
    with pytest.raises(PermissionDenied, match="may not declare tenant 'b'"):
        state.open_session(5, 1001, 1001, "", "b")
    with pytest.raises(PermissionDenied):
        state.open_session(5, 1001, 1001, "", "uid:1000")
    assert state.open_session(5, 1001, 1001, "", "").tenant.name == "uid:1001"


def test_a_guaranteed_tenant_hitting_driver_oom_asks_borrowers_to_reclaim(state, monkeypatch):
    borrower = state.open_session(6, 1002, 1002, "", "")
    commit(state, borrower, 100 * MiB)
    b = state.open_session(7, 1000, 1000, "", "b")

    def out_of_memory(arena, offset, size, tier):
        raise OutOfDeviceMemory("device full", requested=size)

    monkeypatch.setattr(state.backend, "create", out_of_memory)
    with pytest.raises(OutOfDeviceMemory):
        commit(state, b, 48 * MiB)
    ((asked, reclaim),) = state.sessions.reclaims_due
    assert asked is borrower and reclaim.requested_bytes == 48 * MiB and "'b'" in reclaim.reason
    assert state.sessions.info(borrower).reclaim_state == "pending"
    state.sessions.reclaim_answered(borrower, reclaim.reclaim_id, 50 * MiB)
    assert state.sessions.info(borrower).reclaim_released_bytes == 50 * MiB


LIMITED = """
[[tenants]]
uid = 1001
max = "8MiB"

[[tenants]]
name = "open"
max = "1GiB"

[[tenants]]
name = "shared"
uids = [1001]
max = "16MiB"
"""


def test_a_declared_tenant_name_never_lifts_a_uids_limit():
    backend = HostBackend()
    state = State(backend, 1 << 30, parse_config(LIMITED, total_bytes=1 << 30, budget_bytes=1 << 30))
    # An unknown name is charged to the uid's entry.
    assert state.tenants.resolve(1001, "anything-else").name == "uid:1001"
    assert state.tenants.resolve(1001, "").name == "uid:1001"
    with pytest.raises(PermissionDenied, match="held to its own tenant"):
        state.tenants.resolve(1001, "open")
    assert state.tenants.resolve(1001, "shared").name == "shared"  # a tenant that names the uid, on purpose
    assert state.tenants.resolve(1002, "anything-else").name == "anything-else"  # a uid without limits: a label
    assert state.tenants.resolve(1002, "open").name == "open"
