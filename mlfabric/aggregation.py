"""Grouping the controller's order for in-network aggregation (design brief, step 5).

Pure code: from the order the scheduling core decided (positions 0, 1, ...
into one server), the network picture and the hosts whose agents can
aggregate, decide which runs of consecutive positions go through an
aggregator, which sums them and forwards one aggregate, and which go
directly. Not wired into the controller yet (issue 5): the agent's
aggregation path and the server's aggregate apply come next.

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
  position i - 1 straight to the aggregate;
* A forwards one update of the members' size: D_j = D_{i-1} + size / rate(A ->
  server).

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

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .errors import ConfigError

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

    def __post_init__(self) -> None:
        if not 2 <= self.min_fan_in <= self.max_fan_in:
            raise ConfigError(f"need 2 <= min_fan_in <= max_fan_in, got {self.min_fan_in} "
                              f"and {self.max_fan_in}")
        if not self.sum_rate > 0:
            raise ConfigError(f"sum_rate must be positive bytes/s, got {self.sum_rate}")


@dataclass(frozen=True, slots=True)
class Group:
    """Positions `first`..`first + len(ids) - 1`; `aggregator` None: direct."""

    first: int
    ids: tuple[int, ...]
    aggregator: Host | None
    ready: float  # when the aggregate is ready at the aggregator (direct: start)
    delivered: float  # when the server has received it


def _arrival(members: Sequence[Slot], agg: Host, links: Links, now: float) -> float:
    remote = [m for m in members if m.source != agg]
    if not remote:
        return now
    total = sum(m.size for m in remote)
    slowest = max(m.size / min(links.up[m.source], links.pair.get((m.source, agg), math.inf))
                  for m in remote)
    return now + max(total / links.down[agg], slowest)


def plan_groups(order: Sequence[Slot], server: Host, aggregators: Sequence[Host], links: Links,
                now: float, ready: float, config: AggregationConfig | None = None
                ) -> tuple[list[Group], int]:
    """Group `order` (positions 0, 1, ... into `server`); `ready` is when the
    server's downlink has delivered everything before position 0. Returns the
    groups, in position order, and the bytes the server does not receive."""
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
        best: tuple[int, float, Host, float] | None = None  # (-k, forward time, agg, ready)
        for agg in candidates:
            fwd_rate = links.rate(agg, server)
            fwd = order[i].size / fwd_rate
            largest: tuple[int, float] | None = None  # (k, ready) of the largest valid group
            for k in range(config.min_fan_in, min(config.max_fan_in, len(order) - i) + 1):
                members = order[i:i + k]
                if len({m.size for m in members}) != 1:
                    break  # one aggregate holds the same tensors as each member
                direct = sum(m.size / links.rate(m.source, server) for m in members)
                t_ready = _arrival(members, agg, links, now) + sum(
                    m.size for m in members) / config.sum_rate
                if t_ready <= done and fwd < direct:
                    largest = (k, t_ready)
            if largest is not None:
                key = (-largest[0], fwd, agg, largest[1])
                if best is None or key[:2] < best[:2]:
                    best = key
        if best is not None:
            k, fwd, agg, t_ready = -best[0], best[1], best[2], best[3]
            members = order[i:i + k]
            done += fwd
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
        total = np.zeros_like(cur)
        for update, _ in members:
            total = total + update[name]
        new[name] = (cur + total + g * (cur - w_prev[name])).astype(np.float32)
    delays = [version - base for _, base in members]
    return new, {n: v.copy() for n, v in w.items()}, version + len(members), delays
