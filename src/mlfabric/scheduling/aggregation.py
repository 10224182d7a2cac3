"""Grouping the controller's order for in-network aggregation (design brief, step 5).

Pure code: from the order the scheduling core decided (positions 0, 1, ...
into one server), the network picture and the hosts whose agents can
aggregate, decide which runs of consecutive positions go through an
aggregator, which sums them and forwards one aggregate, and which go
directly. `route_groups` applies it to a policy's plan. `apply_aggregate`
defines what the server does with an aggregate (tests and harnesses replay
it); the aggregator's sum of a group is `mlfabric.agent.group_sum`.

Model. The server's downlink is the shared resource that aggregation saves:
the server receives position after position on it, so position i is
delivered at D_i = D_{i-1} + its transfer time into the server. For a group
G = positions i..j through aggregator A:

* members send to A from `now`, sharing A's downlink (and each limited by its
  own uplink and the pair rate): all have arrived by
  arrive(A, G) = now + max(sum(size) / down[A], max over members of
  size / min(up[src], pair[src, A])); a member on A itself costs nothing;
* A sums them at `sum_rate` bytes/s: ready(A, G) = arrive + sum(size) / sum_rate;
* **the constraint** (aggregation never stalls the server's order): the
  aggregate is ready no later than the moment every earlier position is
  delivered, ready(A, G) <= D_{i-1}, so the server's downlink goes from
  position i - 1 straight to the aggregate. With a group wait W > 0
  (`AggregationConfig.wait`, default 0), ready(A, G) <= D_{i-1} + W instead,
  and only if the group is still delivered sooner than its members sent
  directly: the downlink idles up to W to buy a larger group;
* A forwards one update of the members' size: D_j = max(D_{i-1}, ready(A, G))
  + size / rate(A -> server).

A group pays when its forward is shorter than the direct transfers it
replaces; a group is formed only then, with at least `min_fan_in` members.
Greedy, in order: at each position the largest group (at most `max_fan_in`)
that meets the constraint on the best aggregator (fastest forward, then the
name) is taken; otherwise the position goes directly.

Applying an aggregate (docs/design.md, "Aggregation"): the server adds the
members' sum as one momentum step, `w <- w + sum(u) + gamma * (w - w_prev)`,
and its version advances by k; every member's delay is the server version
before the step minus its base version. `apply_aggregate` is that definition
in numpy, the reference the server is tested against.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from ..errors import ConfigError
from . import schedule
from .plan import PlanItem, Policy, Route, Snapshot, Transfer

Host = Hashable


@dataclass(frozen=True, slots=True)
class Slot:
    """One position of the order: update `id` of `size` bytes from `source`."""

    id: int
    source: Host
    size: int
    base_version: int


@dataclass(frozen=True, slots=True)
class Links:
    """Capacities in bytes/s (big switch); a missing pair rate does not bound."""

    up: Mapping[Host, float]
    down: Mapping[Host, float]
    pair: Mapping[tuple[Host, Host], float]

    def rate(self, a: Host, b: Host) -> float:
        return min(self.up[a], self.down[b], self.pair.get((a, b), math.inf))


@dataclass(frozen=True, slots=True)
class AggregationConfig:
    min_fan_in: int = 2
    max_fan_in: int = 8
    sum_rate: float = 2e9  # bytes/s the aggregator's kernel sums (measured: bench_kernels)
    # route_groups: keep the last group of the order pending while it can
    # still take members (fewer than max_fan_in) and its aggregate would be
    # ready more than `hold_guard` seconds before the server needs it; it goes
    # at its latest start (minus the guard) or at an earlier re-plan.
    hold: bool = False
    hold_guard: float = 0.05
    # How long the server's downlink may wait for an aggregate (the brief's
    # rule, 0: never), to buy larger groups. With `hold`, the last group is
    # also kept pending until `wait` after its oldest member asked (or until
    # it is full), and so is a lone update, which may get company.
    wait: float = 0.0
    # route_groups: an update the policy dropped in overload joins a group
    # that goes anyway, when it meets its deadline there and delays no
    # later transfer past its own (see `rescue_drops`).
    rescue: bool = False

    def __post_init__(self) -> None:
        if not 2 <= self.min_fan_in <= self.max_fan_in:
            raise ConfigError(f"need 2 <= min_fan_in <= max_fan_in, got {self.min_fan_in} "
                              f"and {self.max_fan_in}")
        if not self.sum_rate > 0:
            raise ConfigError(f"sum_rate must be positive bytes/s, got {self.sum_rate}")
        if not self.hold_guard >= 0:
            raise ConfigError(f"hold_guard must be >= 0 seconds, got {self.hold_guard}")
        if not 0 <= self.wait < math.inf:
            raise ConfigError(f"the group wait must be a finite number of seconds >= 0 "
                              f"(0: aggregation never stalls the server), got {self.wait}")


@dataclass(frozen=True, slots=True)
class Group:
    """Positions `first`..`first + len(ids) - 1`; `aggregator` None: direct."""

    first: int
    ids: tuple[int, ...]
    aggregator: Host | None
    ready: float  # when the aggregate is ready at the aggregator (direct: start)
    delivered: float  # when the server has received it
    rescued: int = 0  # members the policy had dropped (the last ones of `ids`)


def _arrival(members: Sequence[Slot], agg: Host, links: Links, now: float) -> float:
    remote = [m for m in members if m.source != agg]
    if not remote:
        return now
    total = sum(m.size for m in remote)
    slowest = max(m.size / min(links.up[m.source], links.pair.get((m.source, agg), math.inf))
                  for m in remote)
    return now + max(total / links.down[agg], slowest)


def _ready(members: Sequence[Slot], agg: Host, links: Links, now: float,
           config: AggregationConfig) -> float:
    """ready(A, G): every member arrived at `agg`, and summed."""
    return _arrival(members, agg, links, now) + sum(m.size for m in members) / config.sum_rate


def plan_groups(order: Sequence[Slot], server: Host, aggregators: Sequence[Host], links: Links,
                now: float, ready: float, config: AggregationConfig | None = None
                ) -> tuple[list[Group], int]:
    """Group `order` (positions 0, 1, ... into `server`); `ready` is when the
    server's downlink has delivered everything before position 0. Returns the
    groups, in position order, and the bytes the server does not receive.

    A group's aggregate must be ready when the server's downlink has
    delivered every earlier position (the brief: aggregation never stalls the
    server's order), or at most `config.wait` later, and only if its members
    then still reach the server sooner than sent one by one."""
    config = config or AggregationConfig()
    for s in order:
        if s.size <= 0:
            raise ConfigError(f"update {s.id} has size {s.size}; sizes must be > 0")
    candidates = sorted((a for a in aggregators if a != server), key=repr)
    groups: list[Group] = []
    saved = 0
    done = max(now, ready)  # D_{i-1}
    i = 0
    while i < len(order):
        best: tuple[int, float, Host, float] | None = None  # (-k, delivered, agg, ready)
        for agg in candidates:
            fwd = order[i].size / links.rate(agg, server)
            largest: tuple[int, float, float] | None = None  # (k, ready, delivered)
            for k in range(config.min_fan_in, min(config.max_fan_in, len(order) - i) + 1):
                members = order[i:i + k]
                if len({m.size for m in members}) != 1:
                    break  # one aggregate holds the same tensors as each member
                direct = sum(m.size / links.rate(m.source, server) for m in members)
                t_ready = _ready(members, agg, links, now, config)
                # The downlink may wait for the aggregate at most `wait`, and
                # only if the members still arrive sooner than sent directly.
                delivered = max(done, t_ready) + fwd
                if t_ready <= done + config.wait and delivered < done + direct:
                    largest = (k, t_ready, delivered)
            if largest is not None:
                key = (-largest[0], largest[2], agg, largest[1])
                if best is None or key[:2] < best[:2]:
                    best = key
        if best is not None:
            k, done, agg, t_ready = -best[0], best[1], best[2], best[3]
            members = order[i:i + k]
            groups.append(Group(i, tuple(m.id for m in members), agg, t_ready, done))
            saved += sum(m.size for m in members) - members[0].size
            i += k
            continue
        s = order[i]
        start = done
        done += s.size / links.rate(s.source, server)
        groups.append(Group(i, (s.id,), None, start, done))
        i += 1
    return groups, saved


def rescue_drops(groups: Sequence[Group], order: Sequence[Slot], dropped: Sequence[Slot],
                 links: Links, now: float, ready: float, *, first_version: int, tau_max: int,
                 config: AggregationConfig | None = None) -> list[Group]:
    """Add updates the policy dropped to the aggregated `groups` of `order`
    (from `plan_groups`), so that the server's downlink takes them at no cost.

    Position j of `order` is applied at version `first_version + j`. Dropped
    in overload, an update costs its worker a gradient; as a member it costs
    the server nothing (the aggregate has one member's size). An update
    joins a group, at its end, when

    * the group has room (`max_fan_in`) and holds updates of its size;
    * its delay there, `first_version + first position + members added
      before - base_version`, is at most tau_max - 1 (one version of margin:
      a stale member makes the server refuse the whole aggregate);
    * the aggregate is still ready by the time the server needs it;
    * every later position still meets its deadline, although each added
      member advances the server's version by one more.

    Freshest first: they have the most slack, and fresher gradients are
    worth more. Pure: the groups with their new members, in order."""
    config = config or AggregationConfig()
    by_id = {s.id: s for s in order}
    # slack[j]: how many versions later every position from j on may go.
    slack = [math.inf] * (len(order) + 1)
    for j in range(len(order) - 1, -1, -1):
        slack[j] = min(slack[j + 1], order[j].base_version + tau_max - (first_version + j))
    candidates = sorted(dropped, key=lambda s: (-s.base_version, s.id))
    out: list[Group] = []
    added_before = 0
    due = max(now, ready)  # D_{i-1} of each group in turn
    for g in groups:
        due, previous = g.delivered, due
        room = config.max_fan_in - len(g.ids)
        if g.aggregator is None or room <= 0 or not candidates:
            out.append(g)
            continue
        members = [by_id[i] for i in g.ids]
        version = first_version + g.first + added_before
        after = slack[g.first + len(g.ids)]
        joined: list[Slot] = []
        t_ready = g.ready
        for c in list(candidates):
            if len(joined) == room or after < added_before + len(joined) + 1:
                break
            if c.base_version + tau_max - 1 < version:
                candidates.remove(c)  # too stale here, and later groups come later
                continue
            if c.size != members[0].size:
                continue
            t = _ready([*members, *joined, c], g.aggregator, links, now, config)
            if t > max(previous, g.ready):  # the group's delivery stays as planned
                continue
            joined.append(c)
            candidates.remove(c)
            t_ready = t
        added_before += len(joined)
        out.append(dataclasses.replace(g, ids=(*g.ids, *(c.id for c in joined)), ready=t_ready,
                                       rescued=len(joined)) if joined else g)
    return out


def direct_delivery(order: Sequence[Slot], server: Host, links: Links, now: float,
                    ready: float) -> float:
    """When the last position is delivered with every update sent directly."""
    done = max(now, ready)
    for s in order:
        done += s.size / links.rate(s.source, server)
    return done


def apply_aggregate(w: dict[str, np.ndarray], w_prev: dict[str, np.ndarray], version: int,
                    members: Sequence[tuple[dict[str, np.ndarray], int]], gamma: float
                    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], int, list[int]]:
    """The definition of applying an aggregate of k members (update, base
    version): one momentum step with the members' sum, version + k, and each
    member's delay. Returns (w, w_prev, version, delays). float32 like the server."""
    if not members:
        raise ConfigError("an aggregate needs at least one member")
    g = np.float32(gamma)
    new = {}
    for name, cur in w.items():
        # Left to right in member order, as the aggregator's sum_into kernel.
        total = functools.reduce(np.add, [update[name] for update, _ in members])
        new[name] = (cur + total + g * (cur - w_prev[name])).astype(np.float32)
    delays = [version - base for _, base in members]
    return new, {n: v.copy() for n, v in w.items()}, version + len(members), delays


# -- the controller's side: routing grouped positions through aggregators -------


def _links(snap: Snapshot) -> Links:
    """The snapshot's rates, each host's computed once per network (its
    `up_rates`/`down_rates`). The controller's hosts are strings; Links takes
    any hashable (Mapping is invariant in its key type, hence the casts)."""
    net = snap.network
    return Links(up=cast(Mapping[Host, float], net.up_rates),
                 down=cast(Mapping[Host, float], net.down_rates),
                 pair=cast(Mapping[tuple[Host, Host], float], net.pair))


# Drops an aggregate can take back: the update was fine, the server's
# downlink had no room for it (not: its deadline had passed).
RESCUABLE = (schedule.STALEST_IN_OVERLOAD, schedule.WOULD_IDLE_SERVER)


def _slot(t: Transfer) -> Slot:
    return Slot(t.id, t.host, t.nbytes, t.base_version)


def route_groups(snap: Snapshot, items: Sequence[PlanItem], config: AggregationConfig | None = None,
                 epoch: int = 0) -> tuple[Sequence[PlanItem], list[Group]]:
    """Turn a policy's plan into one with aggregation: per server, the
    transfers it plans to send (now or later) are taken in plan order and
    grouped by `plan_groups` over the aggregators available in the snapshot;
    every member of a group goes now, to its aggregator (a `Route`). Returns
    the new plan and the groups formed. A group's id is its first member's
    transfer id, above `epoch` << 32: a controller that restarts (its ids start
    at 1 again) takes a new epoch, so an aggregator never mistakes its groups
    for ones it closed before the restart.

    With `config.hold`, the last group of a server's order is not sent yet
    while it could take more members and has time to spare: requests arrive
    one at a time and each re-plans, so without holding a group would go as
    soon as two updates wait (fan-in 2). Its members stay pending, planned to
    start at the group's latest start less `hold_guard` (the controller
    re-plans then, or at the next request, which may join the group). With
    `config.wait` > 0 as well, the last group (or a lone update) is held at
    least until `wait` after its oldest member asked, even while the
    server's downlink is free: the price of a larger group is that idle time,
    at most `wait` per group (`plan_groups`)."""
    if not snap.aggregators:
        return items, []
    config = config or AggregationConfig()
    pending = {t.id: t for t in snap.pending}
    by_dst: dict[str, list[PlanItem]] = {}
    dropped: dict[str, list[PlanItem]] = {}
    for item in items:
        if item.id not in pending or pending[item.id].granted:
            # A chunked transfer sent in part goes on to its server alone:
            # the rest of its frame is on that link already.
            continue
        if item.drop is None and item.start is not None:
            by_dst.setdefault(pending[item.id].dst, []).append(item)
        elif item.drop in RESCUABLE:
            dropped.setdefault(pending[item.id].dst, []).append(item)
    routed: dict[int, PlanItem] = {}
    formed: list[Group] = []
    for dst, sends in sorted(by_dst.items()):
        if len(sends) < 2:
            if config.hold and config.wait > 0:
                # A lone update waits for company as a group would.
                (item,) = sends
                until = pending[item.id].arrival + config.wait
                if snap.now < until and item.start is not None and item.start < until:
                    routed[item.id] = item._replace(start=until)
            continue
        sends.sort(key=lambda i: (i.start, i.position if i.position is not None else 0, i.id))
        order = [_slot(pending[i.id]) for i in sends]
        ready = min(i.start for i in sends if i.start is not None)
        links = _links(snap)
        groups, _ = plan_groups(order, dst, sorted(snap.aggregators), links, snap.now, ready,
                                config)
        plan_of = {i.id: i for i in sends}
        if config.rescue and snap.tau_max is not None and dropped.get(dst):
            # Positions count from the version after everything in flight.
            groups = rescue_drops(
                groups, order, [_slot(pending[i.id]) for i in dropped[dst]], links, snap.now,
                ready, first_version=snap.version + snap.server_in_flight, tau_max=snap.tau_max,
                config=config)
            for i in dropped[dst]:
                plan_of[i.id] = PlanItem(i.id, start=snap.now)
        before = max(snap.now, ready)  # D_{i-1} of each group in turn
        for n, g in enumerate(groups):
            before, due = g.delivered, before
            if g.aggregator is None:
                continue
            slack = due - g.ready  # how long its members could still wait
            until = min(pending[tid].arrival for tid in g.ids) + config.wait
            if (config.hold and n == len(groups) - 1 and len(g.ids) < config.max_fan_in
                    and (slack > config.hold_guard or snap.now < until)):
                at = max(snap.now + slack - config.hold_guard, until)
                for tid in g.ids:
                    routed[tid] = plan_of[tid]._replace(start=at)
                continue
            formed.append(g)
            for index, tid in enumerate(g.ids):
                route = Route(str(g.aggregator), snap.aggregators[str(g.aggregator)],
                              group=(epoch << 32) | g.ids[0], fan_in=len(g.ids), index=index)
                # Whole: an aggregator sums whole updates (what a compressing
                # worker's residual holds goes with its next push), and the
                # group was planned at its members' whole sizes.
                routed[tid] = plan_of[tid]._replace(start=snap.now,
                                                    planned_seconds=g.delivered - snap.now,
                                                    route=route, codec=None)
    return [routed.get(i.id, i) for i in items], formed


def aggregating(policy: Policy, config: AggregationConfig | None = None,
                on_groups: Callable[[list[Group]], None] | None = None,
                epoch: int = 0) -> Policy:
    """`policy` with aggregation (`route_groups`) on top; `on_groups` is told
    of the groups each plan forms (for metrics)."""

    def aggregating_policy(snap: Snapshot) -> Sequence[PlanItem]:
        items, groups = route_groups(snap, policy(snap), config, epoch)
        if groups and on_groups is not None:
            on_groups(groups)
        return items

    aggregating_policy.__name__ = f"{getattr(policy, '__name__', 'policy')}+aggregation"
    return aggregating_policy
