"""The controller's bookkeeping and decisions, without I/O.

`ControlState` knows every transfer a job's workers asked for: pending (no
directive yet) or active (let go, not yet reported done), the newest server
version it has heard of, and the network picture. `decide(now)` asks the
policy for a plan over a snapshot of that state and turns it into actions
(`Go`, `Drop`) and the time it next needs to be asked (`wake_at`). The asyncio
controller only carries the actions out; tests drive this class with a fake
clock (the `now` arguments).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple, overload

POLICIES = ("mlfabric", "fifo")

# Why a transfer was dropped: the fixed set of reasons (metrics label values).
DROP_REASONS = ("deadline_missed", "would_idle_server", "stalest_in_overload", "worker_gone")


# A link never looks fully taken by others: TCP still gets a share of it, and
# the planner needs a rate above zero to place a transfer at all.
MIN_LEFT = 0.05


@dataclass(frozen=True)
class Network:
    """Link capacities in bytes per second (big-switch model).

    A host missing from `up`/`down` gets `default`; `pair[(a, b)]` is a
    measured end-to-end rate from a to b when an agent reported one.
    `load_up`/`load_down` are other tenants' traffic on a host's edge links,
    measured by the agent on that host: the job gets what is left of the
    capacity (at least `MIN_LEFT` of it)."""

    default: float = 125e6  # 1 Gbit/s
    up: Mapping[str, float] = field(default_factory=dict)
    down: Mapping[str, float] = field(default_factory=dict)
    pair: Mapping[tuple[str, str], float] = field(default_factory=dict)
    load_up: Mapping[str, float] = field(default_factory=dict)
    load_down: Mapping[str, float] = field(default_factory=dict)

    @functools.cached_property
    def up_rates(self) -> Mapping[str, float]:
        """`up_rate` of every host, computed once per host (a Network never changes)."""
        return _Rates(self.up_rate)

    @functools.cached_property
    def down_rates(self) -> Mapping[str, float]:
        return _Rates(self.down_rate)

    def up_rate(self, host: str) -> float:
        """What the job can send from `host`: its uplink less others' load."""
        return _left(self.up.get(host, self.default), self.load_up.get(host, 0.0))

    def down_rate(self, host: str) -> float:
        return _left(self.down.get(host, self.default), self.load_down.get(host, 0.0))

    def rate(self, src: str, dst: str) -> float:
        r = min(self.up_rate(src), self.down_rate(dst))
        measured = self.pair.get((src, dst))
        return min(r, measured) if measured is not None else r


class _Rates(dict[str, float]):
    """host -> rate, computed on a host's first lookup."""

    def __init__(self, rate_of: Callable[[str], float]) -> None:
        super().__init__()
        self._rate_of = rate_of

    def __missing__(self, host: str) -> float:
        rate = self[host] = self._rate_of(host)
        return rate


def _left(capacity: float, load: float) -> float:
    return max(capacity - load, MIN_LEFT * capacity)


def with_estimates(net: Network, host: str,
                   estimates: Mapping[str, tuple[float, bool]]) -> Network:
    """`net` with the agent on `host`'s measurements: peer -> (available
    bytes/s, stale). A fresh estimate sets the pair rate host -> peer; a stale
    one removes it (the configured capacities apply again)."""
    pair = dict(net.pair)
    for peer, (rate, stale) in estimates.items():
        if stale or not rate > 0 or math.isnan(rate):
            pair.pop((host, peer), None)
        else:
            pair[(host, peer)] = rate
    return replace(net, pair=pair)


def with_host_load(net: Network, host: str, down: float, up: float) -> Network:
    """`net` with other tenants' load (bytes/s) on `host`'s downlink and uplink,
    as its agent measured them; a negative or NaN value (not measured) removes
    what was known."""
    load_down, load_up = dict(net.load_down), dict(net.load_up)
    for table, value in ((load_down, down), (load_up, up)):
        if value >= 0:
            table[host] = value
        else:
            table.pop(host, None)
    return replace(net, load_up=load_up, load_down=load_down)


@dataclass(frozen=True)
class Route:
    """A transfer that goes through an aggregator: the agent on `host` at
    `address`, as member `index` of group `group` (`fan_in` members)."""

    host: str
    address: str
    group: int
    fan_in: int
    index: int


@dataclass
class Transfer:
    """One update a worker asked to send."""

    id: int  # unique within the controller
    owner: Hashable  # who asked (a connection); opaque here
    req: int  # the owner's request id
    host: str  # the worker's host
    dst: str  # the server's host
    nbytes: int
    base_version: int
    norm: float
    arrival: float
    # Set when it is let go:
    started: float | None = None
    position: int | None = None
    planned_seconds: float | None = None
    route: Route | None = None


@dataclass(frozen=True)
class Go:
    transfer: Transfer
    position: int
    planned_seconds: float
    route: Route | None = None


@dataclass(frozen=True)
class Drop:
    transfer: Transfer
    reason: str
    detail: str


@dataclass(frozen=True)
class Snapshot:
    """What a policy sees: the state at `now`, read-only."""

    now: float
    version: int  # newest server version heard of
    tau_max: int | None
    pending: tuple[Transfer, ...]
    active: tuple[Transfer, ...]
    network: Network
    aggregators: Mapping[str, str] = field(default_factory=dict)  # host -> address, usable now


class PlanItem(NamedTuple):
    """A policy's decision for one pending transfer: start at `start`
    (now or later; later means "ask again then"), or drop with a reason.

    Immutable; a tuple rather than a frozen dataclass because a policy makes
    one for every pending transfer on every event, and a tuple costs a third
    as much to build (1.0 against 0.3 microseconds)."""

    id: int
    start: float | None = None
    position: int | None = None
    planned_seconds: float | None = None
    drop: str | None = None
    detail: str = ""
    route: Route | None = None  # go through an aggregator


class ColumnPlan(Sequence[PlanItem]):
    """A policy's plan kept as columns, its `PlanItem`s built only when read.

    A plan holds one item per pending transfer, and most of them start
    later: `ControlState.decide` reads only what is due (`due`), so a re-plan
    over thousands of pending transfers builds a few items, not thousands.
    Read as a sequence (aggregation, the replication gate), it holds the
    sends in position order, then the drops, as a list would."""

    def __init__(self, ids: Sequence[int], start: Sequence[float], end: Sequence[float],
                 position: Sequence[int], drops: Sequence[PlanItem]) -> None:
        """Send k: transfer ids[k] from start[k] to end[k] at `position[k]`."""
        self._ids, self._start, self._end = ids, start, end
        self._position = position
        self._drops = drops

    def _send(self, k: int) -> PlanItem:
        start = self._start[k]
        return PlanItem(self._ids[k], start=start, position=self._position[k],
                        planned_seconds=self._end[k] - start)

    def __len__(self) -> int:
        return len(self._ids) + len(self._drops)

    @overload
    def __getitem__(self, i: int) -> PlanItem: ...

    @overload
    def __getitem__(self, i: slice) -> list[PlanItem]: ...

    def __getitem__(self, i: int | slice) -> PlanItem | list[PlanItem]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        n = len(self._ids)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"plan index {i} out of range for {len(self)} items")
        return self._send(i) if i < n else self._drops[i - n]

    def __iter__(self) -> Iterator[PlanItem]:
        for k in range(len(self._ids)):
            yield self._send(k)
        yield from self._drops

    def due(self, now: float) -> tuple[list[PlanItem], float | None]:
        """The items that take effect at `now` (the sends starting by then, in
        position order, then the drops) and the earliest later start."""
        start = self._start
        items = [self._send(k) for k in range(len(start)) if start[k] <= now]
        later = min((s for s in start if s > now), default=None)
        items.extend(self._drops)
        return items, later


Policy = Callable[[Snapshot], Sequence[PlanItem]]


def fifo_policy(snap: Snapshot) -> list[PlanItem]:
    """The plain asynchronous parameter server: everything goes at once, in
    arrival order; concurrent transfers share the links as TCP shares them."""
    items = []
    in_flight = len(snap.active)
    for i, t in enumerate(sorted(snap.pending, key=lambda t: (t.arrival, t.id))):
        sharing = in_flight + i + 1
        rate = snap.network.rate(t.host, t.dst) / sharing
        items.append(PlanItem(t.id, start=snap.now, position=in_flight + i,
                              planned_seconds=t.nbytes / rate))
    return items


@dataclass
class WorkerStats:
    """What one worker asked for and what became of it."""

    name: str
    host: str | None = None
    requests: int = 0
    sent: int = 0
    dropped: int = 0
    applied: int = 0
    refused: int = 0  # sent, but not applied by the server (stale)
    last_delay: int | None = None


@dataclass
class ServerStats:
    """A parameter server as the controller knows it: from the transfers
    workers sent to it and the versions they reported back from it."""

    host: str
    version: int | None = None  # newest version reported after an apply there
    transfers: int = 0  # requested to it
    applied: int = 0
    refused: int = 0
    last_heard: float | None = None  # clock time of the last report from it


@dataclass
class AgentStats:
    """An agent the controller polls (--agent HOST=ADDR:PORT)."""

    host: str
    address: str
    reachable: bool = False
    last_report: float | None = None  # clock time of the last estimates read
    peers: int = 0  # peers in that report
    fresh: int = 0  # of which had a fresh estimate
    error: str = ""  # why the last poll failed, while unreachable


def _age(then: float | None, now: float | None) -> float | None:
    return None if then is None or now is None else max(0.0, now - then)


@dataclass
class DelayStats:
    count: int = 0
    total: float = 0.0
    squares: float = 0.0
    max: int = 0

    def add(self, delay: int) -> None:
        self.count += 1
        self.total += delay
        self.squares += delay * delay
        self.max = max(self.max, delay)

    def summary(self) -> dict[str, float | int]:
        if not self.count:
            return {"count": 0}
        mean = self.total / self.count
        return {"count": self.count, "mean": mean, "max": self.max,
                "std": math.sqrt(max(0.0, self.squares / self.count - mean * mean))}


@dataclass(frozen=True)
class Decisions:
    actions: tuple[Go | Drop, ...]
    wake_at: float | None  # ask again at this time (a planned start), if any


class ControlState:
    def __init__(self, policy: Policy, *, tau_max: int | None,
                 network: Network | None = None) -> None:
        self.policy = policy
        self.tau_max = tau_max
        self.network = network or Network()
        self.version = 0
        self.pending: dict[int, Transfer] = {}
        self.active: dict[int, Transfer] = {}
        self.workers: dict[Hashable, WorkerStats] = {}
        self.delays = DelayStats()
        self.servers: dict[str, ServerStats] = {}
        self.agents: dict[str, AgentStats] = {}
        # Replicas (issue 6) register here: host -> a JSON-ready dict that
        # `mlfabric status` prints as one row (host, version, lag, ...).
        self.replicas: dict[str, dict[str, object]] = {}
        # Aggregators (agents that sum updates): host -> address, and the
        # hosts benched after a failure: host -> until when.
        self.aggregators: dict[str, str] = {}
        self.benched: dict[str, float] = {}
        self.bench_seconds = 10.0
        self._next_id = 1

    def join(self, owner: Hashable, name: str) -> None:
        """A worker (or any peer) connected under `name`."""
        self.workers[owner] = WorkerStats(name)

    # -- events ---------------------------------------------------------------

    def request(self, owner: Hashable, req: int, *, host: str, dst: str, nbytes: int,
                base_version: int, norm: float, now: float) -> Transfer:
        t = Transfer(self._next_id, owner, req, host, dst, nbytes, base_version, norm, now)
        self._next_id += 1
        stats = self.workers.setdefault(owner, WorkerStats(str(owner)))
        stats.requests += 1
        stats.host = host
        self.servers.setdefault(dst, ServerStats(dst)).transfers += 1
        self.pending[t.id] = t
        # A worker computed on base_version, so the server has reached it.
        self.version = max(self.version, base_version)
        return t

    def done(self, owner: Hashable, req: int, *, version: int, applied: bool = True,
             delay: int | None = None, now: float | None = None,
             via_failed: str | None = None) -> Transfer | None:
        """An active transfer ended at the server (applied or not).
        `via_failed`: its aggregator failed it (it was then sent directly).
        A pending one reported done was withdrawn by its worker (it waited
        past its push_timeout): forgotten, never let go."""
        for t in list(self.pending.values()):
            if t.owner == owner and t.req == req:
                del self.pending[t.id]
                return None
        for t in self.active.values():
            if t.owner == owner and t.req == req:
                del self.active[t.id]
                if via_failed is not None and t.route is not None and now is not None:
                    self.aggregator_failed(t.route.host, now)
                self.version = max(self.version, version)
                server = self.servers.setdefault(t.dst, ServerStats(t.dst))
                server.version = max(server.version or 0, version)
                server.applied += applied
                server.refused += not applied
                server.last_heard = now if now is not None else server.last_heard
                stats = self.workers.get(owner)
                if applied and delay is not None:
                    self.delays.add(delay)
                if stats is not None:
                    stats.applied += applied
                    stats.refused += not applied
                    stats.last_delay = delay if applied else stats.last_delay
                return t
        return None

    def forget(self, owner: Hashable) -> list[Transfer]:
        """The owner is gone: its transfers, pending or active, are forgotten."""
        gone = [t for t in (*self.pending.values(), *self.active.values()) if t.owner == owner]
        for t in gone:
            self.pending.pop(t.id, None)
            self.active.pop(t.id, None)
        self.workers.pop(owner, None)
        return gone

    def aggregator_failed(self, host: str, now: float) -> None:
        """Route nothing through `host` for `bench_seconds`."""
        self.benched[host] = now + self.bench_seconds

    def usable_aggregators(self, now: float) -> dict[str, str]:
        """Aggregators neither benched nor on a host whose agent is unreachable."""
        return {h: a for h, a in self.aggregators.items()
                if self.benched.get(h, -math.inf) <= now
                and (h not in self.agents or self.agents[h].reachable)}

    def set_network(self, network: Network) -> None:
        self.network = network

    def add_agent(self, host: str, address: str) -> None:
        self.agents[host] = AgentStats(host, address)

    def agent_reported(self, host: str, *, now: float, peers: int, fresh: int) -> None:
        a = self.agents[host]
        a.reachable, a.last_report, a.peers, a.fresh, a.error = True, now, peers, fresh, ""

    def agent_unreachable(self, host: str, error: str) -> None:
        a = self.agents[host]
        a.reachable, a.error = False, error

    # -- decisions ------------------------------------------------------------

    def snapshot(self, now: float) -> Snapshot:
        return Snapshot(
            now=now,
            version=self.version,
            tau_max=self.tau_max,
            pending=tuple(sorted(self.pending.values(), key=lambda t: t.id)),
            active=tuple(sorted(self.active.values(), key=lambda t: t.id)),
            network=self.network,
            aggregators=self.usable_aggregators(now),
        )

    def decide(self, now: float) -> Decisions:
        """Ask the policy, and commit what is due now: transfers whose start
        has come are let go, drops are final. Later starts are re-planned at
        `wake_at` (or earlier, at the next event)."""
        if not self.pending:
            return Decisions((), None)
        plan = self.policy(self.snapshot(now))
        wake_at = math.inf
        if isinstance(plan, ColumnPlan):
            plan, later = plan.due(now)
            wake_at = later if later is not None else math.inf
        actions: list[Go | Drop] = []
        for item in plan:
            t = self.pending.get(item.id)
            if t is None:
                continue
            stats = self.workers.get(t.owner)
            if item.drop is not None:
                del self.pending[t.id]
                actions.append(Drop(t, item.drop, item.detail))
                if stats is not None:
                    stats.dropped += 1
            elif item.start is not None and item.start <= now:
                del self.pending[t.id]
                t.started, t.position = now, item.position
                t.planned_seconds = item.planned_seconds
                t.route = item.route
                self.active[t.id] = t
                actions.append(Go(t, item.position or 0, item.planned_seconds or 0.0,
                                  item.route))
                if stats is not None:
                    stats.sent += 1
            elif item.start is not None:
                wake_at = min(wake_at, item.start)
        return Decisions(tuple(actions), None if wake_at == math.inf else wake_at)

    def status(self, now: float | None = None) -> dict[str, object]:
        """The job at a glance (what `mlfabric status` prints), JSON-ready.
        Ages (seconds) are measured to `now`; without it they are None."""
        net = self.network
        hosts = sorted({*net.up, *net.down, *(w.host for w in self.workers.values() if w.host),
                        *self.servers})
        return {
            "server_version": self.version,
            "tau_max": self.tau_max,
            "pending": len(self.pending),
            "active": len(self.active),
            "servers": [
                {"host": v.host, "version": v.version, "transfers": v.transfers,
                 "applied": v.applied, "refused": v.refused,
                 "last_heard_age_s": _age(v.last_heard, now)}
                for v in sorted(self.servers.values(), key=lambda v: v.host)],
            "replicas": [dict(r) for _, r in sorted(self.replicas.items())],
            "agents": [
                {"host": a.host, "address": a.address, "reachable": a.reachable,
                 "last_report_age_s": _age(a.last_report, now), "peers": a.peers,
                 "fresh": a.fresh, "error": a.error}
                for a in sorted(self.agents.values(), key=lambda a: a.host)],
            "workers": [vars(w).copy() for w in sorted(self.workers.values(),
                                                        key=lambda w: w.name)],
            "delay": self.delays.summary(),
            "bandwidth": {h: {"up_bytes_per_s": net.up.get(h, net.default),
                              "down_bytes_per_s": net.down.get(h, net.default),
                              "up_left_bytes_per_s": net.up_rate(h),
                              "down_left_bytes_per_s": net.down_rate(h)} for h in hosts},
            "default_bytes_per_s": net.default,
            "measured_paths": {f"{a}->{b}": rate for (a, b), rate in sorted(net.pair.items())},
        }
