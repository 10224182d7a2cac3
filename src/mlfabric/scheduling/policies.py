"""The controller's `mlfabric` policy: the scheduling core (`schedule.plan_rows`)
fed from the controller's state.

The core plans with reservations on links; the controller knows, for each
transfer it let go, when it started and how long the plan expected it to
take. A transfer that outlives its plan still holds its link: its
reservation is extended a little past now, so the next transfer waits for
its completion report (which triggers a re-plan) instead of overlapping it;
unless it is short beside the hand-over that wait costs (`trusted`).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from . import schedule
from .columns import ActiveTransfers, HostTable, PendingColumns
from .plan import ColumnPlan, Network, PlanItem, Snapshot

# An overdue transfer is assumed to need this fraction of its planned time more.
_OVERDUE_EXTENSION = 0.25
_MIN_SECONDS = 1e-6
# A transfer alone into its server whose planned time is at most this many
# hand-overs is trusted to end as planned (`trusted`): waiting for its report
# would idle the link a tenth of the time or more.
PIPELINE_HANDOVERS = 10.0


def _network(snap: Snapshot) -> schedule.Capacities:
    return _capacities(snap.network)


def _capacities(net: Network) -> schedule.Capacities:
    # The controller's hosts are strings; the core takes any hashable
    # (Mapping is invariant in its key type, hence the casts).
    return schedule.Capacities(up=cast(Mapping[schedule.Host, float], net.up_rates),
                            down=cast(Mapping[schedule.Host, float], net.down_rates),
                            pair=cast(Mapping[tuple[schedule.Host, schedule.Host], float],
                                      net.pair))


# The tie order among otherwise equal transfers (see mlfabric_policy).
_EARLIEST_DEADLINE_FIRST = operator.attrgetter("base_version", "arrival", "id")


COMPRESSION_MODES = ("off", "adaptive", "fixed:CODEC")


def check_compression(mode: str) -> str:
    """`mode` if it is one of COMPRESSION_MODES, else ValueError saying so."""
    if mode in ("off", "adaptive") or (mode.startswith("fixed:") and len(mode) > 6):
        return mode
    raise ValueError(f"compression mode must be off, adaptive or fixed:CODEC (e.g. "
                     f"fixed:fp16), got {mode!r}")


def choose_compression(plan: Callable[[np.ndarray], schedule.RowPlan], size: np.ndarray,
                       offers: Sequence[tuple[tuple[str, int, float], ...]], mode: str,
                       rates: np.ndarray | None = None
                       ) -> tuple[schedule.RowPlan, dict[int, str]]:
    """The plan of rows of `size` bytes, some sent compressed (issue 35), and
    the codec chosen for each row that is (row -> codec).

    `offers[k]`: row k's compressed forms, (codec, bytes, the seconds its
    worker takes to encode it) from the least compressed. A form is planned
    at its bytes plus its encoding time at the row's path rate (`rates[k]`,
    bytes/s; None: encoding not counted): the link time it costs, counting
    the worker's CPU as if it held the link, so that a form whose encoding
    outlasts what it saves on the wire is never the smaller one.

    "off": every row whole. "fixed:NAME": every row that offers NAME sends
    it. "adaptive": each row whole, unless the plan drops it (its deadline
    cannot be met, it would idle the server, or the queue is past what the
    link can deliver in time): then its next form that is smaller counted
    so, and the rows are planned again, until no dropped row has a smaller
    form left. A row thus goes with the least compression that lets it go;
    shrinking a row only frees link time for the others. At most one pass
    per form."""
    chosen: dict[int, str] = {}
    if mode == "off" or not any(offers):
        return plan(size), chosen
    size = size.copy()

    def cost(k: int, nbytes: int, seconds: float) -> float:
        rate = float(rates[k]) if rates is not None else 0.0
        return nbytes + seconds * rate if math.isfinite(rate) and rate > 0 else float(nbytes)

    if mode.startswith("fixed:"):
        name = mode.partition(":")[2]
        for k, offer in enumerate(offers):
            for codec, nbytes, seconds in offer:
                if codec == name:
                    size[k], chosen[k] = cost(k, nbytes, seconds), codec
        return plan(size), chosen
    level = [0] * len(offers)
    result = plan(size)
    for _ in range(max(len(o) for o in offers)):
        shrunk = False
        for k in result.drop_row:
            while level[k] < len(offers[k]):
                codec, nbytes, seconds = offers[k][level[k]]
                level[k] += 1
                planned = cost(k, nbytes, seconds)
                if planned < size[k]:
                    size[k], chosen[k] = planned, codec
                    shrunk = True
                    break
        if not shrunk:
            break
        result = plan(size)
    return result, chosen


def mlfabric_policy(snap: Snapshot, *, idle_factor: float | None = 1.0,
                    overload: str = "stalest", compression: str = "adaptive") -> ColumnPlan:
    """Shortest-transfer-first with deadlines and drops (docs/scheduling.md),
    planned from the snapshot alone."""
    running = _running(ActiveTransfers.of(snap.active), snap.now, snap.network,
                       snap.handover)
    # The core breaks ties between equal transfers by row. Hand it rows ranked
    # earliest deadline first (oldest base version, then earliest arrival):
    # among equal transfers the stalest goes first, which spreads delays
    # least. (Freshest first, measured too, lowered the mean delay by 1-2% but
    # raised its standard deviation by 10-15%: benchmarks/RESULTS.md.)
    ranked = sorted(snap.pending, key=_EARLIEST_DEADLINE_FIRST)
    n = len(ranked)
    hosts, dsts = [t.host for t in ranked], [t.dst for t in ranked]
    base_version = np.fromiter((t.base_version for t in ranked), np.int64, n)

    def plan(size: np.ndarray) -> schedule.RowPlan:
        return schedule.plan_rows(
            snap.now, schedule.Rows(hosts, dsts, size, base_version), running, _network(snap),
            schedule.ServerState(snap.version, in_flight=snap.server_in_flight),
            _config(snap.tau_max, idle_factor, overload))

    offers = [() if t.chunk else t.options for t in ranked]
    rates = (np.fromiter((snap.network.rate(t.host, t.dst) for t in ranked), np.float64, n)
             if any(offers) else None)
    result, chosen = choose_compression(
        plan, np.fromiter((t.nbytes for t in ranked), np.float64, n), offers, compression,
        rates)
    ids = np.fromiter((t.id for t in ranked), np.int64, n)
    return _column_plan(result, ids, base_version, chosen)


def _config(tau_max: int | None, idle_factor: float | None, overload: str,
            plan_ahead: int = 0) -> schedule.PlanConfig:
    return schedule.PlanConfig(policy="mlfabric", tau_max=tau_max, idle_factor=idle_factor,
                               overload=overload, plan_ahead=plan_ahead)


# Positions the controller's plan always fills before it may stop at the
# first one nothing can start by now (PlanConfig.plan_ahead). At 10,000
# pending transfers into one server, placing all of them was most of a
# re-plan, and all but the first few hundred are placed again at the next
# event. Below this many pending, plans are whole, as before: every drop
# is decided as early as the plan can see it.
PLAN_AHEAD = 256


def trusted(active: ActiveTransfers, handover: float) -> np.ndarray:
    """Which transfers let go (`active.by_id()`'s rows, in that order) are
    trusted to end as planned: direct, alone into their server, and short
    beside the hand-over (at most PIPELINE_HANDOVERS of it). The next
    transfer into that server goes at its planned end, its go on the way
    while its last bytes are, instead of after its report: on a shard's
    link at 300 simulated workers, 128 KiB transfers of 4.5 ms each waited
    3.1 ms each for the report, outcome and go (three messages), and the
    link idled 40% of the time. One late overlaps one successor at most: two
    into a server, and neither is trusted until one is reported. A long
    transfer is not trusted: waiting costs it little, and a late one then
    re-plans what follows (the closed loop, `observed.overdue`) instead of
    sharing its link with it."""
    rows = active.by_id()
    if handover <= 0:
        return np.zeros(len(rows), bool)
    dst = active.dst[rows]
    alone = np.bincount(dst, minlength=int(dst.max(initial=-1)) + 1)[dst] == 1
    return (alone & active.direct[rows] & ~active.chunked[rows]
            & (active.planned[rows] <= PIPELINE_HANDOVERS * handover))


def _holds(active: ActiveTransfers, now: float, handover: float = 0.0
           ) -> tuple[np.ndarray, np.ndarray]:
    """Until when and at what rate each transfer let go (by id) holds its
    path: its planned end (or, past it, a little longer, unless `trusted`),
    at its bytes over its planned time."""
    rows = active.by_id()
    planned = np.maximum(active.planned[rows], _MIN_SECONDS)
    started = active.started[rows]
    end = np.where(np.isnan(started), now, started) + planned
    late = ~trusted(active, handover)
    end[late] = np.maximum(end[late], now + _OVERDUE_EXTENSION * planned[late])
    return end, active.nbytes[rows] / planned


def _running(active: ActiveTransfers, now: float, network: Network, handover: float = 0.0
             ) -> list[schedule.RunningTransfer]:
    """What the transfers let go hold (`_holds`): each its path, and through
    an aggregator the aggregate's forward into the server."""
    running = []
    forwards: dict[int, schedule.RunningTransfer] = {}
    end, rate = _holds(active, now, handover)
    for t, t_end, t_rate in zip(active.planned_view(), end.tolist(), rate.tolist(),
                                strict=True):
        # Running ids only need to differ from each other (pending ids are rows).
        if t.route is None:
            running.append(schedule.RunningTransfer(-t.id, t.host, t.dst, rate=t_rate,
                                                    end=t_end))
            continue
        # Through an aggregator: the member's leg to it, and once per group
        # the aggregate's forward into the server (its downlink is what the
        # group's plan reserved).
        running.append(schedule.RunningTransfer(-t.id, t.host, t.route.host, rate=t_rate,
                                                end=t_end))
        fwd_id = -(1 << 40) - t.route.group
        if fwd_id not in forwards:
            forwards[fwd_id] = schedule.RunningTransfer(
                fwd_id, t.route.host, t.dst, rate=network.rate(t.route.host, t.dst),
                end=t_end)
    running.extend(forwards.values())
    return running


def _held_columns(active: ActiveTransfers, now: float, handover: float = 0.0
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`_running` as columns, for transfers that go direct (none through an
    aggregator): their ids, source and destination host numbers
    (`active.hosts`'), ends and rates, by id."""
    rows = active.by_id()
    end, rate = _holds(active, now, handover)
    return -active.ids[rows], active.src[rows], active.dst[rows], end, rate


def _column_plan(result: schedule.RowPlan, ids: np.ndarray, base_version: np.ndarray,
                 chosen: Mapping[int, str] | None = None) -> ColumnPlan:
    """The policy's plan from the core's: row k is transfer ids[k], sent
    compressed by chosen[k] if there is one."""
    drops = []
    for k, reason, position, idle, displaced in zip(result.drop_row, result.reason,
                                                     result.drop_position, result.idle,
                                                     result.displaced, strict=True):
        detail = f"at position {position}"
        if reason == schedule.STALEST_IN_OVERLOAD:
            detail = (f"base version {int(base_version[k])}: the queue cannot meet "
                      f"every deadline, so its stalest updates go")
        elif reason == schedule.WOULD_IDLE_SERVER:
            detail += (f": would idle the server {idle:.3f} s to place transfers of "
                       f"{displaced:.3f} s")
        drops.append(PlanItem(int(ids[k]), drop=reason, detail=detail))
    # Most sends start later: their items are built only if someone reads them.
    codecs = {int(ids[k]): codec for k, codec in chosen.items()} if chosen else None
    return ColumnPlan(ids[np.asarray(result.send_row, np.intp)], result.start, result.end,
                      result.position, drops, codecs, later=result.unplanned_from)


@dataclass(frozen=True)
class Mlfabric:
    """The mlfabric policy with its settings, as the controller runs it.

    Called on a snapshot it plans from scratch (`mlfabric_policy`).
    `plan_columns` gives the same plan from the pending transfers kept as
    columns between events (`columns.PendingColumns`), which the
    controller's state uses: at 10,000 pending, building the columns from
    scratch was most of a re-plan."""

    idle_factor: float | None = 1.0
    overload: str = "stalest"
    # Transfers whose workers offer compressed forms (issue 35): see
    # choose_compression. Adaptive by default: a transfer goes compressed only
    # when it would not go whole, so a link with room costs no worker CPU.
    compression: str = "adaptive"
    # plan_columns fills this many positions, then stops once nothing left
    # can start now (0: every position). See PLAN_AHEAD.
    plan_ahead: int = PLAN_AHEAD

    def __call__(self, snap: Snapshot) -> ColumnPlan:
        return mlfabric_policy(snap, idle_factor=self.idle_factor, overload=self.overload,
                               compression=self.compression)

    def plan_columns(self, pending: PendingColumns, rows: np.ndarray, *, now: float,
                     version: int, in_flight: int, tau_max: int | None,
                     active: ActiveTransfers, network: Network, handover: float = 0.0
                     ) -> ColumnPlan | None:
        """The plan of `pending`'s `rows` (one shard's) as `mlfabric_policy`
        makes it from a snapshot of the same transfers; None if the network
        has a rate the core refuses (planning from a snapshot raises the
        error that says which) or the core is not built."""
        if not schedule.has_kernel():
            return None
        hosts = pending.hosts
        # Every link that carries something gets a number before the rates
        # are read: first the links the running transfers hold.
        # As columns when no pair is measured and nothing runs through an
        # aggregator (with agents measuring pairs, by name: decided here so
        # that those plans do not build both).
        if active.hosts is not hosts:
            raise ValueError("plan_columns needs the active transfers' hosts numbered as the "
                             "pending ones' (ActiveTransfers(pending.hosts))")
        direct = not network.pair and active.all_direct
        running: list[schedule.RunningTransfer] | None = None
        if direct:
            held = _held_columns(active, now, handover)
        else:
            running = _running(active, now, network, handover)
            for r in running:
                hosts.index(str(r.source)), hosts.index(str(r.destination))
        up_rate, down_rate = hosts.rates(network)
        n_hosts = len(hosts)
        # Ranked earliest deadline first, as mlfabric_policy ranks them.
        ranked = pending.ranked(rows)
        src, dst = pending.src[ranked], pending.dst[ranked]
        capacity = [up_rate, down_rate]
        pair = np.full(len(ranked), -1, np.intp)
        codes = np.empty(0, np.int64)  # the measured pairs' codes (HostTable.pairs)
        cap = np.minimum(up_rate[src], down_rate[dst])
        if network.pair:
            codes, rates = hosts.pairs(network.pair)
            wanted = hosts.pair_code(src, dst)
            at = np.minimum(np.searchsorted(codes, wanted), max(len(codes) - 1, 0))
            measured = codes[at] == wanted if len(codes) else np.zeros(len(wanted), bool)
            pair[measured] = 2 * n_hosts + at[measured]
            cap[measured] = np.minimum(cap[measured], rates[at[measured]])
            capacity.append(rates)
        link_capacity = np.concatenate(capacity)
        if direct and hosts.usable(network):
            # Every rate usable: the links as numbered here.
            held_ids, source, destination, end, rate = held
            links = schedule.LinkSegments.of_running(now, link_capacity, held_ids, source,
                                                     n_hosts + destination, end, rate)
            ready = max(now, float(end.max())) if len(end) else now  # schedule.ready_at
        else:
            if running is None:
                running = _running(active, now, network, handover)
            used = np.concatenate([src, n_hosts + dst, pair[pair >= 0]])
            if not bool(np.all(np.isfinite(link_capacity[used]) & (link_capacity[used] > 0))):
                return None
            links = schedule.LinkSegments.of(
                now, link_capacity, self._reserved_by_name(now, running, network, hosts, codes))
            ready = schedule.ready_at(now, running)
        base_version = pending.base_version[ranked]
        config = _config(tau_max, self.idle_factor, self.overload, self.plan_ahead)

        def plan(size: np.ndarray) -> schedule.RowPlan:
            indexed = schedule.IndexedRows(size, base_version, src, n_hosts + dst, pair, cap)
            return schedule.plan_indexed(indexed, links, ready=ready,
                                         v_init=version + in_flight, config=config, now=now)

        ids = pending.ids[ranked]
        offers = pending.offers
        result, chosen = choose_compression(
            plan, pending.size[ranked],
            [offers.get(int(i), ()) for i in ids] if offers else [], self.compression, cap)
        return _column_plan(result, ids, base_version, chosen)

    @staticmethod
    def _reserved_by_name(now: float, running: Sequence[schedule.RunningTransfer],
                          network: Network, hosts: HostTable, codes: np.ndarray
                          ) -> dict[int, tuple[list[float], list[float], list[float]]]:
        """`schedule.reserved_links` (measured pairs too, every capacity
        checked), numbered as `plan_columns` numbers the links."""
        n_hosts = len(hosts)
        reserved = {}
        for (kind, key), segments in schedule.reserved_links(now, running,
                                                            _capacities(network)).items():
            if kind == "up":
                reserved[hosts.index(str(key))] = segments
            elif kind == "down":
                reserved[n_hosts + hosts.index(str(key))] = segments
            else:
                a, b = cast(tuple[str, str], key)
                code = hosts.index(a) * n_hosts + hosts.index(b)
                reserved[2 * n_hosts + int(np.searchsorted(codes, code))] = segments
        return reserved
