"""The controller's closed loop, without I/O: what the job's own transfers
say about the links, and the release order the real link can honour.

Rates (issue 34, "closed loop"). A transfer let go at a time when the
controller believed its path carried `believed` bytes/s was planned to take
`planned_seconds`: the plan gave it the share planned_rate / believed of the
path (all of it when alone, less when sharing with transfers planned beside
it). If it took `seconds`, the path delivered believed * planned_seconds /
seconds to the job: the same share of a link that far faster or slower. That
estimate is the link's rate for the next plan at once, up or down:

* down, as a cap on the link (`Network.observed_up` / `observed_down`) taken
  with the minimum of what the configuration and the agents say: the job's
  own bytes are what it gets, whatever a probe reports;
* up by the same rule: a transfer planned at the capped rate that runs
  faster measures the faster link, and once an estimate reaches the rate the
  configuration and agents give, the cap goes and they govern again.

Only a transfer that had its uplink and the server's downlink to itself
measures them (the controller's `_release`); which of the two held it back,
the other workers' transfers into the same server tell (`Delivered`): when
the plan had the downlink for the bottleneck, the downlink gives the most of
its last few, and a transfer well below that was held back by its uplink;
when it had the worker's uplink, the transfer measures that uplink and
lifts a capped downlink at most. The downlink's correction holds for every worker's
next transfer, not only this one's. A transfer still running past its
planned end bounds the rate from above (it is slower than planned by at
least elapsed / planned): `overdue` caps its believed bottleneck (a
worker's uplink, or the server's downlink, which a tie gives) with that
bound, only downward, until its report says which.

Order (issue 34, "what the controller releases together, it planned
together"). The server applies updates in the order their last bytes land,
and refuses one staler than tau_max. A running transfer with no slack (it
must be the next to land, or it is refused) must not be overtaken. A
transfer let go beside it names it, with every other running transfer at
risk, for the server to wait for (`RunningOrder.must_follow`): the server
applies it only once they have landed. It is not held back at the
controller: plans do not hold exactly on the real link, so no release rule
can make passing impossible, and once the server kept the order, holding
only idled the link (benchmarks/RESULTS.md, "The release guard no longer
holds"). A transfer let go beside a critical one that could
crowd it out is also paced (`room_beside`, `pace`, `RunningOrder.paced_for`)
until the critical one is planned to have landed: left to TCP, a newcomer
from a fast uplink takes more of a shared downlink than the plan gave it,
and a flow limited by a slow uplink upstream, with the longer round trip,
keeps less. On the emulated cluster such newcomers cut a critical
transfer's rate to 0.45 and 0.47 of its planned rate for the rest of it,
and 7 times in 30 runs one landed first and had it refused as stale.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import replace

import numpy as np

from .plan import Network

# A critical transfer's planned time is trusted to within this fraction (see
# the module's docstring) ...
ORDER_GUARD = 0.1
# ... and its end to within this many seconds whatever its length (the
# directives and reports between controller and workers each take a message).
ORDER_GUARD_MIN = 0.005
# The most transfers one go names for its server to wait for (a protocol
# bound: `wire.protocol.MAX_AFTER`), and for how many times the longest of
# theirs, at most: on a link halved without the controller told, transfers
# took up to 4.3 times their plan (1,000 simulated workers), and a bound
# that lapses first lets the held push pass after all.
MAX_FOLLOW = 64
FOLLOW_PATIENCE = 4.0


def bottleneck(net: Network, src: str, dst: str) -> tuple[str, str]:
    """The link of src -> dst the plan's rate was limited by: ("up", src) or
    ("down", dst) (a tie: the downlink, which every transfer to dst shares)."""
    return ("up", src) if net.up_rate(src) < net.down_rate(dst) else ("down", dst)


def estimate(believed: float, planned_seconds: float, seconds: float) -> float:
    """The rate (bytes/s) the path delivered: `believed` scaled by how much
    faster or slower than planned the transfer ran."""
    return believed * planned_seconds / seconds


def _rate(net: Network, link: tuple[str, str]) -> float:
    kind, host = link
    return net.up_rate(host) if kind == "up" else net.down_rate(host)


def _capped(net: Network, link: tuple[str, str], rate: float | None) -> Network:
    kind, host = link
    table = dict(net.observed_up if kind == "up" else net.observed_down)
    if rate is None:
        table.pop(host, None)
    else:
        table[host] = rate
    return replace(net, observed_up=table) if kind == "up" else replace(net, observed_down=table)


def overdue(net: Network, src: str, dst: str, *, believed: float, planned_seconds: float,
            elapsed: float) -> Network:
    """`net` after a transfer src -> dst planned as in `Delivered.completed` has run
    `elapsed` seconds, past its planned time: its bottleneck link delivers at
    most the estimate so far; a correction only ever goes down here."""
    if not (elapsed > planned_seconds > 0 and believed > 0):
        return net
    link = bottleneck(net, src, dst)
    rate = estimate(believed, planned_seconds, elapsed)
    return net if rate >= _rate(net, link) else _capped(net, link, rate)


def corrections(before: Network, after: Network
                ) -> list[tuple[str, str, float | None, float | None]]:
    """What the closed loop changed from `before` to `after`: (link "up" or
    "down", host, its cap before, after), bytes/s, None where uncapped."""
    out: list[tuple[str, str, float | None, float | None]] = []
    for kind, old, new in (("up", before.observed_up, after.observed_up),
                           ("down", before.observed_down, after.observed_down)):
        if old is new:
            continue
        for host in sorted(old.keys() | new.keys()):
            a, b = old.get(host), new.get(host)
            if a != b:
                out.append((kind, host, a, b))
    return out


# A paced transfer may send this much above its reserved rate: the socket
# paces what goes on the wire, TCP and IP headers included (4.4% at MSS
# 1448), so its data keeps to the plan's time rather than running past it.
PACE_HEADROOM = 1.05


def room_beside(fastest: float, reserved: float, downlink: float) -> float | None:
    """The bytes/s a transfer let go beside critical ones may take of its
    server's downlink without crowding them out: what the downlink, believed
    to carry `downlink`, leaves beside the `reserved` bytes/s of their
    planned rates; None if its path, at most `fastest`, cannot take more
    than that anyway.
    Only a transfer that could is paced. A server many transfers wide
    leaves each newcomer a small part of its link, and pacing there only
    holds back what the others would have used: at 1,000 simulated workers
    (a link about twelve transfers wide), pacing every transfer let go
    beside a critical one (41% of them) at its reserved rate had the server
    refuse 1.3 a run as stale instead of 0.4, and a push take 0.625 s
    instead of 0.610 (seeds 0-9)."""
    room = downlink - reserved
    return room if fastest > room else None


def pace(nbytes: float, planned_seconds: float, room: float = 0.0) -> float | None:
    """The pacing rate (bytes/s on the wire) for a transfer of `nbytes`
    planned to take `planned_seconds`, beside critical ones that leave it
    `room` (`room_beside`): the more of its reserved rate and that room,
    so that it takes no more than they leave it, and no less than the plan
    gave it (None: nothing to pace by)."""
    if not (nbytes > 0 and planned_seconds > 0 and math.isfinite(planned_seconds)):
        return None
    return PACE_HEADROOM * max(nbytes / planned_seconds, room)


def order_guard(planned_seconds: float) -> float:
    """How much later than a critical transfer's planned end another may end."""
    return max(ORDER_GUARD * planned_seconds, ORDER_GUARD_MIN)


def order_matters(stale: np.ndarray, joining: Sequence[int], tau_max: int) -> bool:
    """Whether, among transfers running into one server with staleness
    `stale` (their `RunningOrder` rows') and those a decision may let go
    beside them with staleness `joining`, any could be critical or at risk
    (`RunningOrder.must_follow`) before the decision ends. If not, every
    one has as many versions to spare as there are transfers, itself
    included, and the order has nothing to guard."""
    most = max(int(stale.max(initial=0)), max(joining, default=0))
    return tau_max - most < len(stale) + len(joining)


class RunningOrder:
    """The transfers running into one server in the order they are planned
    to land, which of them are critical (each would be refused as stale
    unless it lands next: `ControlState.critical` defines it), and so how
    long a transfer let go beside them is paced (`paced_for`) and which of
    them it must not pass at the server (`must_follow`).

    A row is (planned end, id, planned seconds, staleness now: the server's
    version less its base version, direct: not through an aggregator). A
    transfer is critical when it is direct and its staleness plus the
    transfers ahead of it (by planned end, then id) reaches `tau_max`; one
    past its planned end and its guard at `now` counts every other transfer
    as ahead. One decision lets several transfers go to a server, and each
    may make others critical: `add` puts it in its place and updates only
    the transfers it passes, instead of sorting them all again (at 10,000
    simulated workers that sort, once per transfer let go, was 70% of the
    controller's time). Within a decision nothing ends, so a transfer once
    critical stays so, and what `paced_for` needs of them (whether one is
    past its end, the latest end plus guard) only grows."""

    def __init__(self, rows: Iterable[tuple[float, int, float, int, bool]], *,
                 now: float | None, tau_max: int) -> None:
        self.now, self.tau_max = now, tau_max
        ordered = sorted(rows)
        self._keys = [(end, tid) for end, tid, _, _, _ in ordered]
        self._end: dict[int, float] = {}
        self._planned: dict[int, float] = {}
        # Direct transfers not past their end and not critical yet: how many
        # more may come ahead of each before it is (critical at <= 0).
        self._slack: dict[int, int] = {}
        # Direct transfers past their end, not critical yet, by how many may
        # run beside them (tau_max less staleness) from the least.
        self._room: list[tuple[int, int]] = []
        self._critical: set[int] = set()
        self._marked: list[int] = []  # the critical ones in the order marked
        # Direct transfers by tau_max less their staleness, from the least
        # (`must_follow`).
        self._margin: list[tuple[int, int]] = []
        # Those of them at risk (margin below `_risk_below`, the transfers
        # running when `must_follow` last looked), by (planned end, id), with
        # how long a newcomer may wait for each: kept as transfers join, as
        # `_keys` is. Gathered and sorted again for each transfer let go, they
        # were about a quarter of a decision that let 88 go at 10,000
        # simulated workers (profiled), and such decisions set its p99. Their
        # ids and the longest wait up to each follow them (None: to be read
        # again).
        self._risky: list[tuple[float, int, float]] = []
        self._risk_below: int | None = None
        self._risky_read: tuple[list[int], list[float]] | None = None
        self._blocked = False  # a critical transfer is past its planned end
        self._latest = -math.inf  # the latest critical end plus its guard
        for ahead, row in enumerate(ordered):
            self._enter(row, ahead)
        self._room_check()

    @classmethod
    def of_columns(cls, end: np.ndarray, ids: np.ndarray, planned: np.ndarray,
                   stale: np.ndarray, direct: np.ndarray, *, now: float | None,
                   tau_max: int) -> RunningOrder:
        """The order of the rows given as columns (planned end, id, planned
        seconds, staleness, direct; ids unique), the same as built from them
        as rows: one sort and a few passes over arrays instead of a Python
        step per row. At 10,000 simulated workers, built at every decision
        that let something go from the hundred-odd transfers running, row
        by row it was a tenth of the controller's time."""
        order = cls((), now=now, tau_max=tau_max)
        n = len(ids)
        if not n:
            return order
        by = np.lexsort((ids, end))
        end, ids, planned = end[by], ids[by], planned[by]
        stale, direct = stale[by], np.asarray(direct[by], bool)
        end_l, ids_l = end.tolist(), ids.tolist()
        order._keys = list(zip(end_l, ids_l, strict=True))
        order._end = dict(zip(ids_l, end_l, strict=True))
        order._planned = dict(zip(ids_l, planned.tolist(), strict=True))
        margin = tau_max - stale
        if now is None:
            past = np.zeros(n, bool)
        else:  # `_past`, row by row
            past = now >= end + np.maximum(ORDER_GUARD * planned, ORDER_GUARD_MIN)
        order._margin = sorted(zip(margin[direct].tolist(), ids[direct].tolist(), strict=True))
        late = direct & past
        order._room = sorted(zip(margin[late].tolist(), ids[late].tolist(), strict=True))
        slack = margin - np.arange(n)  # less the transfers planned ahead
        running = direct & ~past
        critical = running & (slack <= 0)
        for tid in ids[critical].tolist():  # in planned order, as `_enter` marks them
            order._mark(tid)
        running &= ~critical
        order._slack = dict(zip(ids[running].tolist(), slack[running].tolist(), strict=True))
        order._room_check()
        return order

    def _past(self, end: float, planned: float) -> bool:
        return self.now is not None and self.now >= end + order_guard(planned)

    def _enter(self, row: tuple[float, int, float, int, bool], ahead: int) -> None:
        end, tid, planned, stale, direct = row
        self._end[tid], self._planned[tid] = end, planned
        if not direct:
            return  # never critical; it only counts for the others
        bisect.insort(self._margin, (self.tau_max - stale, tid))
        if self._risk_below is not None and self.tau_max - stale < self._risk_below:
            bisect.insort(self._risky, (end, tid, self._wait(end, planned)))
            self._risky_read = None
        if self._past(end, planned):
            bisect.insort(self._room, (self.tau_max - stale, tid))
        elif self.tau_max - stale - ahead <= 0:
            self._mark(tid)
        else:
            self._slack[tid] = self.tau_max - stale - ahead

    def _mark(self, tid: int) -> None:
        self._critical.add(tid)
        self._marked.append(tid)
        end, planned = self._end[tid], self._planned[tid]
        self._blocked = self._blocked or (self.now is not None and end <= self.now)
        self._latest = max(self._latest, end + order_guard(planned))

    def _room_check(self) -> None:
        """Past their end, transfers count all others: critical once there
        are more than their room."""
        others = len(self._keys) - 1
        taken = 0
        for room, tid in self._room:
            if room > others:
                break
            self._mark(tid)
            taken += 1
        del self._room[:taken]

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, end: float, tid: int, planned: float, stale: int, direct: bool) -> None:
        """A transfer let go: in its place by (planned end, id). Each transfer
        after it has one more ahead; one past its end counts every other."""
        at = bisect.bisect(self._keys, (end, tid))
        self._keys.insert(at, (end, tid))
        for _, later in self._keys[at + 1:]:
            slack = self._slack.get(later)
            if slack is None:
                continue
            if slack <= 1:
                del self._slack[later]
                self._mark(later)
            else:
                self._slack[later] = slack - 1
        self._enter((end, tid, planned, stale, direct), at)
        self._room_check()

    @property
    def has_critical(self) -> bool:
        return bool(self._critical)

    @property
    def critical_ids(self) -> frozenset[int]:
        """The ids of the critical transfers."""
        return frozenset(self._critical)

    def critical_since(self, seen: int) -> list[int]:
        """The ids of the critical transfers but the first `seen` found so,
        in the order found (none is ever unmarked: see the class)."""
        return self._marked[seen:]

    def critical(self) -> list[tuple[float, float]]:
        """(planned end, planned seconds) of the critical transfers, by end."""
        return [(end, self._planned[tid]) for end, tid in
                sorted((self._end[tid], tid) for tid in self._critical)]

    def paced_for(self) -> float | None:
        """How long a transfer let go now beside the critical transfers is
        paced: until the last of them is planned to have landed, plus its
        guard; None (until its own end) while one is past its planned end.
        Needs `now`."""
        assert self.now is not None, "paced_for needs the order's now"
        if self._blocked or self._latest <= self.now:
            return None
        return self._latest - self.now

    def must_follow(self, end: float, tid: int, room: int | None = None
                    ) -> tuple[tuple[int, ...], float] | None:
        """What a transfer let go now, planned to land at `end`, must not pass
        at the server: (ids, seconds), to be applied only once the transfers
        `ids` of this order have landed, waiting at most `seconds` for them;
        None if passing any of them costs nothing.

        `room`: how many versions the newcomer itself may still be passed by
        (tau_max less its staleness). With room for every running transfer
        it can wait for all of them and still be applied, so it also names
        those at risk planned to land after it: a plan that puts a newcomer
        before a running transfer with no version to spare (the controller
        lets one go beside a critical one, paced) would otherwise have it
        refused (seen on the emulated cluster: 2 in 9 runs of 240 updates).

        A direct transfer planned to land before it is at risk when it would
        be refused as stale if every other transfer running into the server,
        and this one, landed first: its staleness plus their number passes
        tau_max. (A critical one is.) Named by each newcomer while that
        holds, none is refused for being passed: a transfer not at risk
        when a newcomer goes has at least as many versions left as there
        are transfers that could pass it, and each that does takes one
        version and leaves the running set. No release rule can make
        passing impossible, since plans do not hold exactly on the real
        link (TCP shares it unfairly, a link slows unannounced); a server
        that waits for the ones at risk makes it harmless. Named, not
        counted in versions: the controller learns of applied versions a
        report late, and an update that had already passed one at risk
        would be counted as that one. The wait is bounded by
        FOLLOW_PATIENCE times the longest of their transfers (its whole
        planned time, or its time so far once past it): one later than
        that has stalled or failed, and holding more for it helps no one.
        At most MAX_FOLLOW are named, the first planned."""
        running = len(self._keys)
        risky = self._at_risk(running)
        if not risky:
            return None
        every = room is not None and room >= running
        ahead = MAX_FOLLOW if every else min(bisect.bisect_left(risky, (end, tid)), MAX_FOLLOW)
        if not ahead:
            return None
        if self._risky_read is None:
            self._risky_read = ([r for _, r, _ in risky],
                                list(itertools.accumulate((w for _, _, w in risky), max)))
        ids, longest = self._risky_read
        return (tuple(ids[:ahead]),
                FOLLOW_PATIENCE * max(longest[min(ahead, len(ids)) - 1], ORDER_GUARD_MIN))

    def _at_risk(self, running: int) -> list[tuple[float, int, float]]:
        """(planned end, id, wait: `_wait`) of the direct transfers at risk
        with `running` transfers running (tau_max less their staleness below
        it), sorted. Transfers only join an order, so `running` only grows."""
        below = self._risk_below
        if below is None or below < running:
            lo = 0 if below is None else bisect.bisect_left(self._margin, (below, -math.inf))
            hi = bisect.bisect_left(self._margin, (running, -math.inf))
            if hi > lo:
                self._risky.extend((self._end[r], r, self._wait(self._end[r], self._planned[r]))
                                   for _, r in self._margin[lo:hi])
                self._risky.sort()
                self._risky_read = None
            self._risk_below = running
        return self._risky

    def _wait(self, end: float, planned: float) -> float:
        """How long a transfer planned to end at `end` after `planned`
        seconds has taken, or will (before FOLLOW_PATIENCE)."""
        return planned if self.now is None else max(planned, self.now - (end - planned))


def _corrected(net: Network, link: tuple[str, str], rate: float) -> Network:
    """`net` with `link` at `rate`, or at what the configuration and agents
    give once `rate` reaches it."""
    given = _rate(_capped(net, link, None), link)
    return _capped(net, link, None if rate >= given else rate)


# A downlink gave at least the fastest of the last this many transfers into
# it that had it to themselves (a max filter, as BBR keeps its bottleneck
# bandwidth): a slow transfer among them was held back elsewhere.
DOWNLINK_WINDOW = 3


class Delivered:
    """Which link a transfer alone on its links was held back by.

    A transfer alone on its uplink and its server's downlink ran at the
    slower of the two. Which one, its own time cannot say: a worker's slow
    uplink the configuration does not know looked like a drop of the
    server's downlink, and the next worker's transfer, fast, was planned
    at the slow one's rate. The other workers' transfers into the same
    server tell: the downlink gave at least the fastest of the last
    DOWNLINK_WINDOW of them. When the plan's bottleneck is the downlink,
    that is its rate, and a transfer well below it (by more than
    ORDER_GUARD) was held back by its uplink, which gets its rate. When the
    plan's bottleneck is the worker's uplink, the transfer's rate is its
    uplink's when slower than planned, and the window only lifts a
    downlink capped below it. A transfer faster than its uplink's cap shows
    the uplink gives at least that."""

    def __init__(self) -> None:
        self._into: dict[str, deque[float]] = {}

    def completed(self, net: Network, src: str, dst: str, *, believed: float,
                  planned_seconds: float, seconds: float) -> Network:
        if not (seconds > 0 and planned_seconds > 0 and believed > 0
                and math.isfinite(seconds) and math.isfinite(believed)):
            return net
        rate = estimate(believed, planned_seconds, seconds)
        seen = self._into.setdefault(dst, deque(maxlen=DOWNLINK_WINDOW))
        seen.append(rate)
        down = max(seen)
        if bottleneck(net, src, dst) == ("down", dst):
            net = _corrected(net, ("down", dst), down)
            if rate < (1 - ORDER_GUARD) * down:
                return _corrected(net, ("up", src), rate)
        else:
            # Planned at its uplink's rate, below the downlink's: it shows
            # what its uplink gives, and of the downlink only that it gives
            # at least the fastest of the last few. (Taken for the
            # downlink's rate, they capped a downlink several uplinks wide at
            # one uplink's rate: at 1,000 simulated workers over 4 shards the
            # transfers then went one at a time into each shard, and a push
            # took 11 s against FIFO's 0.6.)
            if rate < _rate(net, ("up", src)):
                net = _corrected(net, ("up", src), rate)
            if net.observed_down.get(dst, math.inf) < down:
                net = _corrected(net, ("down", dst), down)
        if src in net.observed_up and net.observed_up[src] < rate:
            return _corrected(net, ("up", src), rate)  # it gives at least this now
        return net


# The most slowed transfers a shared downlink's cap waits for (a bound on
# what is kept per server; a round of a link wider than this is rare).
MAX_DOWNLINK_WINDOW = 256

# A transfer into a shared downlink slower than planned by more than this
# fraction of its speed is evidence of a slower downlink; less is what one
# booked to its rate gives (about 12% in the simulator: TCP's ramp, and the
# queue of a link booked to its rate).
SHARED_SLOWED = 0.25


class SharedDownlink:
    """A server's downlink from the transfers that shared it.

    `Delivered` learns only from a transfer alone on its links. Into a
    server many workers' uplinks wide, none is: at 1,000 simulated workers
    the downlink carries about twelve at once, so a halving of it nobody
    announced was never learnt, and transfers let go at the configured rate
    overtook slower ones, which the server then refused as stale (6 of
    4,000, the mean of five seeds; told of the halving at once, 0.8).

    A transfer that had its uplink to itself, let go while the transfers
    into its server were planned to take (`booked`) at least
    (1 - ORDER_GUARD) of the downlink's rate, ran its planned time over the
    time it took: had the downlink held it back, the downlink gave about
    `booked` times that. One transfer cannot tell (its worker's uplink may
    be slower than believed, and TCP does not share a saturated link fairly
    while new flows ramp up: after the halving most ran 15-20% slower than
    planned and a few 85%), so the downlink is capped only when each of the
    last of them, a round of the link at least (as many as the booking the
    last one went into holds at its planned rate, `lanes`, and
    DOWNLINK_WINDOW at least, from that many workers), was slower by more
    than SHARED_SLOWED, and at the most any of them shows (as `Delivered`
    keeps the fastest). A round, because on a saturated link the transfers
    that join it ramp up behind its queue: at 10,000 simulated workers,
    about 125 at once on a halved link, three in a row were often all
    such, and the cap fell to 0.16 of what the link still gave; a round
    holds one that had its share. Then the plans book the cap, and what the
    link could give beyond it shows only in the transfers' speed: one let
    go booked to the cap that ran on time, or faster, raises the cap by
    ORDER_GUARD, until it reaches what the configuration and the agents
    give and goes. (Faster counts: into a link a few uplinks wide, the
    plans book the cap with one transfer at its uplink's rate and one at
    what is left, and on a restored link the second runs faster than
    planned; counted only on time, a shard's cap stayed at half its
    restored link for ten simulated seconds.) On time is within its
    `order_guard`, the release order's own tolerance: ORDER_GUARD of its
    planned time, and ORDER_GUARD_MIN at least. A short transfer's time
    holds the answer's way back and TCP's ramp, which its plan does not:
    parts of 4 ms took 1.3 times their plan on a link with room, and
    judged by ORDER_GUARD alone, a shard's cap learnt at 0.64 of its link
    stayed there for 3.8 simulated seconds while 300-600 parts waited
    (1,000 workers over 4 shards). A downlink still slow is then booked
    past its rate by about ORDER_GUARD at times, which the release order
    tolerates."""

    def __init__(self) -> None:
        self._slowed: dict[str, deque[tuple[str, float]]] = {}

    def completed(self, net: Network, src: str, dst: str, *, booked: float,
                  planned_seconds: float, seconds: float,
                  capped: float | None = None, lanes: int = 1) -> Network:
        """`net` after a transfer src -> dst, let go with `booked` bytes/s of
        `dst`'s downlink planned while the cap on it was `capped` (None:
        none), `lanes` transfers at its planned rate, its own counted, took
        `seconds` for its `planned_seconds`."""
        if not (seconds > 0 and planned_seconds > 0 and booked > 0
                and math.isfinite(seconds) and math.isfinite(booked)):
            return net
        link = ("down", dst)
        believed = _rate(net, link)
        if booked < (1 - ORDER_GUARD) * believed:
            return net  # the downlink had room: a slow transfer was held back elsewhere
        seen = self._slowed.setdefault(dst, deque(maxlen=MAX_DOWNLINK_WINDOW))
        speed = planned_seconds / seconds
        if speed < 1 - SHARED_SLOWED:
            seen.append((src, booked * speed))
            window = min(max(DOWNLINK_WINDOW, lanes), MAX_DOWNLINK_WINDOW)
            last = list(itertools.islice(reversed(seen), window))
            if len(last) == window and len({s for s, _ in last}) >= DOWNLINK_WINDOW:
                gives = max(rate for _, rate in last)
                if gives < (1 - ORDER_GUARD) * believed:
                    seen.clear()  # the next cap needs evidence of its own
                    return _capped(net, link, gives)
            return net
        seen.clear()
        cap = net.observed_down.get(dst)
        # (Let go before the cap, it was planned beside more than the cap
        # allows now, and says nothing of the capped link. Let go under it,
        # booked past it and on time all the same, it does: transfers past
        # their planned ends, which the plan no longer counts, still held
        # the link beside it. Ignored, those kept a cap that had halved at
        # 1,000 simulated workers at 2 uplinks of 107 for 30 simulated
        # seconds: every transfer was let go beside late ones.)
        if cap is None or seconds > planned_seconds + order_guard(planned_seconds) or (
                booked > (1 + ORDER_GUARD) * cap and capped != cap):
            return net
        return _corrected(net, link, cap * (1 + ORDER_GUARD))
