"""Worker-driven replication's decision, with a fake clock: server transfers
are held while letting them go could take the divergence bound past div_max."""

from __future__ import annotations

from mlfabric.controller.state import ControlState
from mlfabric.replication.divergence import DEFAULT_LAG_TIMEOUT, DivergenceGate
from mlfabric.replication.gate import gated
from mlfabric.scheduling.plan import fifo_policy


def request(state, req, norm, now=0.0):
    return state.request("w", req, host="h1", dst="s", nbytes=1000, base_version=0,
                         norm=norm, now=now)


def test_server_transfers_wait_for_the_replica_then_go():
    gate = DivergenceGate(0.0, div_max=2.5)
    state = ControlState(gated(fifo_policy, gate), tau_max=None)
    for req in (1, 2, 3):
        request(state, req, norm=1.0)
    first = state.decide(now=0.0)
    # gamma 0: the bound is the sum of lagging norms; two fit in 2.5, not three.
    assert [a.transfer.req for a in first.actions] == [1, 2]
    # Held, and planned for when the gate would give up holding (lag timeout).
    assert first.wake_at == DEFAULT_LAG_TIMEOUT and list(state.pending) == [3]
    assert gate.held == 1
    # The server applied both, the replica neither: 3 would still be 3 > 2.5.
    for req, version in ((1, 1), (2, 2)):
        t = state.done("w", req, version=version)
        assert t is not None
        gate.server_applied(version, t.norm)
    assert state.decide(now=1.0).actions == () and gate.held == 2
    gate.replica_applied(1)
    assert [a.transfer.req for a in state.decide(now=2.0).actions] == [3]
    assert gate.bound([1.0]) == 2.0 and gate.overrides == 0


def test_drops_and_later_starts_pass_through_untouched():
    gate = DivergenceGate(0.9, div_max=0.1)

    def policy(snap):
        from mlfabric.scheduling.plan import PlanItem

        a, b = snap.pending
        return [PlanItem(a.id, drop="deadline_missed", detail="x"), PlanItem(b.id, start=5.0)]

    state = ControlState(gated(policy, gate), tau_max=None)
    request(state, 1, norm=10.0)
    request(state, 2, norm=10.0)
    d = state.decide(now=0.0)
    assert [type(a).__name__ for a in d.actions] == ["Drop"] and d.wake_at == 5.0
    assert gate.held == 0


def test_a_replica_that_makes_no_progress_is_given_up_after_the_lag_timeout():
    """The replica waits for an update that will not come: the gate holds for
    lag_timeout seconds, then lets transfers go (a stall, counted once) until
    the replica is back within div_max; then it holds again."""
    gate = DivergenceGate(0.0, div_max=2.5, lag_timeout=3.0)
    state = ControlState(gated(fifo_policy, gate), tau_max=None)
    for req in (1, 2, 3):
        request(state, req, norm=1.0)
    assert [a.transfer.req for a in state.decide(now=0.0).actions] == [1, 2]
    for req, version in ((1, 1), (2, 2)):
        state.done("w", req, version=version)
        gate.server_applied(version, 1.0)
    held = state.decide(now=1.0)
    assert held.actions == () and held.wake_at == 3.0 and not gate.stalled
    let_go = state.decide(now=3.0)
    assert [a.transfer.req for a in let_go.actions] == [3]
    assert gate.stalled and gate.stalls == 1
    state.done("w", 3, version=3)
    gate.server_applied(3, 1.0)
    request(state, 4, norm=1.0, now=3.5)
    assert [a.transfer.req for a in state.decide(now=3.5).actions] == [4]
    assert gate.stalls == 1  # one stall, however many transfers it lets go
    # The replica was resynced to version 4: within div_max again, it holds.
    state.done("w", 4, version=4)
    gate.start(4, 0.0)
    for req in (5, 6, 7):
        request(state, req, norm=1.0, now=4.0)
    again = state.decide(now=4.0)
    assert [a.transfer.req for a in again.actions] == [5, 6]
    assert not gate.stalled and again.wake_at == 7.0


def test_replica_progress_restarts_the_lag_timeout():
    gate = DivergenceGate(0.0, div_max=1.5, lag_timeout=3.0)
    state = ControlState(gated(fifo_policy, gate), tau_max=None)
    for req in (1, 2, 3):
        request(state, req, norm=1.0)
    assert [a.transfer.req for a in state.decide(now=0.0).actions] == [1]
    state.done("w", 1, version=1)
    gate.server_applied(1, 1.0)
    assert state.decide(now=0.5).wake_at == 3.0  # 2 is held since 0.0
    # The replica applied 1 at 2.0, and 2 goes; 3 is held from then on.
    gate.replica_applied(1)
    assert [a.transfer.req for a in state.decide(now=2.0).actions] == [2]
    state.done("w", 2, version=2)
    gate.server_applied(2, 1.0)
    assert state.decide(now=2.5).wake_at == 5.0
    assert state.decide(now=4.0).actions == () and not gate.stalled
    assert [a.transfer.req for a in state.decide(now=5.0).actions] == [3] and gate.stalled


def test_without_a_lag_timeout_the_gate_holds_for_ever():
    gate = DivergenceGate(0.0, div_max=1.5, lag_timeout=None)
    state = ControlState(gated(fifo_policy, gate), tau_max=None)
    for req in (1, 2):
        request(state, req, norm=1.0)
    assert [a.transfer.req for a in state.decide(now=0.0).actions] == [1]
    d = state.decide(now=1e6)
    assert d.actions == () and d.wake_at is None and gate.stalls == 0


def test_the_lag_timeout_must_be_positive():
    import pytest

    from mlfabric.errors import ConfigError

    with pytest.raises(ConfigError, match="--replica-lag-timeout must be positive, got 0"):
        DivergenceGate(0.5, 1.0, lag_timeout=0)
