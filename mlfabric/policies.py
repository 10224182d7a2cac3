"""The controller's `mlfabric` policy: the scheduling core (`schedule.plan`)
fed from the controller's state.

The core plans with reservations on links; the controller knows, for each
transfer it let go, when it started and how long the plan expected it to
take. A transfer that outlives its plan still holds its link: its
reservation is extended a little past now, so the next transfer waits for
its completion report (which triggers a re-plan) instead of overlapping it.
"""

from __future__ import annotations

from . import schedule
from .control import PlanItem, Snapshot

# An overdue transfer is assumed to need this fraction of its planned time more.
_OVERDUE_EXTENSION = 0.25
_MIN_SECONDS = 1e-6


def _network(snap: Snapshot) -> schedule.Network:
    hosts = {t.host for t in (*snap.pending, *snap.active)}
    hosts |= {t.dst for t in (*snap.pending, *snap.active)}
    hosts |= {t.route.host for t in snap.active if t.route is not None}
    net = snap.network
    return schedule.Network(
        up={h: net.up_rate(h) for h in hosts},
        down={h: net.down_rate(h) for h in hosts},
        pair={(a, b): r for (a, b), r in net.pair.items()},
    )


def mlfabric_policy(snap: Snapshot, *, idle_factor: float | None = 1.0,
                    overload: str = "stalest") -> list[PlanItem]:
    """Shortest-transfer-first with deadlines and drops (docs/scheduling.md)."""
    running = []
    forwards: dict[int, schedule.RunningTransfer] = {}
    for t in snap.active:
        planned = max(t.planned_seconds or _MIN_SECONDS, _MIN_SECONDS)
        started = t.started if t.started is not None else snap.now
        end = max(started + planned, snap.now + _OVERDUE_EXTENSION * planned)
        # Running ids only need to differ from each other (pending ids are ranks).
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
    # The core breaks ties between equal transfers by id. Hand it ids ranked
    # earliest deadline first (oldest base version, then earliest arrival):
    # among equal transfers the stalest goes first, which spreads delays
    # least. (Freshest first, measured too, lowered the mean delay by 1-2% but
    # raised its standard deviation by 10-15%: benchmarks/RESULTS.md.)
    ranked = sorted(snap.pending, key=lambda t: (t.base_version, t.arrival, t.id))
    real_id = {rank: t.id for rank, t in enumerate(ranked)}
    pending = [schedule.PendingUpdate(rank, t.host, t.dst, t.nbytes, t.base_version, t.norm,
                                      t.arrival) for rank, t in enumerate(ranked)]
    result = schedule.plan(
        schedule.Snapshot(now=snap.now, pending=pending, running=running,
                          network=_network(snap),
                          server=schedule.ServerState(snap.version, in_flight=len(snap.active))),
        schedule.PlanConfig(policy="mlfabric", tau_max=snap.tau_max, idle_factor=idle_factor,
                            overload=overload),
    )
    items = []
    for d in result.directives.values():
        if isinstance(d, schedule.SendAt):
            items.append(PlanItem(real_id[d.id], start=d.start, position=d.position,
                                  planned_seconds=d.end - d.start))
        else:
            detail = f"at position {d.position}"
            if d.reason == schedule.STALEST_IN_OVERLOAD:
                detail = (f"base version {ranked[d.id].base_version}: the queue cannot meet "
                          f"every deadline, so its stalest updates go")
            elif d.reason == schedule.WOULD_IDLE_SERVER:
                detail += (f": would idle the server {d.idle:.3f} s to place transfers of "
                           f"{d.displaced:.3f} s")
            items.append(PlanItem(real_id[d.id], drop=d.reason, detail=detail))
    return items
