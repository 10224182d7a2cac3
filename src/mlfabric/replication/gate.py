"""Worker-driven replication's decision: hold server transfers, without I/O.

Workers send each update to the server and, once the server numbered it,
straight to the replica (see `replica_feed.py`), so replica transfers never
wait for the controller: they are always ahead of the next server transfer.
What the controller can do to keep ||w_s - w_r|| <= Div_max is hold the
next server transfers back until the replica has caught up far enough.
`gated` wraps any policy with that rule, using a `DivergenceGate`.

With aggregation the gate wraps the policy that routes groups
(`gated(aggregating(policy))`), so that it sees the groups: a group is one
step of the server, admitted or held as a whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from ..scheduling.plan import PlanItem, Policy, Snapshot, Transfer
from .divergence import DivergenceGate


def in_flight_norms(active: Iterable[Transfer], shard: int = 0) -> list[float]:
    """The norms of the steps let go to `shard`'s server and not reported
    yet, as `DivergenceGate.bound` takes them: an update alone is one step;
    the members of one aggregate still in flight are one step of their
    summed norms, as `gated` admitted them.

    Why the bound stays an upper bound while an aggregate is reported member
    by member: the members that reported are one lagging step of their
    summed norms (not folded: `Step.known`), those still in flight one item
    here of theirs; together they count sum n_i >= ||A|| (the triangle
    inequality) in two items where the server took one step of ||A||, and
    splitting a lagging step into items that sum to at least its norm never
    lowers the bound (`divergence`, "Aggregates"). If the server's exact
    norm arrives first, the members in flight count twice until they
    report: higher still. One case is not covered: an aggregate whose
    aggregator fails has its members re-sent one by one, k steps where the
    gate counted one, until they report (each then as a step alone)."""
    norms: list[float] = []
    groups: dict[int, int] = {}  # group id -> its item in `norms`
    for t in active:
        if t.shard != shard:
            continue
        if t.route is None:
            norms.append(t.norm)
        elif t.route.group in groups:
            norms[groups[t.route.group]] += t.norm
        else:
            groups[t.route.group] = len(norms)
            norms.append(t.norm)
    return norms


def gated(policy: Policy, gate: DivergenceGate | Mapping[int, DivergenceGate]) -> Policy:
    """`policy`, except that a transfer it starts now stays pending when
    letting it go could take the divergence bound past `gate.div_max`. A
    held transfer is planned for the moment the gate would give up holding
    (`gate.release_at()`), so the controller re-plans then even if no other
    event comes; it is asked again at every event before that (e.g. the
    replica's progress).

    A group `policy` routed through an aggregator (`PlanItem.route`) is one
    step of the server: it is admitted as one of norm the sum of its
    members' norms, and all its members go or none does (a member held alone
    would make the aggregator wait for it until its group timeout). A held
    group's members lose their route: the next plan groups them afresh.

    With sharded servers `gate` maps each shard to its own gate: the
    controller plans one shard at a time, and a snapshot's transfers are
    held by their shard's gate, against that shard's transfers in flight."""

    gates = gate

    def gated_policy(snap: Snapshot) -> Sequence[PlanItem]:
        shard = snap.pending[0].shard if snap.pending else 0
        gate = gates.get(shard) if isinstance(gates, Mapping) else gates
        if gate is None:
            return policy(snap)  # a shard without a bound: nothing to hold
        flying = in_flight_norms(snap.active, shard)
        if gate.stalled:
            gate.recheck(flying)
        norms = {t.id: t.norm for t in snap.pending}
        items = list(policy(snap))

        def due(item: PlanItem) -> bool:
            return item.drop is None and item.start is not None and item.start <= snap.now

        # Each group's members due now, to decide on the group at its first.
        groups: dict[int, list[int]] = {}
        for item in items:
            if item.route is not None and due(item):
                groups.setdefault(item.route.group, []).append(item.id)
        admitted: dict[int, bool] = {}

        def admit(ids: Sequence[int]) -> bool:
            norm = sum(norms[i] for i in ids)
            if not gate.admit(flying, norm, snap.now):
                gate.held += len(ids)
                return False
            flying.append(norm)
            return True

        plan = []
        for item in items:
            if not due(item):
                plan.append(item)
                continue
            if item.route is None:
                ok = admit((item.id,))
            else:
                group = item.route.group
                if group not in admitted:
                    admitted[group] = admit(groups[group])
                ok = admitted[group]
            plan.append(item if ok else PlanItem(item.id, start=gate.release_at()))
        return plan

    gated_policy.__name__ = f"{getattr(policy, '__name__', 'policy')}+div_max"
    return gated_policy
