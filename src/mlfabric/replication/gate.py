"""Worker-driven replication's decision: hold server transfers, without I/O.

Workers send each update to the server and, once the server numbered it,
straight to the replica (see `replica_feed.py`), so replica transfers never
wait for the controller: they are always ahead of the next server transfer.
What the controller can do to keep ||w_s - w_r|| <= Div_max is hold the
next server transfers back until the replica has caught up far enough.
`gated` wraps any policy with that rule, using a `DivergenceGate`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..scheduling.plan import PlanItem, Policy, Snapshot
from .divergence import DivergenceGate


def gated(policy: Policy, gate: DivergenceGate | Mapping[int, DivergenceGate]) -> Policy:
    """`policy`, except that a transfer it starts now stays pending when
    letting it go could take the divergence bound past `gate.div_max`. A
    held transfer is planned for the moment the gate would give up holding
    (`gate.release_at()`), so the controller re-plans then even if no other
    event comes; it is asked again at every event before that (e.g. the
    replica's progress).

    With sharded servers `gate` maps each shard to its own gate: the
    controller plans one shard at a time, and a snapshot's transfers are
    held by their shard's gate, against that shard's transfers in flight."""

    gates = gate

    def gated_policy(snap: Snapshot) -> Sequence[PlanItem]:
        shard = snap.pending[0].shard if snap.pending else 0
        gate = gates.get(shard) if isinstance(gates, Mapping) else gates
        if gate is None:
            return policy(snap)  # a shard without a bound: nothing to hold
        flying = [t.norm for t in snap.active if t.shard == shard]
        if gate.stalled:
            gate.recheck(flying)
        norms = {t.id: t.norm for t in snap.pending}
        plan = []
        for item in policy(snap):
            if item.drop is None and item.start is not None and item.start <= snap.now:
                norm = norms[item.id]
                if not gate.admit(flying, norm, snap.now):
                    gate.held += 1
                    plan.append(PlanItem(item.id, start=gate.release_at()))
                    continue
                flying.append(norm)
            plan.append(item)
        return plan

    gated_policy.__name__ = f"{getattr(policy, '__name__', 'policy')}+div_max"
    return gated_policy
