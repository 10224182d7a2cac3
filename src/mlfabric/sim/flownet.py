"""Flows sharing links max-min fairly: the network half of `mlfabric.sim.engine`, without I/O.

A `FlowNet` holds links (a capacity in bytes/s each, changed at will) and
flows (bytes left, and the links they cross). Whenever the set of flows or
a capacity changes, every flow's rate is recomputed by progressive filling
(water-filling): all rates rise together; when a link saturates, the flows
crossing it freeze at its fair share; the others keep rising. That is the
max-min fair allocation, what long-lived TCP flows converge to on a shared
bottleneck. Between two changes rates are constant, so the next completion
is exact: `advance(t)` moves every flow on by rate x elapsed time.

Optionally (`SlowStart`) a new flow does not take its share at once: its
rate is capped at one initial window per round trip, doubling every round
trip, until the network rather than the cap limits it (TCP slow start,
which Linux also restarts after an idle connection). A round trip is
`base_rtt`, plus `queue_delay` while a link on the flow's path is saturated
(loss-based TCP keeps a saturated bottleneck's queue nearly full), or less
where the flows on that link have fewer bytes left than such a queue holds. This is
what makes a flow that joins busy links slower to get its share than the
flows already there.

A flow may also have a rate limit of its own (`start(..., max_rate=)`): a
paced socket, which sends no faster whatever room the links have.

Time is only what callers pass in; nothing here reads a clock. The filling
runs in a compiled port (`mlfabric.sim._fill`) of `max_min_rates_reference`,
bit-identical to it: the numpy reference recounts every flow on every link
in each round, and with 64 shard servers, each its own bottleneck, that was
most of a simulated run (89 of 124 s, profiled, at 200 workers over 64
shards).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError

_fill_kernel: Callable[..., np.ndarray] | None
try:
    from ._fill import max_min_rates as _fill_kernel
except ImportError:  # not built (a source checkout without build_ext): the reference
    _fill_kernel = None

INF = math.inf
# A flow is complete when fewer than this many bytes are left (float slack).
_DONE_BYTES = 1e-6
# Links whose fair share is within this relative distance of the smallest
# saturate in the same round of the filling.
_TIE = 1e-12


@dataclass(frozen=True, slots=True)
class Flow:
    """A finished flow: who it was, and when it started and ended."""

    id: int
    size: float
    started: float
    ended: float


@dataclass(frozen=True, slots=True)
class SlowStart:
    """TCP's ramp: `initial_window` bytes per round trip, doubling each round trip."""

    initial_window: float = 10 * 1448.0  # Linux's IW10 at MSS 1448
    base_rtt: float = 2e-4  # seconds, links idle
    queue_delay: float = 0.05  # seconds added while the path has a saturated link

    def __post_init__(self) -> None:
        if not (self.initial_window > 0 and math.isfinite(self.initial_window)):
            raise ConfigError(f"initial_window must be > 0 bytes, got {self.initial_window}")
        if not (self.base_rtt > 0 and math.isfinite(self.base_rtt)):
            raise ConfigError(f"base_rtt must be > 0 seconds, got {self.base_rtt}")
        if not (self.queue_delay >= 0 and math.isfinite(self.queue_delay)):
            raise ConfigError(f"queue_delay must be >= 0 seconds, got {self.queue_delay}")


class FlowNet:
    """Links with capacities and the flows crossing them, max-min fair.

    Flow ids are handed out by `start` (0, 1, ...); a flow crosses 1 to
    `hops` links. With `audit=True` every allocation is checked against the
    capacities (`max_utilization` holds the highest load/capacity seen).
    Live flows are rows 0..n-1 of the arrays (a finished flow's row takes the
    last one), so every step is a slice, not a search.
    """

    def __init__(self, capacities: list[float], *, now: float = 0.0, audit: bool = False,
                 slow_start: SlowStart | None = None, hops: int = 3) -> None:
        self.now = now
        # Link len(capacities) is a dummy of infinite capacity: the filler
        # for flows crossing fewer than `hops` links.
        self.capacity = np.array([*capacities, INF], np.float64)
        for k, c in enumerate(capacities):
            _check_capacity(k, c)
        if hops < 1:
            raise ConfigError(f"hops must be >= 1, got {hops}")
        self.hops = hops
        self.audit = audit
        self.slow_start = slow_start
        self.max_utilization = 0.0
        size = 64
        self._links = np.full((size, hops), len(capacities), np.intp)
        self._left = np.zeros(size)
        self._rate = np.zeros(size)
        self._size = np.zeros(size)
        self._started = np.zeros(size)
        self._cap = np.full(size, INF)  # slow start's rate cap (inf: not ramping)
        self._pace = np.full(size, INF)  # the flow's own limit (inf: none)
        self._next_double = np.full(size, INF)  # when the cap doubles
        self._ids: list[int] = []  # flow id of each live row
        self._row: dict[int, int] = {}  # flow id -> row
        self._next_id = 0
        self._dirty = False

    @property
    def dummy(self) -> int:
        return len(self.capacity) - 1

    def __len__(self) -> int:
        return len(self._ids)

    # -- changes ------------------------------------------------------------------------

    def start(self, links: tuple[int, ...], size: float, max_rate: float = INF) -> int:
        """A new flow of `size` bytes over `links`, from `now`, at most
        `max_rate` bytes/s; its id."""
        if not 1 <= len(links) <= self.hops:
            raise ConfigError(f"a flow crosses 1 to {self.hops} links, got {links!r}")
        if not (size > 0 and math.isfinite(size)):
            raise ConfigError(f"flow size must be a finite number of bytes > 0, got {size}")
        _check_max_rate(max_rate)
        for k in links:
            if not 0 <= k < self.dummy:
                raise ConfigError(f"no link {k}: links are 0..{self.dummy - 1}")
        ramp = self.slow_start
        rtt = self._rtt(links) if ramp is not None else INF
        row = len(self._ids)
        if row == len(self._left):
            self._grow()
        self._links[row] = self.dummy
        self._links[row, : len(links)] = links
        self._left[row] = size
        self._size[row] = size
        self._started[row] = self.now
        self._rate[row] = 0.0
        self._cap[row] = ramp.initial_window / rtt if ramp is not None else INF
        self._pace[row] = max_rate
        self._next_double[row] = self.now + rtt
        fid = self._next_id
        self._next_id += 1
        self._ids.append(fid)
        self._row[fid] = row
        self._dirty = True
        return fid

    def set_capacity(self, link: int, capacity: float) -> None:
        if not 0 <= link < self.dummy:
            raise ConfigError(f"no link {link}: links are 0..{self.dummy - 1}")
        _check_capacity(link, capacity)
        self.capacity[link] = capacity
        self._dirty = True

    def set_max_rate(self, flow: int, max_rate: float = INF) -> None:
        """A live flow's own limit from `now` on (inf: none); a flow that
        has ended is left alone (a pacing that outlived its transfer)."""
        _check_max_rate(max_rate)
        row = self._row.get(flow)
        if row is not None:
            self._pace[row] = max_rate
            self._dirty = True

    def _grow(self) -> None:
        n = len(self._left)
        self._links = np.concatenate([self._links, np.full_like(self._links, self.dummy)])
        for name in ("_left", "_rate", "_size", "_started"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(n)]))
        for name in ("_cap", "_pace", "_next_double"):
            setattr(self, name, np.concatenate([getattr(self, name), np.full(n, INF)]))

    def _remove(self, row: int) -> None:
        """Drop a finished flow: the last live row moves into its place."""
        last = len(self._ids) - 1
        del self._row[self._ids[row]]
        if row != last:
            for arr in (self._links, self._left, self._rate, self._size, self._started,
                        self._cap, self._pace, self._next_double):
                arr[row] = arr[last]
            moved = self._ids[last]
            self._ids[row] = moved
            self._row[moved] = row
        self._ids.pop()

    def _rtt(self, links: tuple[int, ...] | np.ndarray) -> float:
        """The round trip of a flow over `links` now: base, plus the queue of a
        saturated link (from the current allocation). A queue holds only
        bytes its flows have still to deliver: at most `queue_delay`, and at
        most what the flows crossing the link have left, at its capacity.
        (A transfer joining a link whose last flow has 10 KB to go waits for
        those, not for 50 ms of a bulk flow's queue.)"""
        assert self.slow_start is not None
        load = self.loads()
        cap = self.capacity
        n = len(self._ids)
        queue = 0.0
        for k in links:
            if k == self.dummy or load[k] < cap[k] * (1 - 1e-9):
                continue
            left = float(self._left[:n][self._on(k)].sum())
            held = left / cap[k] if cap[k] > 0 else INF
            queue = max(queue, min(self.slow_start.queue_delay, held))
        return self.slow_start.base_rtt + queue

    # -- time -----------------------------------------------------------------------------

    def rate(self, flow: int) -> float:
        """The flow's current rate in bytes/s."""
        self._allocate()
        return float(self._rate[self._row[flow]])

    def left(self, flow: int) -> float:
        return float(self._left[self._row[flow]])

    def next_completion(self) -> float:
        """When the next flow ends or a ramping flow's cap doubles, if nothing else
        changes (inf: never). Callers advance to it."""
        self._allocate()
        n = len(self._ids)
        if not n:
            return INF
        rate = self._rate[:n]
        with np.errstate(divide="ignore"):
            end = self.now + float(np.min(self._left[:n] / rate))
        if self.slow_start is not None:
            end = min(end, float(self._next_double[:n].min()))
        return end

    def advance(self, t: float) -> list[Flow]:
        """Move on to time `t` (>= now): the flows that ended by then, by id.

        `t` must not pass `next_completion()` (the caller steps from event to
        event); flows ending exactly at `t` are returned."""
        if t < self.now:
            raise ValueError(f"time goes forward: now {self.now}, asked for {t}")
        self._allocate()
        n = len(self._ids)
        if not n:
            self.now = t
            return []
        left, rate = self._left[:n], self._rate[:n]
        if t > self.now:
            left -= rate * (t - self.now)
        self.now = t
        # Done: within float slack of 0 bytes, or of 1 ns at its rate (a step
        # smaller than the clock's resolution would never move it on).
        slack = np.maximum(np.maximum(_DONE_BYTES, 1e-12 * self._size[:n]), 1e-9 * rate)
        done_rows = np.flatnonzero(left <= slack)
        ended = [Flow(self._ids[row], float(self._size[row]), float(self._started[row]), t)
                 for row in done_rows.tolist()]
        for row in done_rows[::-1].tolist():  # from the back: moved rows are never done ones
            self._remove(row)
        if ended:
            self._dirty = True
        if self.slow_start is not None:
            self._ramp(t)
        return sorted(ended, key=lambda f: f.id)

    def _ramp(self, t: float) -> None:
        """Double the caps due at `t`; a flow the network, not its cap, limits has
        finished slow start."""
        n = len(self._ids)
        due = np.flatnonzero(self._next_double[:n] <= t + 1e-12)
        if not len(due):
            return
        self._allocate()
        for row in due.tolist():
            if self._rate[row] < self._cap[row] * (1 - 1e-9):
                self._cap[row] = self._next_double[row] = INF
            else:
                self._cap[row] *= 2
                self._next_double[row] = t + self._rtt(self._links[row])
        self._dirty = True

    # -- max-min fairness -------------------------------------------------------------

    def _allocate(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        n = len(self._ids)
        if not n:
            return
        self._rate[:n] = max_min_rates(self._links[:n], self.capacity,
                                       np.minimum(self._cap[:n], self._pace[:n]))
        if self.audit:
            load = self.loads()
            cap = self.capacity[:-1]
            with np.errstate(divide="ignore", invalid="ignore"):
                util = np.where(cap > 0, load / cap, np.where(load > 0, INF, 0.0))
            self.max_utilization = max(self.max_utilization, float(util.max(initial=0.0)))

    def _on(self, link: int) -> np.ndarray:
        """Which live rows cross `link`."""
        return np.any(self._links[:len(self._ids)] == link, axis=1)

    def flows_on(self, link: int) -> int:
        """How many live flows cross `link`."""
        return int(np.count_nonzero(self._on(link)))

    def loads(self) -> np.ndarray:
        """Bytes/s currently crossing each link (what the audit checks)."""
        self._allocate()
        n = len(self._ids)
        return np.bincount(self._links[:n].ravel(), weights=np.repeat(self._rate[:n], self.hops),
                           minlength=len(self.capacity))[:-1]


def max_min_rates(links: np.ndarray, capacity: np.ndarray,
                  cap: np.ndarray | None = None) -> np.ndarray:
    """The max-min fair rate of each flow (`max_min_rates_reference`), in the
    compiled kernel when it is built."""
    if _fill_kernel is None:
        return max_min_rates_reference(links, capacity, cap)
    return _fill_kernel(np.ascontiguousarray(links, np.intp),
                        np.ascontiguousarray(capacity, np.float64),
                        None if cap is None else np.ascontiguousarray(cap, np.float64))


def max_min_rates_reference(links: np.ndarray, capacity: np.ndarray,
                            cap: np.ndarray | None = None) -> np.ndarray:
    """Progressive filling: the max-min fair rate of each flow.

    `links[f]` are the links flow f crosses (rows of equal length; pad with a
    link of infinite capacity), `capacity[l]` their capacities, `cap[f]` an
    optional limit of flow f's own. Each round finds the smallest fair share
    of any link (capacity left / flows not yet frozen on it). Flows whose own
    limit is at most that share freeze at their limit (the level would reach
    it first); otherwise the flows of the links at that share freeze at it.
    Either way their rates are taken off every link they cross."""
    n, hops = links.shape
    # Work on the links in use only (a big switch has thousands of idle ones).
    flat = links.ravel()
    used = np.flatnonzero(np.bincount(flat, minlength=len(capacity)))
    remap = np.empty(len(capacity), np.intp)
    remap[used] = np.arange(len(used))
    links = remap[flat].reshape(n, hops)
    nlinks = len(used)
    rate = np.zeros(n, np.float64)
    left = capacity[used].astype(np.float64, copy=True)
    active = np.ones(n, bool)
    while active.any():
        idx = np.flatnonzero(active)
        count = np.bincount(links[idx].ravel(), minlength=nlinks)
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(count > 0, np.maximum(left, 0.0) / count, INF)
        level = float(share.min())
        if cap is not None:
            limited = idx[cap[idx] <= level]
            if len(limited):
                rate[limited] = cap[limited]
                left -= np.bincount(links[limited].ravel(), weights=np.repeat(
                    cap[limited], hops), minlength=nlinks)
                active[limited] = False
                continue
        if level == INF:  # only the dummy link left: unbounded (cannot happen with real links)
            raise ConfigError("a flow crosses no link of finite capacity")
        tight = share <= level * (1 + _TIE) if level > 0 else share <= 0.0
        frozen = idx[tight[links[idx]].any(axis=1)]
        rate[frozen] = level
        left -= level * np.bincount(links[frozen].ravel(), minlength=nlinks)
        active[frozen] = False
    return rate


def _check_capacity(link: int, c: float) -> None:
    if not (c >= 0 and math.isfinite(c)):
        raise ConfigError(f"capacity of link {link} is {c}; need a finite number of bytes/s >= 0")


def _check_max_rate(max_rate: float) -> None:
    if not max_rate > 0:
        raise ConfigError(f"a flow's max_rate must be > 0 bytes/s, got {max_rate}")
