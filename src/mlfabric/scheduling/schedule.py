"""The scheduling core: pure functions from the transfers waiting to be sent to
the order, start times and rates that send them, or the drops.

    plan_rows(now, rows, running, network, server, config) -> RowPlan

is what production calls: the controller's "mlfabric" policy
(`policies.mlfabric_policy`) ranks its pending transfers into `Rows` and
builds the `ColumnPlan` it answers from the `RowPlan`. `plan(input, config)`
is the same core with one record per update (`PlanInput` in, `SendAt` or
`DropAt` out), for tests, benchmarks and docs/scheduling.md.

No clocks (time is an argument), no sockets, no asyncio, no metrics. The same
input always gives the same plan, whatever the order of the pending updates.

Network model (the design brief's big switch): host h has an uplink of
up[h] bytes/s and a downlink of down[h] bytes/s; a measured pair rate
bw[a][b], when there is one, is a third link that every transfer a -> b
crosses. A transfer's rate is bounded by every link on its path.

Reservation model (why: see docs/scheduling.md). Every link keeps its
residual capacity R(t) (capacity less running and planned reservations) as a
step function of time, and its *free-from* capacity F(t) = min over t' >= t of
R(t'): the rate that stays free from t on, until every planned reservation has
ended. F is non-decreasing. A transfer that starts at s gets the constant rate
min over its links of F(s) for its whole duration, so it never overbooks a
link, and it starts at the time that makes it complete earliest.

Policies:

* ``"mlfabric"``: shortest-transfer-first with deadlines and drops (the
  algorithm of the design brief, "The scheduling algorithm", steps 1-4).
* ``"fifo"``: the plain asynchronous parameter server: every update sends now
  at its max-min fair share; the scheduler drops nothing.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from bisect import bisect_right
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from ..errors import ConfigError

Host = Hashable
PolicyName = Literal["mlfabric", "fifo"]
POLICIES: tuple[str, ...] = ("mlfabric", "fifo")

DEADLINE_MISSED = "deadline_missed"
WOULD_IDLE_SERVER = "would_idle_server"
STALEST_IN_OVERLOAD = "stalest_in_overload"
# Every DropAt carries one of these (metrics label them, so the set is fixed).
DROP_REASONS: tuple[str, ...] = (DEADLINE_MISSED, WOULD_IDLE_SERVER, STALEST_IN_OVERLOAD)
# What to drop when the pending updates cannot all meet their deadlines.
OVERLOAD_RULES: tuple[str, ...] = ("stalest", "deadline")

INF = math.inf

# The compiled hot loop of the "mlfabric" policy (None when the extension is not
# built, as in a checkout without build_ext: the pure-Python reference below
# then runs instead, and gives the same plans).
_stf_kernel: Callable[..., tuple[int, int, float]] | None
_running_segments: Callable[..., tuple[np.ndarray, ...]] | None
try:
    from ._stf import running_segments as _running_segments
    from ._stf import schedule_stf as _stf_kernel
except ImportError:  # pragma: no cover - an installed package always has it
    _stf_kernel = _running_segments = None


# --- the snapshot (input) -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PendingUpdate:
    """An update handed to mlfabric and not started yet."""

    id: int
    source: Host  # the worker's host
    destination: Host  # the server's host
    size: int  # bytes
    base_version: int  # v(g): the model version it was computed on
    norm: float  # ||u||_2, carried for the replica's divergence bound; unused here
    arrival: float  # when the request reached the controller (snapshot clock)


@dataclass(frozen=True, slots=True)
class RunningTransfer:
    """A transfer already started: it keeps `rate` on its path until `end`."""

    id: int
    source: Host
    destination: Host
    rate: float  # bytes/s
    end: float  # expected end (snapshot clock)


@dataclass(frozen=True, slots=True)
class Capacities:
    """Available capacities in bytes/s; `pair[(a, b)]` is a measured a -> b rate."""

    up: Mapping[Host, float]
    down: Mapping[Host, float]
    pair: Mapping[tuple[Host, Host], float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ServerState:
    """The server's version, and how many started updates it applies first."""

    version: int
    in_flight: int = 0  # scheduled and running, applied before any pending one


@dataclass(frozen=True, slots=True)
class PlanInput:
    now: float
    pending: Sequence[PendingUpdate]
    running: Sequence[RunningTransfer]
    network: Capacities
    server: ServerState


@dataclass(frozen=True, slots=True)
class PlanConfig:
    """`idle_factor`: drop a forced update when the server idle it causes exceeds
    idle_factor times the transfer time it displaces (None: never).

    `overload`: when the plan cannot meet every deadline, which updates go.
    "deadline" drops the ones whose deadline passes (the brief's rule as
    written: the others are forced in at their deadlines, at delay tau_max);
    "stalest" drops as many updates, but the stalest ones, and plans the rest
    again, so the updates applied are the freshest the link can carry. The
    number of drops is never higher than under "deadline"."""

    policy: PolicyName = "mlfabric"
    tau_max: int | None = None  # None: no deadlines
    idle_factor: float | None = 1.0
    overload: str = "stalest"
    # plan_indexed given its `now`: fill at least this many positions, then
    # stop as soon as nothing left can start by then (0: plan every row;
    # plan and plan_rows always do). See _stf.schedule_stf.
    plan_ahead: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.tau_max is not None and self.tau_max < 0:
            raise ConfigError(f"tau_max must be >= 0 (or None), got {self.tau_max}")
        if self.idle_factor is not None and not self.idle_factor >= 0:
            raise ConfigError(
                f"idle_factor must be >= 0 (or None to turn the idle rule off), "
                f"got {self.idle_factor}"
            )
        if self.overload not in OVERLOAD_RULES:
            raise ConfigError(
                f"overload must be one of {OVERLOAD_RULES}, got {self.overload!r}")
        if self.plan_ahead < 0:
            raise ConfigError(f"plan_ahead must be >= 0 positions (0: plan every update), "
                              f"got {self.plan_ahead}")


# --- the plan (output) --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SendAt:
    """Send update `id` at `start` (== plan.now: send now) at `rate` bytes/s.

    The server applies it at version plan.v_init + position."""

    id: int
    start: float
    rate: float
    position: int
    end: float  # expected end of the transfer


@dataclass(frozen=True, slots=True)
class DropAt:
    """Update `id` is not sent; its worker is told `reason` (one of DROP_REASONS).

    `position` is the schedule position being filled when it was dropped. For
    would_idle_server, `idle` is the server idle time it would have caused and
    `displaced` the transfer time it would have displaced (seconds)."""

    id: int
    reason: str
    position: int
    idle: float = 0.0
    displaced: float = 0.0


Decision = SendAt | DropAt


@dataclass(frozen=True)
class Plan:
    policy: str
    now: float
    v_init: int  # the version the update at position 0 is applied at
    order: tuple[int, ...]  # ids of the sent updates, by position
    directives: dict[int, Decision]  # one per pending update, by id
    drops: tuple[DropAt, ...]  # in the order they were decided

    def send_now(self) -> list[SendAt]:
        """The transfers the executor starts at once, by position."""
        sends = (self.directives[i] for i in self.order)
        return [d for d in sends if isinstance(d, SendAt) and d.start <= self.now]


# --- entry point --------------------------------------------------------------------


def plan(snapshot: PlanInput, config: PlanConfig | None = None, *, use_kernel: bool = True) -> Plan:
    """Decide, for every pending update, when and how fast it is sent, or drop it.

    The "mlfabric" policy runs in the compiled kernel (mlfabric.scheduling._stf) when it
    is built; `use_kernel=False` runs the pure-Python reference, which gives
    the identical plan."""
    config = config or PlanConfig()
    pending = _sorted_pending(snapshot.pending)
    _check_times(snapshot.now, snapshot.running)
    v_init = snapshot.server.version + snapshot.server.in_flight
    if config.policy == "fifo":
        net = _LinkTable(snapshot.network, snapshot.now)
        net.load_running(snapshot.running)
        paths = [net.path(u.source, u.destination) for u in pending]
        sends, drops = _plan_fifo(snapshot.now, pending, paths)
    else:
        # Rows in id order: the row stands for the id in every tie.
        rows = _plan_rows(snapshot.now, Rows.of(pending), snapshot.running, snapshot.network,
                          v_init, config, _stf_kernel if use_kernel else None)
        sends, drops = rows.directives([u.id for u in pending])
    directives: dict[int, Decision] = {d.id: d for d in drops}
    directives.update((s.id, s) for s in sends)
    return Plan(
        policy=config.policy,
        now=snapshot.now,
        v_init=v_init,
        order=tuple(s.id for s in sends),
        directives=directives,
        drops=tuple(drops),
    )


def ready_at(now: float, running: Sequence[RunningTransfer]) -> float:
    """When the server has applied what is running: before any pending update."""
    return max([now, *(r.end for r in running)])


def _sorted_pending(pending: Sequence[PendingUpdate]) -> list[PendingUpdate]:
    """Pending updates by id (ties anywhere are broken by id), checked."""
    ordered = sorted(pending, key=lambda u: u.id)
    for a, b in itertools.pairwise(ordered):
        if a.id == b.id:
            raise ConfigError(f"pending update id {a.id} appears twice in the snapshot")
    for u in ordered:
        if not u.size > 0:
            raise ConfigError(f"pending update {u.id} has size {u.size}; sizes must be > 0 bytes")
    return ordered


def _check_times(now: float, running: Sequence[RunningTransfer]) -> None:
    if not math.isfinite(now):
        raise ConfigError(f"snapshot.now is {now}; it must be a finite number of seconds")
    for r in running:
        if not (r.rate >= 0 and math.isfinite(r.rate)):
            raise ConfigError(f"running transfer {r.id} has rate {r.rate}; need a finite rate >= 0")
        if not math.isfinite(r.end):
            raise ConfigError(f"running transfer {r.id} has end {r.end}; need a finite time")


# --- links: residual and free-from capacity as step functions -------------------------


class _Link:
    """One link's residual capacity R and free-from capacity F over [now, inf).

    Segment k covers [times[k], times[k+1]) (the last one runs to infinity).
    `version` grows on every change, so a cached completion time that used
    this link can tell it is stale."""

    __slots__ = ("free", "index", "residual", "times", "version")

    def __init__(self, now: float, capacity: float, index: int = 0) -> None:
        self.index = index  # creation order: a deterministic key for ties
        self.times = [now]
        self.residual = [capacity]
        self.free = [capacity]
        self.version = 0

    def _split(self, t: float) -> int:
        """Index of the segment starting at t, inserting a breakpoint if needed."""
        times = self.times
        k = bisect_right(times, t) - 1
        if times[k] == t:
            return k
        times.insert(k + 1, t)
        self.residual.insert(k + 1, self.residual[k])
        self.free.insert(k + 1, self.free[k])
        return k + 1

    def reserve(self, start: float, end: float, rate: float) -> None:
        """Take `rate` over [start, end), then bring F up to date."""
        i = self._split(start)
        j = self._split(end)
        residual, free = self.residual, self.free
        for k in range(i, j):
            residual[k] -= rate
        # F(k) = min(R(k), F(k+1)), from the back. Before `start`, F only
        # changes while R there is above the new F, so stop at the first
        # segment it does not reach.
        nxt = free[j] if j < len(free) else INF
        for k in range(j - 1, -1, -1):
            r = residual[k]
            if k < i and r <= nxt:
                break
            nxt = free[k] = r if r < nxt else nxt
        self.version += 1
        self._forget_zero_prefix()

    def _forget_zero_prefix(self) -> None:
        """Collapse the leading segments where F is 0 into one.

        F only ever decreases, so nothing can start there any more: keeping
        those breakpoints would only slow down every later scan."""
        free = self.free
        if free[0] > 0.0 or len(free) < 2 or free[1] > 0.0:
            return
        k = bisect_right(free, 0.0) - 1  # F is non-decreasing: zeros are a prefix
        now = self.times[0]
        del self.times[:k], self.residual[:k], free[:k]
        self.times[0] = now
        self.residual[0] = 0.0

    def load_running(self, running: Sequence[tuple[float, float]]) -> None:
        """Start from the running transfers' reservations, (end, rate) each over
        [now, end): one pass, however many there are. R never goes below 0 (the
        running rates may exceed a capacity that was just measured lower)."""
        capacity = self.residual[-1]
        load_ending_at: dict[float, float] = {}
        for end, rate in running:
            load_ending_at[end] = load_ending_at.get(end, 0.0) + rate
        ends = sorted(load_ending_at)
        self.times = [self.times[0], *ends]
        self.residual = [0.0] * len(self.times)
        self.residual[-1] = capacity
        load = 0.0
        for k in range(len(ends) - 1, -1, -1):  # segment k ends at ends[k]
            load += load_ending_at[ends[k]]
            self.residual[k] = max(0.0, capacity - load)
        self.free = list(self.residual)
        for k in range(len(ends) - 1, -1, -1):
            if self.free[k + 1] < self.free[k]:
                self.free[k] = self.free[k + 1]
        self.version += 1


class _LinkTable:
    """The links of the big switch, created on first use."""

    def __init__(self, network: Capacities, now: float) -> None:
        self.network = network
        self.now = now
        self.up: dict[Host, _Link] = {}
        self.down: dict[Host, _Link] = {}
        self.pair: dict[tuple[Host, Host], _Link] = {}
        self.links: list[_Link] = []  # by index

    @staticmethod
    def _capacity(table: Mapping, key: object, what: str) -> float:
        try:
            c = float(table[key])
        except KeyError:
            raise ConfigError(
                f"no {what} capacity for {key!r} in the snapshot's network; every host "
                f"that sends or receives needs network.up and network.down entries"
            ) from None
        if not (c > 0 and math.isfinite(c)):
            raise ConfigError(
                f"{what} capacity of {key!r} is {c}; capacities must be finite and > 0 "
                f"(floor a measured 0 at a small rate)"
            )
        return c

    def _link(self, cache: dict, table: Mapping, key: object, what: str) -> _Link:
        link = cache.get(key)
        if link is None:
            capacity = self._capacity(table, key, what)
            link = cache[key] = _Link(self.now, capacity, len(self.links))
            self.links.append(link)
        return link

    def path(self, src: Host, dst: Host) -> tuple[_Link, ...]:
        """(uplink of src, downlink of dst[, pair link src -> dst])."""
        # Called once per update and running transfer: the common case (links
        # seen before, no pair rate) stays two dictionary lookups.
        up = self.up.get(src) or self._link(self.up, self.network.up, src, "uplink")
        down = self.down.get(dst) or self._link(self.down, self.network.down, dst, "downlink")
        if self.network.pair and (src, dst) in self.network.pair:
            pair = self._link(self.pair, self.network.pair, (src, dst), "pair")
            return (up, down, pair)
        return (up, down)

    def load_running(self, running: Sequence[RunningTransfer]) -> None:
        """Reserve what the running transfers (those not over yet) hold."""
        now = self.now
        per_link: dict[int, list[tuple[float, float]]] = {}
        for r in sorted(running, key=lambda r: r.id):
            if r.end > now and r.rate > 0:
                for link in self.path(r.source, r.destination):
                    per_link.setdefault(link.index, []).append((r.end, r.rate))
        for index, items in per_link.items():
            self.links[index].load_running(items)


def earliest_completion(path: Sequence[_Link], size: float) -> tuple[float, float, float]:
    """(end, start, rate) of the earliest-completing transfer of `size` bytes on `path`.

    Candidate starts are the breakpoints of the path's free-from capacity (the
    minimum of its links'): between two breakpoints a later start only ends
    later. No rate exceeds the path's capacity c, so the scan stops at the
    first start t with t + size / c >= the best end found. end is inf if the
    path never has capacity."""
    best_end, best_start, best_rate = INF, 0.0, 0.0
    if len(path) == 2:  # no pair link: the common case, kept tight
        a, b = path
        ta, fa, tb, fb = a.times, a.free, b.times, b.free
        na, nb = len(ta), len(tb)
        fastest = size / (fa[-1] if fa[-1] < fb[-1] else fb[-1])
        i = j = 0
        t = ta[0]
        while True:
            rate = fa[i] if fa[i] < fb[j] else fb[j]
            if rate > 0.0:
                end = t + size / rate
                if end < best_end:
                    best_end, best_start, best_rate = end, t, rate
            ti = ta[i + 1] if i + 1 < na else INF
            tj = tb[j + 1] if j + 1 < nb else INF
            t = ti if ti < tj else tj
            if t + fastest >= best_end:  # also ends the scan at t == inf
                return best_end, best_start, best_rate
            if ti == t:
                i += 1
            if tj == t:
                j += 1
    ptr = [0] * len(path)
    t = path[0].times[0]
    fastest = size / min(link.free[-1] for link in path)
    while True:
        rate = min(link.free[p] for link, p in zip(path, ptr, strict=True))
        if rate > 0.0:
            end = t + size / rate
            if end < best_end:
                best_end, best_start, best_rate = end, t, rate
        nxt = [
            link.times[p + 1] if p + 1 < len(link.times) else INF
            for link, p in zip(path, ptr, strict=True)
        ]
        t = min(nxt)
        if t + fastest >= best_end:
            return best_end, best_start, best_rate
        ptr = [p + 1 if n == t else p for p, n in zip(ptr, nxt, strict=True)]


def _reserve(path: Sequence[_Link], start: float, end: float, rate: float) -> None:
    for link in path:
        link.reserve(start, end, rate)


def _stamp(path: Sequence[_Link]) -> int:
    """Changes whenever a link of the path changes (versions only grow)."""
    return sum(link.version for link in path)


# --- policy "mlfabric": shortest-transfer-first with deadlines and drops ----------------


class _Front:
    """One destination's free updates, walked by (size, -capacity, index).

    `groups` holds one list per size, [size, start, member, member, ...],
    with members sorted by (-capacity, index) and `start` the position of the
    first member that may still be live (members that leave are skipped once)."""

    __slots__ = ("by_size", "dest", "groups")

    def __init__(self, dest: _Link) -> None:
        self.dest = dest
        self.groups: list[list] = []
        self.by_size: dict[int, list] = {}

    def add(self, k: int, size: int, order_key: Callable[[int], tuple[float, int]]) -> None:
        group = self.by_size.get(size)
        if group is None:
            group = self.by_size[size] = [size, 2]
            self.groups.insert(bisect_right(self.groups, size, key=_group_size), group)
        pos = bisect_right(group, order_key(k), lo=group[1], key=order_key)
        group.insert(pos, k)

    def compact(self, live: Callable[[int], bool]) -> None:
        """Forget the groups that have no live member left."""
        kept = []
        for group in self.groups:
            if any(live(m) for m in group[group[1]:]):
                kept.append(group)
            else:
                del self.by_size[group[0]]
        self.groups = kept


def _group_size(group: list) -> int:
    return group[0]


class _Candidates:
    """The unscheduled updates and an exact, fast search for the earliest completion.

    The best update is the least by (end, size, -capacity, index): earliest
    completion, ties to the smaller update, then to the faster path, then to
    the lower id. (Index order is id order.)

    An update is *free* when its private links (the source's uplink, the pair
    link) cannot hold it back: they carry no reservation at any time at which
    its destination D has free capacity. Its end then depends only on D's
    free-from profile F_D, its size S and its path capacity c (the least
    capacity on the path):

        end = min over breakpoints t of F_D:  t + S / min(c, F_D(t))

    which grows with S and shrinks with c. So among the free updates of one
    destination, one with a smaller (or equal) size and a larger (or equal)
    capacity is never worse, and a search only evaluates the Pareto front:
    walk them by (S, -c, index), evaluate an update only if its c beats every
    c walked so far, and stop once t0(D) + S / capacity(D) (a lower bound of
    every later end) passes the best end found. With one model size that is
    one evaluation per search.

    The other updates (*held*: their source still sends an earlier transfer)
    sit in a heap of their last computed keys. A reservation only takes
    capacity away, so a stale key is a lower bound of the current one, and
    the first current key on top is the best of them. A held update becomes
    free again once D has no free capacity before its private reservations
    end (checked when its key surfaces). Completion times are cached until a
    link on the path changes."""

    def __init__(self, pending: Sequence[PendingUpdate], paths: Sequence[tuple[_Link, ...]]):
        n = len(pending)
        self.sizes = [u.size for u in pending]
        self.paths = paths
        self.alive = [True] * n
        self.start = [0.0] * n
        self.rate = [0.0] * n
        self.end = [INF] * n
        self.stamp = [-1] * n
        self.capacity = [min(_capacity(link) for link in path) for path in paths]
        self.free = [False] * n
        self.fronts: dict[int, _Front] = {}
        # who to tell when a private link gets a reservation
        self.users: dict[int, list[int]] = {}
        self.held: list[tuple[float, int, float, int]] = []
        for k, path in enumerate(paths):
            if path[1].index not in self.fronts:
                self.fronts[path[1].index] = _Front(path[1])
            if self._may_be_free(k):
                self._make_free(k)
            else:
                self.held.append(self.key(k))
        heapq.heapify(self.held)

    # path[::2] are the private links: the uplink, and the pair link if any.

    def _may_be_free(self, k: int) -> bool:
        path = self.paths[k]
        t0 = _first_free(path[1])
        return all(link.times[-1] <= t0 or _flat(link) for link in path[::2])

    def _make_free(self, k: int) -> None:
        path = self.paths[k]
        self.free[k] = True
        cap = self.capacity
        self.fronts[path[1].index].add(k, self.sizes[k], lambda m: (-cap[m], m))
        for link in path[::2]:
            self.users.setdefault(link.index, []).append(k)

    def completion(self, k: int) -> float:
        """End time of update k on the current reservations (cached per stamp)."""
        path = self.paths[k]
        stamp = _stamp(path)
        if stamp != self.stamp[k]:
            self.end[k], self.start[k], self.rate[k] = earliest_completion(path, self.sizes[k])
            self.stamp[k] = stamp
        return self.end[k]

    def key(self, k: int) -> tuple[float, int, float, int]:
        return (self.completion(k), self.sizes[k], -self.capacity[k], k)

    def best(self, exclude: int = -1) -> int:
        """Index of the alive update that completes earliest (not `exclude`), or -1."""
        best = self._best_held(exclude)
        for front in self.fronts.values():
            if front.groups:
                best = self._best_free(front, exclude, best)
        return best[3] if best is not None else -1

    def _best_free(self, front: _Front, exclude: int, best):
        """Walk the Pareto front of one destination's free updates (see class doc)."""
        alive, free, cap, sizes = self.alive, self.free, self.capacity, self.sizes
        t0 = _first_free(front.dest)
        cap_dest = _capacity(front.dest)
        best_end = best[0] if best is not None else INF
        c_walked = 0.0
        emptied = 0
        for group in front.groups:
            h = group[1]
            n = len(group)
            while h < n and not (alive[group[h]] and free[group[h]]):
                h += 1
            group[1] = h
            if h == n:
                emptied += 1
                continue
            k = group[h]
            if k == exclude:
                k = next((m for m in group[h + 1:] if alive[m] and free[m] and m != exclude), -1)
                if k < 0:
                    continue
            if t0 + sizes[k] / cap_dest > best_end:
                break  # sizes only grow from here: no later end can be earlier
            if cap[k] > c_walked:
                c_walked = cap[k]
                key = self.key(k)
                if best is None or key < best:
                    best, best_end = key, key[0]
                if c_walked >= cap_dest:
                    break  # no later update is faster: all are dominated
        if emptied > 8 and emptied * 2 > len(front.groups):
            front.compact(lambda m: alive[m] and free[m])
        return best

    def _best_held(self, exclude: int):
        heap, alive, free, end = self.held, self.alive, self.free, self.end
        stamp, paths = self.stamp, self.paths
        held_back = []
        found = None
        while heap:
            top = heap[0]
            k = top[3]
            if not alive[k] or free[k]:
                heapq.heappop(heap)  # gone, or moved to the fronts
            elif stamp[k] != _stamp(paths[k]) or top[0] != end[k]:
                if self._may_be_free(k):
                    heapq.heappop(heap)
                    self._make_free(k)
                else:
                    heapq.heapreplace(heap, self.key(k))
            elif k == exclude:
                held_back.append(heapq.heappop(heap))
            else:
                found = top
                break
        for entry in held_back:
            heapq.heappush(heap, entry)
        return found

    def remove(self, k: int) -> None:
        self.alive[k] = False  # fronts and heap skip it from now on

    def reserved(self, path: tuple[_Link, ...]) -> None:
        """A reservation was made on `path`: free updates sharing its private
        links may be held back by it now."""
        for link in path[::2]:
            for k in self.users.pop(link.index, ()):
                if self.alive[k] and self.free[k]:
                    self.free[k] = False
                    heapq.heappush(self.held, self.key(k))


def _flat(link: _Link) -> bool:
    """True if the link's free-from capacity is the same at all times."""
    return link.free[0] == link.free[-1]


def _capacity(link: _Link) -> float:
    """The link's capacity: its free-from level once every reservation has ended."""
    return link.free[-1]


def _first_free(link: _Link) -> float:
    """The first time the link has any free capacity (it has after its last breakpoint)."""
    if link.free[0] > 0.0:
        return link.times[0]
    return link.times[1]


def deadline(update: PendingUpdate, v_init: int, tau_max: int) -> int:
    """dl(g) = v(g) + tau_max - v_init: the last position g may take (delay <= tau_max)."""
    return update.base_version + tau_max - v_init


def _deadline_buckets(
    pending: Sequence[PendingUpdate], v_init: int, tau_max: int | None
) -> dict[int, list[int]]:
    """Indices of the pending updates grouped by deadline (by index within one)."""
    buckets: dict[int, list[int]] = {}
    if tau_max is not None:
        for k, u in enumerate(pending):
            buckets.setdefault(deadline(u, v_init, tau_max), []).append(k)
    return buckets


def _plan_stf(
    ready: float,
    pending: Sequence[PendingUpdate],
    paths: Sequence[tuple[_Link, ...]],
    v_init: int,
    config: PlanConfig,
) -> tuple[list[SendAt], list[DropAt]]:
    """Fill positions 0, 1, ... : a forced update (dl == position) if one is
    kept, else the earliest completion. `ready` is when the server has
    applied everything before position 0 (the running transfers)."""
    cand = _Candidates(pending, paths)
    buckets = _deadline_buckets(pending, v_init, config.tau_max)
    sends: list[SendAt] = []
    drops: list[DropAt] = []
    unscheduled = len(pending)

    def drop(k: int, reason: str, position: int, idle: float = 0.0, displaced: float = 0.0):
        nonlocal unscheduled
        cand.remove(k)
        unscheduled -= 1
        drops.append(DropAt(pending[k].id, reason, position, idle, displaced))

    for dl in sorted(d for d in buckets if d < 0):
        for k in buckets[dl]:
            drop(k, DEADLINE_MISSED, 0)
    position = 0
    while unscheduled:
        for k in buckets.get(position - 1, ()):
            if cand.alive[k]:
                drop(k, DEADLINE_MISSED, position)
        chosen = _forced_choice(cand, buckets.get(position, ()), ready, config, position, drop)
        if chosen < 0:
            chosen = cand.best()
            if chosen < 0:
                break
        cand.completion(chosen)
        start, rate, end = cand.start[chosen], cand.rate[chosen], cand.end[chosen]
        if end == INF:  # cannot happen with capacities > 0, kept as a guard
            raise AssertionError(f"update {pending[chosen].id} has no capacity on its path")
        _reserve(paths[chosen], start, end, rate)
        cand.remove(chosen)
        cand.reserved(paths[chosen])
        unscheduled -= 1
        sends.append(SendAt(pending[chosen].id, start, rate, position, end))
        ready = max(ready, end)
        position += 1
    return sends, drops


def _forced_choice(
    cand: _Candidates,
    bucket: Sequence[int],
    ready: float,
    config: PlanConfig,
    position: int,
    drop: Callable[..., None],
) -> int:
    """The update forced into `position` by its deadline, or -1.

    Candidates with dl == position are tried in the tie order (end, size, ...).
    One is dropped as would_idle_server when the server would wait for it
    longer than idle_factor times the transfer it displaces: the one the
    shortest-transfer-first rule would put at this position instead."""
    forced = sorted(cand.key(k) for k in bucket if cand.alive[k])
    for *_, f in forced:
        if config.idle_factor is None:
            return f
        h = cand.best(exclude=f)
        if h < 0 or cand.key(h) > cand.key(f):
            return f  # f is the shortest-first choice anyway: nothing displaced
        idle = max(ready, cand.end[f]) - max(ready, cand.end[h])
        displaced = cand.end[h] - cand.start[h]
        if idle > config.idle_factor * displaced:
            drop(f, WOULD_IDLE_SERVER, position, idle, displaced)
            continue
        return f
    return -1


# --- the same policy on rows: the compiled kernel's path, and the reference's ---------
#
# What the controller hands over on every event is thousands of updates, and
# only the search itself runs in C: everything around it must cost little per
# update. So the policy takes the pending updates as columns (`Rows`) and
# answers with columns (`RowPlan`) that the caller turns into whatever
# records it needs. The kernel's pass builds objects only for the few links
# that carry a running transfer: every other link is one flat segment at its
# capacity, written straight into the kernel's arrays. The reference's pass
# (`use_kernel=False`, or no kernel built) runs `_plan_stf` on the same rows,
# and the overload rule is one piece of code for both.


@dataclass(frozen=True, slots=True)
class Rows:
    """Pending updates as columns: row k is one update. The row is its id in
    every tie (of two otherwise equal updates the lower row goes first)."""

    source: Sequence[Host]
    destination: Sequence[Host]
    size: np.ndarray  # bytes (float64)
    base_version: np.ndarray  # v(g) (int64)

    @classmethod
    def of(cls, pending: Sequence[PendingUpdate]) -> Rows:
        n = len(pending)
        return cls([u.source for u in pending], [u.destination for u in pending],
                   np.fromiter((u.size for u in pending), np.float64, n),
                   np.fromiter((u.base_version for u in pending), np.int64, n))

    def __len__(self) -> int:
        return len(self.source)


@dataclass(frozen=True, slots=True)
class RowPlan:
    """A plan over `Rows`: the sends by position (row, start, rate, end,
    position) and the drops in the order they were decided (row, reason,
    position, idle, displaced), as in `SendAt` and `DropAt`."""

    # The sends are lists, or arrays from the compiled core.
    send_row: Sequence[int] | np.ndarray
    start: Sequence[float] | np.ndarray
    rate: Sequence[float] | np.ndarray
    end: Sequence[float] | np.ndarray
    position: Sequence[int] | np.ndarray
    drop_row: list[int]
    reason: list[str]
    drop_position: list[int]
    idle: list[float]
    displaced: list[float]
    # A plan stopped early (PlanConfig.plan_ahead): the earliest any row it
    # left out could start. inf: every row is sent or dropped.
    unplanned_from: float = INF

    @classmethod
    def of(cls, sends: Sequence[SendAt], drops: Sequence[DropAt]) -> RowPlan:
        """The plan of `SendAt`s and `DropAt`s whose ids are rows."""
        return cls([d.id for d in sends], [d.start for d in sends], [d.rate for d in sends],
                   [d.end for d in sends], [d.position for d in sends],
                   [d.id for d in drops], [d.reason for d in drops],
                   [d.position for d in drops], [d.idle for d in drops],
                   [d.displaced for d in drops])

    def directives(self, ids: Sequence[int]) -> tuple[list[SendAt], list[DropAt]]:
        """`SendAt`s and `DropAt`s, row k standing for update ids[k]."""
        sends = [SendAt(ids[k], s, r, p, e) for k, s, r, e, p in
                 zip(*(np.asarray(c).tolist() for c in (self.send_row, self.start, self.rate,
                                                         self.end, self.position)), strict=True)]
        drops = [DropAt(ids[k], why, p, i, d) for k, why, p, i, d in
                 zip(self.drop_row, self.reason, self.drop_position, self.idle, self.displaced,
                     strict=True)]
        return sends, drops


def plan_rows(now: float, rows: Rows, running: Sequence[RunningTransfer], network: Capacities,
              server: ServerState, config: PlanConfig) -> RowPlan:
    """`plan` for the "mlfabric" policy on rows, without a record per update.

    The controller calls this on every event. It gives the plan `plan` gives
    for the same updates with ids 0..n-1 (the pure-Python reference when the
    kernel is not built)."""
    if config.policy != "mlfabric":
        raise ConfigError(f"plan_rows plans the mlfabric policy, got policy {config.policy!r}")
    _check_times(now, running)
    size = np.asarray(rows.size, np.float64)
    if len(size) and not bool(np.all(size > 0)):
        k = int(np.flatnonzero(~(size > 0))[0])
        raise ConfigError(f"pending update {k} has size {size[k]}; sizes must be > 0 bytes")
    v_init = server.version + server.in_flight
    if not len(rows):
        return RowPlan([], [], [], [], [], [], [], [], [], [])
    return _plan_rows(now, rows, running, network, v_init, config, _stf_kernel)


class _KernelLinks:
    """Every link the rows cross, indexed for the kernel. Links that carry a
    running transfer come from `_LinkTable` (`reserved`, their step
    functions); every other link is flat at its capacity, never built as an
    object (`LinkSegments.of` writes both into the kernel's arrays)."""

    def __init__(self, network: Capacities, now: float, running: Sequence[RunningTransfer],
                 rows: Rows) -> None:
        table = _LinkTable(network, now)
        table.load_running(running)
        self.reserved = table.links  # indices 0 .. len - 1
        self.capacity = [_capacity(link) for link in table.links]
        self.up = self._indices({h: lk.index for h, lk in table.up.items()}, network.up,
                                rows.source, "uplink")
        self.down = self._indices({h: lk.index for h, lk in table.down.items()}, network.down,
                                  rows.destination, "downlink")
        if network.pair:
            keys = list(zip(rows.source, rows.destination, strict=True))
            known = {k: lk.index for k, lk in table.pair.items()}
            self._add(known, network.pair, [k for k in dict.fromkeys(keys)
                                            if k in network.pair and k not in known], "pair")
            self.pair = np.fromiter((known.get(k, -1) for k in keys), np.intp, len(keys))
        else:
            self.pair = np.full(len(rows), -1, np.intp)

    def _indices(self, known: dict[Host, int], capacities: Mapping[Host, float],
                 hosts: Sequence[Host], what: str) -> np.ndarray:
        self._add(known, capacities, [h for h in dict.fromkeys(hosts) if h not in known], what)
        return np.fromiter(map(known.__getitem__, hosts), np.intp, len(hosts))

    def _add(self, known: dict, capacities: Mapping, keys: list, what: str) -> None:
        """Flat links for `keys`, checked as `_LinkTable` checks them."""
        if not keys:
            return
        try:
            caps = [float(capacities[k]) for k in keys]
        except KeyError:
            caps = []
        if len(caps) != len(keys) or not all(c > 0 and math.isfinite(c) for c in caps):
            for k in keys:  # raises the clear error for the first bad one
                _LinkTable._capacity(capacities, k, what)
        base = len(self.capacity)
        known.update(zip(keys, range(base, base + len(keys)), strict=True))
        self.capacity.extend(caps)


_KERNEL_REASONS = ("", DEADLINE_MISSED, WOULD_IDLE_SERVER)


# One shortest-transfer-first pass over a subset of the rows (an array of them).
_Pass = Callable[[np.ndarray], RowPlan]


def _plan_rows(
    now: float,
    rows: Rows,
    running: Sequence[RunningTransfer],
    network: Capacities,
    v_init: int,
    config: PlanConfig,
    kernel: Callable[..., tuple[int, int, float]] | None,
) -> RowPlan:
    """The "mlfabric" policy on rows: a pass in the compiled kernel, or in the
    pure-Python reference (`kernel` None), then the overload rule."""
    make_pass = _reference_pass if kernel is None else functools.partial(_kernel_pass, kernel)
    one_pass = make_pass(now, rows, running, network, v_init, config)
    return _with_overload_rule(one_pass, np.asarray(rows.base_version), len(rows), config)


def _with_overload_rule(one_pass: _Pass, base_version: np.ndarray, n: int,
                        config: PlanConfig) -> RowPlan:
    """A pass over all `n` rows, then the overload rule of `config`."""
    everything = np.arange(n)
    first = one_pass(everything)
    if config.overload != "stalest":
        return first
    return _stalest_rows(first, base_version, everything, one_pass)


def _reference_pass(now: float, rows: Rows, running: Sequence[RunningTransfer],
                    network: Capacities, v_init: int, config: PlanConfig) -> _Pass:
    """`_plan_stf` on fresh link tables: the pure-Python reference."""
    ready = ready_at(now, running)
    pending = [PendingUpdate(k, s, d, z, int(v), 1.0, now) for k, (s, d, z, v) in
               enumerate(zip(rows.source, rows.destination, np.asarray(rows.size).tolist(),
                             np.asarray(rows.base_version).tolist(), strict=True))]

    def one_pass(sub: np.ndarray) -> RowPlan:
        chosen = [pending[k] for k in sub.tolist()]
        net = _LinkTable(network, now)
        net.load_running(running)
        paths = [net.path(u.source, u.destination) for u in chosen]
        return RowPlan.of(*_plan_stf(ready, chosen, paths, v_init, config))

    return one_pass


def _kernel_pass(kernel: Callable[..., tuple[int, int, float]], now: float, rows: Rows,
                 running: Sequence[RunningTransfer], network: Capacities, v_init: int,
                 config: PlanConfig) -> _Pass:
    """`_plan_stf` in mlfabric.scheduling._stf.schedule_stf: the same decisions."""
    links = _KernelLinks(network, now, running, rows)
    link_capacity = np.array(links.capacity, np.float64)
    cap = np.minimum(link_capacity[links.up], link_capacity[links.down])
    has_pair = links.pair >= 0
    cap[has_pair] = np.minimum(cap[has_pair], link_capacity[links.pair[has_pair]])
    indexed = IndexedRows(np.asarray(rows.size, np.float64), np.asarray(rows.base_version),
                          links.up, links.down, links.pair, cap)
    segments = LinkSegments.of(now, link_capacity, {
        k: (link.times, link.residual, link.free) for k, link in enumerate(links.reserved)})
    return _indexed_pass(kernel, indexed, segments, ready_at(now, running), v_init, config)


# --- the same plan on rows whose links are numbered already ----------------------------


@dataclass(frozen=True, slots=True)
class IndexedRows:
    """Rows whose links are numbered already (`plan_indexed`): row k sends
    size[k] bytes over links up[k] and down[k], and pair[k] (-1: none), the
    least of their capacities being cap[k]. A caller that keeps its rows and
    its numbering of the links between plans (the controller's
    `policies.Mlfabric.plan_columns`) hands them over as they are."""

    size: np.ndarray  # float64
    base_version: np.ndarray  # int64
    up: np.ndarray  # intp
    down: np.ndarray  # intp
    pair: np.ndarray  # intp
    cap: np.ndarray  # float64

    def __len__(self) -> int:
        return len(self.size)


@dataclass(frozen=True, slots=True)
class LinkSegments:
    """Every link's step function at the start of a plan: link L has
    segments seg_lo[L]:seg_lo[L+1] of (seg_t, seg_r, seg_f), the times, the
    residual capacity and the free-from capacity (see `_Link`)."""

    seg_lo: np.ndarray
    seg_t: np.ndarray
    seg_r: np.ndarray
    seg_f: np.ndarray

    @classmethod
    def of(cls, now: float, capacity: np.ndarray,
           reserved: Mapping[int, tuple[Sequence[float], Sequence[float], Sequence[float]]]
           ) -> LinkSegments:
        """Links 0..len(capacity)-1, flat at their capacity from `now` on,
        but for those in `reserved`: link index -> (times, residual, free)."""
        counts = np.ones(len(capacity), np.intp)
        for index, (times, _, _) in reserved.items():
            counts[index] = len(times)
        seg_lo = np.zeros(len(capacity) + 1, np.intp)
        np.cumsum(counts, out=seg_lo[1:])
        capacity = np.asarray(capacity, np.float64)
        if not reserved:
            return cls(seg_lo, np.full(len(capacity), now), capacity.copy(), capacity.copy())
        # One repeat: at 10,000 hosts three of them were a tenth of a re-plan.
        seg_t = np.full(int(seg_lo[-1]), now)
        seg_r = np.repeat(capacity, counts)
        seg_f = seg_r.copy()
        for index, (times, residual, free) in reserved.items():
            lo, hi = seg_lo[index], seg_lo[index + 1]
            seg_t[lo:hi], seg_r[lo:hi], seg_f[lo:hi] = times, residual, free
        return cls(seg_lo, seg_t, seg_r, seg_f)

    @classmethod
    def of_running(cls, now: float, capacity: np.ndarray, ids: np.ndarray, up: np.ndarray,
                   down: np.ndarray, end: np.ndarray, rate: np.ndarray) -> LinkSegments:
        """`of` the links that running transfers hold, on links numbered by
        the caller and without pair links: transfer k (ids[k]) holds uplink
        up[k] and downlink down[k] at rate[k] until end[k]; capacity[L] is
        link L's (finite and > 0: the caller has checked). The same arrays,
        float for float, as `of` on `reserved_links` renumbered. Needs the
        compiled core (`_stf.running_segments`).

        Built per transfer as objects, lists and dictionaries, and then per
        link, this was a quarter of a decision at 10,000 simulated workers
        with a hundred running (line profile); with numpy, a few dozen calls
        on small arrays cost more than that at 1,000."""
        if _running_segments is None:  # pragma: no cover - an installed package has it
            raise ConfigError("LinkSegments.of_running needs the compiled scheduling core "
                              "(mlfabric.scheduling._stf); reinstall mlfabric to build it")
        return cls(*_running_segments(
            now, np.asarray(capacity, np.float64), np.asarray(ids, np.int64),
            np.asarray(up, np.intp), np.asarray(down, np.intp),
            np.asarray(end, np.float64), np.asarray(rate, np.float64)))


def reserved_links(now: float, running: Sequence[RunningTransfer], network: Capacities
                   ) -> dict[tuple[str, Hashable], tuple[list[float], list[float], list[float]]]:
    """The links the running transfers hold, as the plans start from them:
    ("up", host), ("down", host) or ("pair", (source, destination)) ->
    (times, residual, free). Every other link is flat at its capacity."""
    table = _LinkTable(network, now)
    table.load_running(running)
    out: dict[tuple[str, Hashable], tuple[list[float], list[float], list[float]]] = {}
    for kind, links in (("up", table.up), ("down", table.down), ("pair", table.pair)):
        for key, link in links.items():
            if len(link.times) > 1:
                out[(kind, key)] = (link.times, link.residual, link.free)
    return out


def has_kernel() -> bool:
    """True when the compiled core is built (`plan_indexed` needs it)."""
    return _stf_kernel is not None


def plan_indexed(rows: IndexedRows, links: LinkSegments, *, ready: float, v_init: int,
                 config: PlanConfig, now: float = -INF) -> RowPlan:
    """`plan_rows` on rows and links numbered by the caller: the same
    kernel and overload rule, without building link tables per plan.
    `ready` is `ready_at(now, running)`, `v_init` the server's version plus
    the updates in flight to it. Needs the compiled core.

    With `config.plan_ahead` > 0 the plan stops once that many positions
    are filled and nothing left can start by `now`: its sends are the full
    plan's first positions, every send due by `now` among them, and
    `unplanned_from` says when the rows left out could start at the
    earliest. A deadline that would pass further on is not looked at, nor
    counted by the overload rule, until the plan reaches it."""
    if config.policy != "mlfabric":
        raise ConfigError(f"plan_indexed plans the mlfabric policy, got policy {config.policy!r}")
    if _stf_kernel is None:  # pragma: no cover - an installed package always has it
        raise ConfigError("plan_indexed needs the compiled scheduling core "
                          "(mlfabric.scheduling._stf); reinstall mlfabric to build it")
    if not len(rows):
        return RowPlan([], [], [], [], [], [], [], [], [], [])
    one_pass = _indexed_pass(_stf_kernel, rows, links, ready, v_init, config, now)
    return _with_overload_rule(one_pass, np.asarray(rows.base_version), len(rows), config)


def _indexed_pass(kernel: Callable[..., tuple[int, int, float]], rows: IndexedRows,
                  links: LinkSegments, ready: float, v_init: int, config: PlanConfig,
                  horizon: float = -INF) -> _Pass:
    segments = (links.seg_lo, links.seg_t, links.seg_r, links.seg_f)
    tau = config.tau_max
    dl = np.asarray(rows.base_version, np.intp) + ((tau if tau is not None else 0) - v_init)
    size = rows.size
    idle_factor = -1.0 if config.idle_factor is None else float(config.idle_factor)
    whole = len(size)

    def one_pass(sub: np.ndarray) -> RowPlan:
        n = len(sub)
        start, rate, end, idle, displaced = (np.empty(n, np.float64) for _ in range(5))
        position, send_order, drop_order = (np.empty(n, np.intp) for _ in range(3))
        reason = np.empty(n, np.int8)
        every = n == whole  # every row, in order: no copies
        columns = tuple(np.ascontiguousarray(c if every else c[sub]) for c in
                        (size, rows.up, rows.down, rows.pair, rows.cap, dl))
        n_sends, n_drops, unplanned_from = kernel(
            ready, *columns, tau is not None, idle_factor, *segments,
            start, rate, end, position, send_order, drop_order, reason, idle, displaced,
            # (Without a horizon, as plan and plan_rows call it: every row.)
            config.plan_ahead if horizon > -INF else 0, horizon,
        )
        sent, dropped = send_order[:n_sends], drop_order[:n_drops]
        # The sends stay arrays (thousands of them, and a plan reads only
        # those due now); the drops are few.
        return RowPlan(
            sub[sent], start[sent], rate[sent], end[sent], position[sent],
            sub[dropped].tolist(), [_KERNEL_REASONS[r] for r in reason[dropped].tolist()],
            position[dropped].tolist(), idle[dropped].tolist(), displaced[dropped].tolist(),
            unplanned_from)

    return one_pass


def _stalest_rows(first: RowPlan, base_version: np.ndarray, everything: np.ndarray,
                  one_pass: _Pass) -> RowPlan:
    """The overload rule "stalest" (see PlanConfig).

    When the plan drops m updates because their deadline passed while the
    server applied others, the queue holds more than the link can deliver in
    time: m updates go whichever rule is used. Positions are filled 0, 1, ...
    either way, so the sum of the applied updates' delays is the sum of
    positions minus the sum of their base versions: dropping the m stalest
    instead minimises it (of equal base versions the higher row goes, the one
    the tie order would place last). The rest is planned again; that plan is
    kept only if it drops no more updates in all than the first one."""
    late = sum(1 for why, p in zip(first.reason, first.drop_position, strict=True)
               if why == DEADLINE_MISSED and p > 0)
    if not late:
        return first
    hopeless = [k for k, why, p in zip(first.drop_row, first.reason, first.drop_position,
                                       strict=True) if why == DEADLINE_MISSED and p == 0]
    alive = np.ones(len(everything), bool)
    alive[hopeless] = False
    alive_rows = everything[alive]
    stalest = alive_rows[np.lexsort((-alive_rows, base_version[alive_rows]))[:late]]
    alive[stalest] = False
    second = one_pass(everything[alive])
    if len(hopeless) + late + len(second.drop_row) > len(first.drop_row):
        return first
    m = len(hopeless) + late
    return RowPlan(
        second.send_row, second.start, second.rate, second.end, second.position,
        [*hopeless, *stalest.tolist(), *second.drop_row],
        [DEADLINE_MISSED] * len(hopeless) + [STALEST_IN_OVERLOAD] * late + second.reason,
        [0] * m + second.drop_position, [0.0] * m + second.idle, [0.0] * m + second.displaced,
        second.unplanned_from)


# --- policy "fifo": the asynchronous parameter server ---------------------------------


def _plan_fifo(
    now: float, pending: Sequence[PendingUpdate], paths: Sequence[tuple[_Link, ...]]
) -> tuple[list[SendAt], list[DropAt]]:
    """Everything sends now at its max-min fair share of what running transfers
    leave; the server applies in arrival order of the bytes, i.e. by end."""
    rates = _max_min_fair(paths)
    ends = [now + u.size / r if r > 0 else INF for u, r in zip(pending, rates, strict=True)]
    order = sorted(range(len(pending)), key=lambda k: (ends[k], pending[k].arrival, k))
    sends = [
        SendAt(pending[k].id, now, rates[k], position, ends[k]) for position, k in enumerate(order)
    ]
    return sends, []


def _max_min_fair(paths: Sequence[tuple[_Link, ...]]) -> list[float]:
    """Progressive filling: raise all rates together; freeze the flows of a link
    when it saturates. Capacity is each link's residual at now."""
    flows_on: dict[int, list[int]] = {}
    links: dict[int, _Link] = {}
    for k, path in enumerate(paths):
        for link in path:
            links[link.index] = link
            flows_on.setdefault(link.index, []).append(k)
    left = {key: link.residual[0] for key, link in links.items()}
    count = {key: len(flows) for key, flows in flows_on.items()}
    rate = [0.0] * len(paths)
    frozen = [False] * len(paths)
    heap = [(left[key] / count[key], key) for key in links]
    heapq.heapify(heap)
    while heap:
        share, key = heapq.heappop(heap)
        if count[key] == 0 or share != left[key] / count[key]:
            if count[key]:
                heapq.heappush(heap, (left[key] / count[key], key))
            continue
        share = max(share, 0.0)
        for k in flows_on[key]:
            if frozen[k]:
                continue
            frozen[k] = True
            rate[k] = share
            for link in paths[k]:
                other = link.index
                left[other] -= share
                count[other] -= 1
                if other != key and count[other]:
                    heapq.heappush(heap, (left[other] / count[other], other))
    return rate
