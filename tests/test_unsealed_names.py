"""How long a persistent buffer's name has been held unsealed, counted by the daemon across every session that held it
(issue #61, 8c): an engine waits for another's seal of its weights only while that is shorter than it waits
(``wait_s``), and a process keeping the name unsealed cannot start the count over by handing the name to a new
session of its own, nor by deleting and making it again."""

from __future__ import annotations

import time

import pytest
from hbmd.daemon.backends.host import HostBackend
from hbmd.daemon.config import parse_config
from hbmd.daemon.state import State
from hbmd.daemon.state.unsealed import UNSEALED_NAME_KEPT_S
from hbmd.integrations.weights_key import not_a_store, storer_name, unsealed_for
from helpers import ManualClock, MiB

NAME = "vllm-weights:LlamaForCausalLM:llama:float32:tp0of1:pp0of1:0123456789abcdef"
STORER = storer_name(NAME)


def listed(client, name: str = NAME):
    (info,) = [b for b in client.buffers(name=name) if b.persistent]
    return info


def holder_of(client, info):
    (holder,) = client.sessions(session_id=info.session_id)
    return holder


@pytest.mark.ipc
def test_a_name_handed_to_new_sessions_keeps_its_age_and_no_engine_waits_past_wait_s(daemon):
    """A squatter under a storer's session name renews its claim through new sessions: a detach and an attach, then
    a delete and a create. The name's age goes on from its first claim, so once it is older than an engine waits,
    an engine is told not to wait, however young the session holding it now."""
    first = daemon.connect(client_name=STORER, tenant="")
    claim = first.create_buffer(32 * MiB, 1, name=NAME, persistent=True)
    since = listed(first).unsealed_since
    assert 0 < since <= time.time()
    time.sleep(0.5)  # the age the renewals below must keep, and the new sessions lack

    second = daemon.connect(client_name=STORER, tenant="")
    first.detach(claim.buffer_id)
    second.attach(NAME)
    info = listed(second)
    assert (info.session_id, info.unsealed_since) == (second.session_id, since)

    third = daemon.connect(client_name=STORER, tenant="")
    second.free(info.buffer_id)
    third.create_buffer(32 * MiB, 1, name=NAME, persistent=True)
    info = listed(third)
    assert (info.session_id, info.unsealed_since) == (third.session_id, since)

    holder = holder_of(third, info)
    held_s = unsealed_for(info, time.time())
    assert held_s >= holder.connected_s + 0.4
    wait_s = (held_s + holder.connected_s) / 2  # longer than the session has lived, shorter than the name has
    reason = not_a_store(NAME, holder, wait_s, held_s)
    assert f"is held unsealed by session {third.session_id}" in reason
    assert "longer than an engine waits for a store" in reason
    for c in (first, second, third):
        c.close()


@pytest.mark.ipc
def test_a_sealed_name_has_no_unsealed_age_and_a_name_made_after_its_seal_starts_anew(daemon):
    storer = daemon.connect(client_name=STORER, tenant="")
    buffer = storer.create_buffer(32 * MiB, 1, name=NAME, persistent=True)
    since = listed(storer).unsealed_since
    storer.seal(buffer.buffer_id)
    assert listed(storer).unsealed_since == 0
    anonymous = storer.create_buffer(32 * MiB, 1)
    assert [b.unsealed_since for b in storer.buffers() if b.buffer_id == anonymous.buffer_id] == [0]

    storer.free(buffer.buffer_id)
    time.sleep(0.05)
    again = daemon.connect(client_name=STORER, tenant="")
    again.create_buffer(32 * MiB, 1, name=NAME, persistent=True)
    assert listed(again).unsealed_since > since
    storer.close()
    again.close()


@pytest.mark.ipc
def test_a_restart_keeps_the_age_of_a_name_held_unsealed(restartable):
    holder = restartable.daemon.connect(client_name=STORER, tenant="")
    holder.create_buffer(32 * MiB, 1, name=NAME, persistent=True)
    since = listed(holder).unsealed_since
    restartable.restart("stop")
    assert listed(holder).unsealed_since == since
    holder.close()


def new_state(clock: ManualClock) -> State:
    budget = 64 * MiB
    return State(HostBackend(), budget, parse_config("", total_bytes=1 << 40, budget_bytes=budget), lease_bytes=0,
                 clock=clock)


@pytest.mark.unit
def test_a_name_dropped_unsealed_keeps_its_age_for_a_minute_then_starts_anew():
    clock = ManualClock()
    state = new_state(clock)
    session = state.open_session(pid=10, uid=1000, gid=1000, client_name=STORER, tenant="")
    first = state.buffers.create(session, 4 * MiB, 1, name=NAME, persistent=True)
    born = clock.unix()
    clock.advance(100)
    state.free(session, first.buffer_id)
    clock.advance(UNSEALED_NAME_KEPT_S)
    again = state.buffers.create(session, 4 * MiB, 1, name=NAME, persistent=True)
    assert again.unsealed_since == born

    state.free(session, again.buffer_id)
    clock.advance(UNSEALED_NAME_KEPT_S + 1)
    state.orphans.expire()  # forgets the names dropped longer ago than that
    assert state.buffers.unsealed_names.dropped == {}
    late = state.buffers.create(session, 4 * MiB, 1, name=NAME, persistent=True)
    assert late.unsealed_since == clock.unix()
    state.check_invariants()


@pytest.mark.unit
def test_the_names_kept_per_user_are_bounded_and_the_youngest_claim_goes_first():
    clock = ManualClock()
    state = new_state(clock)
    session = state.open_session(pid=10, uid=1000, gid=1000, client_name="churn", tenant="")
    most = state.buffers.limits.persistent_buffers_per_uid
    oldest = state.buffers.create(session, 4 * MiB, 1, name=NAME, persistent=True)
    for n in range(most + 10):
        clock.advance(0.1)
        churned = state.buffers.create(session, 4 * MiB, 1, name=f"churn-{n}", persistent=True)
        state.free(session, churned.buffer_id)
    state.free(session, oldest.buffer_id)
    kept = state.buffers.unsealed_names.dropped[1000]
    assert len(kept) == most and NAME in kept
    assert state.buffers.create(session, 4 * MiB, 1, name=NAME, persistent=True).unsealed_since == 1_800_000_000.0
    state.check_invariants()
