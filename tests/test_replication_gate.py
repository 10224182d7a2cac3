"""Worker-driven replication's decision, with a fake clock: server transfers
are held while letting them go could take the divergence bound past div_max."""

from __future__ import annotations

from mlfabric.control import ControlState, fifo_policy
from mlfabric.divergence import DivergenceGate
from mlfabric.replication import gated


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
    assert first.wake_at is None and list(state.pending) == [3]
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
        from mlfabric.control import PlanItem

        a, b = snap.pending
        return [PlanItem(a.id, drop="deadline_missed", detail="x"), PlanItem(b.id, start=5.0)]

    state = ControlState(gated(policy, gate), tau_max=None)
    request(state, 1, norm=10.0)
    request(state, 2, norm=10.0)
    d = state.decide(now=0.0)
    assert [type(a).__name__ for a in d.actions] == ["Drop"] and d.wake_at == 5.0
    assert gate.held == 0
