"""The controller's `mlfabric` policy: the scheduling core (`schedule.plan_rows`)
fed from the controller's state.

The core plans with reservations on links; the controller knows, for each
transfer it let go, when it started and how long the plan expected it to
take. A transfer that outlives its plan still holds its link: its
reservation is extended a little past now, so the next transfer waits for
its completion report (which triggers a re-plan) instead of overlapping it.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import cast

import numpy as np

from . import schedule
from .plan import ColumnPlan, PlanItem, Snapshot

# An overdue transfer is assumed to need this fraction of its planned time more.
_OVERDUE_EXTENSION = 0.25
_MIN_SECONDS = 1e-6


def _network(snap: Snapshot) -> schedule.Capacities:
    net = snap.network
    # The controller's hosts are strings; the core takes any hashable
    # (Mapping is invariant in its key type, hence the casts).
    return schedule.Capacities(up=cast(Mapping[schedule.Host, float], net.up_rates),
                            down=cast(Mapping[schedule.Host, float], net.down_rates),
                            pair=cast(Mapping[tuple[schedule.Host, schedule.Host], float],
                                      net.pair))


# The tie order among otherwise equal transfers (see mlfabric_policy).
_EARLIEST_DEADLINE_FIRST = operator.attrgetter("base_version", "arrival", "id")


def mlfabric_policy(snap: Snapshot, *, idle_factor: float | None = 1.0,
                    overload: str = "stalest") -> ColumnPlan:
    """Shortest-transfer-first with deadlines and drops (docs/scheduling.md)."""
    running = []
    forwards: dict[int, schedule.RunningTransfer] = {}
    for t in snap.active:
        planned = max(t.planned_seconds or _MIN_SECONDS, _MIN_SECONDS)
        started = t.started if t.started is not None else snap.now
        end = max(started + planned, snap.now + _OVERDUE_EXTENSION * planned)
        # Running ids only need to differ from each other (pending ids are rows).
        if t.route is None:
            running.append(schedule.RunningTransfer(-t.id, t.host, t.dst,
                                                    rate=t.nbytes / planned, end=end))
            continue
        # Through an aggregator: the member's leg to it, and once per group
        # the aggregate's forward into the server (its downlink is what the
        # group's plan reserved).
        running.append(schedule.RunningTransfer(-t.id, t.host, t.route.host,
                                                rate=t.nbytes / planned, end=end))
        fwd_id = -(1 << 40) - t.route.group
        if fwd_id not in forwards:
            forwards[fwd_id] = schedule.RunningTransfer(
                fwd_id, t.route.host, t.dst, rate=snap.network.rate(t.route.host, t.dst),
                end=end)
    running.extend(forwards.values())
    # The core breaks ties between equal transfers by row. Hand it rows ranked
    # earliest deadline first (oldest base version, then earliest arrival):
    # among equal transfers the stalest goes first, which spreads delays
    # least. (Freshest first, measured too, lowered the mean delay by 1-2% but
    # raised its standard deviation by 10-15%: benchmarks/RESULTS.md.)
    ranked = sorted(snap.pending, key=_EARLIEST_DEADLINE_FIRST)
    n = len(ranked)
    rows = schedule.Rows([t.host for t in ranked], [t.dst for t in ranked],
                         np.fromiter((t.nbytes for t in ranked), np.float64, n),
                         np.fromiter((t.base_version for t in ranked), np.int64, n))
    result = schedule.plan_rows(
        snap.now, rows, running, _network(snap),
        schedule.ServerState(snap.version, in_flight=snap.server_in_flight),
        schedule.PlanConfig(policy="mlfabric", tau_max=snap.tau_max, idle_factor=idle_factor,
                            overload=overload),
    )
    drops = []
    for k, reason, position, idle, displaced in zip(result.drop_row, result.reason,
                                                     result.drop_position, result.idle,
                                                     result.displaced, strict=True):
        detail = f"at position {position}"
        if reason == schedule.STALEST_IN_OVERLOAD:
            detail = (f"base version {ranked[k].base_version}: the queue cannot meet "
                      f"every deadline, so its stalest updates go")
        elif reason == schedule.WOULD_IDLE_SERVER:
            detail += (f": would idle the server {idle:.3f} s to place transfers of "
                       f"{displaced:.3f} s")
        drops.append(PlanItem(ranked[k].id, drop=reason, detail=detail))
    # Most sends start later: their items are built only if someone reads them.
    return ColumnPlan([ranked[k].id for k in result.send_row], result.start, result.end,
                      result.position, drops)
