"""What the controller plans with, without I/O: the network picture
(`Network`), the transfers workers asked for (`Transfer`), a policy's input
(`Snapshot`) and output (`PlanItem`, or `ColumnPlan` for plans built lazily),
and the plain FIFO policy. The shortest-transfer-first policy built on the
scheduling core is in `policies`; the controller's bookkeeping around them is
`mlfabric.controller.state`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple, overload

import numpy as np

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
    capacity (at least `MIN_LEFT` of it). `observed_up`/`observed_down` cap
    a host's link at what the job's own transfers were last delivered
    (`observed`: the controller's closed loop). `up_share` is the part of
    every host's uplink this picture's planner may reserve: with several
    controllers (issue 34) each plans some server shards, and the workers'
    uplinks, which carry a part to every shard, are split between them by
    the number of shards each plans, so no uplink is reserved twice over."""

    default: float = 125e6  # 1 Gbit/s
    up: Mapping[str, float] = field(default_factory=dict)
    down: Mapping[str, float] = field(default_factory=dict)
    pair: Mapping[tuple[str, str], float] = field(default_factory=dict)
    load_up: Mapping[str, float] = field(default_factory=dict)
    load_down: Mapping[str, float] = field(default_factory=dict)
    observed_up: Mapping[str, float] = field(default_factory=dict)
    observed_down: Mapping[str, float] = field(default_factory=dict)
    up_share: float = 1.0

    @functools.cached_property
    def up_rates(self) -> Mapping[str, float]:
        """`up_rate` of every host, computed once per host (a Network never changes)."""
        return _Rates(self.up_rate)

    @functools.cached_property
    def down_rates(self) -> Mapping[str, float]:
        return _Rates(self.down_rate)

    def up_rate(self, host: str) -> float:
        """What the job can send from `host`: its uplink less others' load."""
        left = _left(self.up.get(host, self.default), self.load_up.get(host, 0.0)) * self.up_share
        return min(left, self.observed_up.get(host, left))

    def down_rate(self, host: str) -> float:
        left = _left(self.down.get(host, self.default), self.load_down.get(host, 0.0))
        return min(left, self.observed_down.get(host, left))

    def fastest(self, src: str, dst: str) -> float:
        """The most the path could give the job: the links' capacities, less no
        load and capped by no observation. Either can be out of date the
        moment a tenant stops or a link recovers, and a transfer then runs
        faster than `rate` says."""
        return min(self.up.get(src, self.default), self.down.get(dst, self.default))

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
    shard: int = 0  # the server shard it goes to (each keeps its own version)
    # A chunked transfer (`chunk` > 0) is let go a chunk at a time: `granted`
    # data bytes are let go so far, the last grant being `piece` bytes. Between
    # grants it is pending again, planned with what is left to send.
    chunk: int = 0
    granted: int = 0
    piece: int = 0
    # The path's rate the controller believed when it let this go (the rate
    # its planned_seconds assumed the path to have: `observed`).
    path_rate: float | None = None
    # Compressed forms its worker can send (issue 35): (codec, bytes, the
    # worker's encoding seconds), from the least compressed; `codec` is the
    # one its go named (None: whole).
    options: tuple[tuple[str, int, float], ...] = ()
    codec: str | None = None
    # When its server reported it landed, before its worker did (the
    # controller's clock; None: not so reported).
    landed_at: float | None = None

    def option_bytes(self, codec: str | None) -> int:
        """The bytes the transfer takes compressed by `codec` (None: whole)."""
        for name, nbytes, _ in self.options:
            if name == codec:
                return nbytes
        return self.nbytes

    @property
    def rest(self) -> int:
        """The bytes not let go yet."""
        return self.nbytes - self.granted


@dataclass(frozen=True)
class Snapshot:
    """What a policy sees: the state at `now`, read-only.

    With sharded servers the controller plans one shard at a time: `pending`
    holds that shard's transfers and `version` is its version, while
    `active` holds every running transfer (they all hold links) and
    `in_flight` counts those still to be applied at this shard."""

    now: float
    version: int  # newest server version heard of
    tau_max: int | None
    pending: tuple[Transfer, ...]
    active: tuple[Transfer, ...]
    network: Network
    aggregators: Mapping[str, str] = field(default_factory=dict)  # host -> address, usable now
    in_flight: int | None = None  # None: len(active)
    # Seconds a transfer's successor waits past its end for its report and
    # go, as measured (`ControlState.handover`; 0: unknown). Short transfers
    # let theirs go at their planned end instead (`policies.trusted`).
    handover: float = 0.0

    @property
    def server_in_flight(self) -> int:
        """Updates let go to this server and not yet applied."""
        return len(self.active) if self.in_flight is None else self.in_flight


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
    codec: str | None = None  # go compressed by this of the transfer's options


class ColumnPlan(Sequence[PlanItem]):
    """A policy's plan kept as columns, its `PlanItem`s built only when read.

    A plan holds one item per pending transfer, and most of them start
    later: `ControlState.decide` reads only what is due (`due`), so a re-plan
    over thousands of pending transfers builds a few items, not thousands.
    Read as a sequence (aggregation, the replication gate), it holds the
    sends in position order, then the drops, as a list would."""

    def __init__(self, ids: Sequence[int] | np.ndarray, start: Sequence[float] | np.ndarray,
                 end: Sequence[float] | np.ndarray, position: Sequence[int] | np.ndarray,
                 drops: Sequence[PlanItem], codecs: Mapping[int, str] | None = None,
                 later: float = math.inf) -> None:
        """Send k: transfer ids[k] from start[k] to end[k] at `position[k]`,
        compressed by codecs[ids[k]] if there is one. A plan that stopped
        early (`PlanConfig.plan_ahead`) holds no item for the transfers it
        left out; `later` is the earliest any of them could start."""
        self._ids = np.asarray(ids, np.int64)
        self._start = np.asarray(start, np.float64)
        self._end = np.asarray(end, np.float64)
        self._position = np.asarray(position, np.int64)
        self._drops = drops
        self._codecs = codecs or {}
        self._later = later

    def _send(self, k: int) -> PlanItem:
        start = float(self._start[k])
        tid = int(self._ids[k])
        return PlanItem(tid, start=start, position=int(self._position[k]),
                        planned_seconds=float(self._end[k]) - start,
                        codec=self._codecs.get(tid))

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
        position order, then the drops) and the earliest later start (of the
        transfers left out too: the plan must be made again by then)."""
        start = self._start
        items = [self._send(k) for k in np.flatnonzero(start <= now).tolist()]
        waiting = start[start > now]
        items.extend(self._drops)
        later = min(float(waiting.min()) if len(waiting) else math.inf, self._later)
        return items, later if later < math.inf else None


Policy = Callable[[Snapshot], Sequence[PlanItem]]


def fifo_policy(snap: Snapshot) -> list[PlanItem]:
    """The plain asynchronous parameter server: everything goes at once, in
    arrival order; concurrent transfers share the links as TCP shares them."""
    items = []
    in_flight = snap.server_in_flight
    for i, t in enumerate(sorted(snap.pending, key=lambda t: (t.arrival, t.id))):
        sharing = in_flight + i + 1
        rate = snap.network.rate(t.host, t.dst) / sharing
        items.append(PlanItem(t.id, start=snap.now, position=in_flight + i,
                              planned_seconds=t.nbytes / rate))
    return items
