"""Available-bandwidth estimation: pure code, no I/O, an injectable clock.

The model (the design brief's "big switch"): a transfer a -> b crosses a's
uplink and b's downlink. Its available bandwidth is what the tighter of the
two edge links leaves, never more than the path's bottleneck capacity ``C``::

    A(a -> b) = min(C(a -> b), U(a) - load_up(a), D(b) - load_down(b))

with U(a) and D(b) the two links' capacities, each at least C (issue 32: the
old ``C - max(load_up(a), load_down(b))`` took one link's load off another
link's capacity, and a path bottlenecked at a's 80 Mbit/s uplink read 0 while
other tenants used half of b's idle 300 Mbit/s downlink). Neither is
measured directly; each is a lower bound from what was seen:

* U(a) is the largest capacity of a's paths (`snapshot`'s `up_capacity`: the
  agent knows all of them). Trains cannot tell more: a TCP flow leaving the
  same host is held back by TCP small queues while a train sits in the
  qdisc, so a train sees an idle uplink whatever its load.
* D(b) is at least what it carries (the peer reports the most it carried
  over 0.3 s in the last second, the job's own traffic included, with each
  train), so C is at least the smaller of U(a) and that: trains that share
  b's downlink with a flow of the job that fills it read a share of it,
  not C.
* D(b) is C, or more where a long train proves it: a train lasting 10 ms
  at C that comes through clean (within the filter's threshold of C) while
  b's downlink carries load L went through beside L, so D(b) >= sample + L.
  A downlink without room for it slows it to a share, below the
  threshold. Short trains prove nothing: paced cross traffic arrives in
  bursts about a millisecond apart, and a train of a fraction of that
  slips between them (on the emulated cluster, 19 of 20 trains of 23
  packets read 100 Mbit/s through a 100 Mbit/s downlink carrying 50 of
  another tenant's). The proof stays while most of the last `EVIDENCE`
  trains come through clean.

Each part is measured where it can be measured exactly:

* **Capacity, actively** (`PathEstimator.plan`, `analyze_train`, `CapacityFilter`): a
  train of equal-sized UDP datagrams is sent back to back. Its first packets
  pass through the bottleneck's token bucket (tbf burst, NIC coalescing)
  untouched; the rest queue and leave spaced by the bottleneck rate. The
  receiver's kernel timestamps show both phases; the spacing after the burst is
  the capacity sample. Cross traffic that slips into the queue can only widen
  the spacing, so samples scatter *below* ``C``: the filter keeps an upper
  order statistic of the recent samples and only follows a drop when
  consecutive, well-founded samples fall below what the measured load can
  explain. A step is confirmed by a second train sent at once, so the estimate
  follows a rate change within about one probe interval.
* **Load, from the hosts' own NIC counters** (`LoadMeter`): every agent knows
  the bytes its host sent and received; less its own probe bytes, that is the
  load on its uplink and downlink. The receiver of a train reports its
  downlink load with the train's arrivals.

Why not dispersion of a paced train against cross traffic (the textbook
``A = C - R_in * (C / R_out - 1)``)? Measured on the emulated cluster it fails
both ways: a TCP flow leaving the *same* host is held back by TCP small queues
while the train sits in the qdisc, so the train sees an idle link; and a paced
TCP flow arriving from another host comes in 1 ms bursts, so 2 ms trains see
anything from 0.5 C to C. The NIC counters see both exactly.

Budget: a train is sized for the current capacity estimate (the token-bucket
burst plus ``measure_s`` of queueing, a few milliseconds of the link) and the
interval between trains is set so that, in steady state, the wire bytes of all
trains through one uplink (``share`` = number of peers) stay at ``target`` of
``budget`` times the capacity; quick trains (start-up, confirmations,
retries) wait for a token bucket filled at ``hard_cap`` of the budget, so
even a storm of retries keeps the overhead below the budget.

Passive samples: a local client reports a finished transfer (bytes,
seconds). Its rate is a lower bound of what that path delivers to mlfabric
traffic; while fresh it raises the estimate (the job's own transfers load
the counters, yet are available to the job).

Rates are bit/s of datagram payload, i.e. the shaped rate less IP/UDP/Ethernet
header overhead, which is what an application sending full-size packets gets.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from ..wire.agent_protocol import WIRE_OVERHEAD

Clock = Callable[[], float]

DEFAULT_PACKET_SIZE = 1472  # UDP payload of a full 1500-byte IP packet
# The last capacity samples of which most must be clean for room proven on
# the peer's downlink beyond C to stay proven (PathEstimator.down_capacity).
EVIDENCE = 5
# Retries of a rise's train that met another agent's at the peer, free of
# the budget like the rise's other trains (PathEstimator.interval): each at
# most 20 ms of the link, after a random backoff of 1-16 times its length.
RISE_RETRIES = 4
# Long trains proving a downlink's room under a new load
# (PathEstimator._room_unproven): at most PROOF_BURST in any PROOF_WINDOW
# seconds, 10 ms of the link each and free of the budget, so at most 0.1% of
# it; a tenant's flow ramping up asks for two or three in a row.
PROOF_BURST = 3
PROOF_WINDOW = 30.0


class RobustFilter:
    """Median of the last `window` accepted samples, with step-change detection.

    A sample more than `threshold` (relative) away from the current value is
    held back; `confirm` consecutive held-back samples on the same side replace
    the window (a step). So one outlier never moves the value, a step is
    followed after `confirm` samples.
    """

    def __init__(self, window: int = 5, threshold: float = 0.15, confirm: int = 2) -> None:
        if window < 1 or confirm < 1 or threshold <= 0:
            raise ValueError("window and confirm must be >= 1 and threshold > 0")
        self.window = window
        self.threshold = threshold
        self.confirm = confirm
        self._accepted: deque[float] = deque(maxlen=window)
        self._pending: list[float] = []
        self._pending_side = 0
        self.value: float | None = None
        self.count = 0  # samples seen, accepted or not
        self.last_sample: float | None = None  # clock time of the last sample

    @property
    def pending(self) -> int:
        """Disagreeing samples held back, waiting for confirmation."""
        return len(self._pending)

    def reset(self) -> None:
        self._accepted.clear()
        self._pending.clear()
        self.value = None

    def _summary(self) -> float:
        return statistics.median(self._accepted)

    def _disagrees(self, x: float, v: float, slack: float) -> int | None:
        """+1 (above), -1 (below), 0 (agrees) or None (uninformative: ignore)."""
        if x > v * (1 + self.threshold):
            return 1
        if x < v * (1 - self.threshold):
            return -1
        return 0

    def touch(self, now: float) -> None:
        """A sample arrived that carries no value (it still shows the path is alive)."""
        self.count += 1
        self.last_sample = now

    def add(self, x: float, now: float, slack: float = 0.0) -> float:
        if not math.isfinite(x) or x < 0:
            raise ValueError(f"sample must be finite and >= 0, got {x!r}")
        self.count += 1
        self.last_sample = now
        v = self.value
        side = 0 if v is None else self._disagrees(x, v, slack)
        if v is None:
            self._accepted.append(x)
        elif side is None:
            return v
        elif side:
            if self._pending and self._pending_side != side:
                self._pending.clear()
            self._pending_side = side
            self._pending.append(x)
            if len(self._pending) >= self.confirm:
                self._accepted.clear()
                self._accepted.extend(self._pending)
                self._pending.clear()
        else:
            self._pending.clear()
            self._accepted.append(x)
        self.value = self._summary()
        return self.value


class CapacityFilter(RobustFilter):
    """Like `RobustFilter`, for samples that scatter below the true value.

    The value is the second largest of the window (the largest while the window
    has fewer than three samples), so a single high outlier does not lift it.
    A sample under ``(1 - threshold) * value`` is "below" only if it is also
    under ``(1 - threshold) * (value - slack)``, where `slack` is the load
    currently measured on the path: cross traffic can explain samples down to
    about ``value - load``, and such samples say nothing about the capacity
    (they are counted for the age of the estimate, but not kept); a capacity
    drop cannot hide behind the load.
    """

    def _summary(self) -> float:
        s = sorted(self._accepted, reverse=True)
        return s[1] if len(s) >= 3 else s[0]

    def _disagrees(self, x: float, v: float, slack: float) -> int | None:
        if x > v * (1 + self.threshold):
            return 1
        if x >= v * (1 - self.threshold):
            return 0
        if x < (1 - self.threshold) * max(v - slack, 0.0):
            return -1
        return None


@dataclass(frozen=True)
class TrainPlan:
    """One probe train: `count` datagrams of `size` payload bytes, back to back.
    The first `skip` are expected to go through a token bucket (see
    `TrainMeasurement.tail_bps`)."""

    train: int
    count: int
    size: int = DEFAULT_PACKET_SIZE
    skip: int = 0

    @property
    def wire_bytes(self) -> int:
        return self.count * (self.size + WIRE_OVERHEAD)


@dataclass(frozen=True)
class TrainMeasurement:
    received: int
    lost: int
    capacity_bps: float | None  # dispersion after the burst; None if it never queued
    send_bps: float | None  # how fast the sender got the train out
    queued: int  # packets that arrived spaced by the bottleneck
    spacing_bps: float | None = None  # rate of the typical queued gap, even if too few queued
    # sequence number where the measured queued run begins: the packets before
    # it went through the bottleneck's token bucket (or another link's queue)
    run_start: int = 0
    head_bps: float | None = None  # how fast the packets before the run arrived
    # How fast the train arrived after its first `plan.skip` packets, gaps
    # and all: what it got of the bottleneck beside other traffic (the
    # capacity sample leaves other traffic's packets out).
    tail_bps: float | None = None

    @property
    def sender_limited(self) -> bool:
        """No queue formed: the train left the bottleneck as fast as it was sent."""
        return self.capacity_bps is None


def analyze_train(
    plan: TrainPlan,
    sent_ns: Sequence[int],
    arrivals: Sequence[tuple[int, int]] | Mapping[int, int],
    min_queued: int = 4,
) -> TrainMeasurement:
    """Turn one train's send times and (seq, receive ns) arrivals into a capacity sample.

    The gaps between consecutive arrivals (per packet, so losses are bridged)
    are short while the token bucket lets packets through (the sender's pace)
    and settle at ``size / C`` once they queue. A gap counts as queued only if
    it is clearly longer than the same packets' send gap (so a slow or
    descheduled sender is never mistaken for the bottleneck); the median of
    the queued gaps (above half their upper quartile) is the typical spacing,
    and the longest run of consecutive queued gaps within [0.6, 1.5] of it is
    the clean queued phase: a pause of the sender (the queue drained) or cross
    traffic slipping in ends a run instead of diluting the sample. A receiver
    that was held up gets the next packets bunched (a long gap, then short
    ones); once they are back on schedule they stay in the run: at 50 Mbit/s a
    train queues only 6-8 packets, and such a hold-up (recorded in about one
    train in 50 on a busy host) would otherwise leave it unmeasured.
    `spacing_bps` is the rate of the typical queued gap, also when too few
    packets queued for a capacity sample.
    """
    items = arrivals.items() if isinstance(arrivals, Mapping) else arrivals
    got = sorted((s, t) for s, t in items if 0 <= s < plan.count)
    bits = plan.size * 8
    send_bps = None
    if len(sent_ns) >= 2 and sent_ns[-1] > sent_ns[0]:
        send_bps = (len(sent_ns) - 1) * bits * 1e9 / (sent_ns[-1] - sent_ns[0])
    capacity = None
    spacing = None
    queued = run = 0
    head = None
    have_send = len(sent_ns) == plan.count
    steps = []  # (packets, receive ns, send ns) between consecutive arrivals
    firsts = []  # the sequence number each step starts from
    for (s0, t0), (s1, t1) in itertools.pairwise(got):
        if s1 > s0:
            steps.append((s1 - s0, t1 - t0, sent_ns[s1] - sent_ns[s0] if have_send else 0))
            firsts.append(s0)
    if len(steps) >= 2:
        # a gap shows the bottleneck's spacing only if the packet waited in its queue:
        # it arrived further behind its predecessor than it was sent
        waited = [dr >= 1.25 * ds for _, dr, ds in steps]
        gaps = [dr / k for k, dr, _ in steps]
        cand = [g for g, w in zip(gaps, waited, strict=True) if w]
        m = 0.0
        if cand:
            q75 = sorted(cand)[(3 * len(cand)) // 4]
            m = statistics.median([g for g in cand if g >= 0.5 * q75])
        best = (0, 0)  # (packets, ns) of the longest clean run
        best_start = run_start = 0
        run_k = run_t = 0
        late_k = late_t = 0  # a late arrival and the bunched ones after it, not yet in a run
        prev_g = 0.0  # the gap of the run's last step
        for (k, dr, _), g, w, first in zip(steps, gaps, waited, firsts, strict=True):
            if late_k:
                if g < 0.85 * m:
                    late_k += k
                    late_t += dr
                    if late_t <= 1.1 * m * late_k:
                        # caught up: the receiver was held up and got these bunched,
                        # but they left the queue on schedule
                        run_k, run_t, late_k, late_t = run_k + late_k, run_t + late_t, 0, 0
                        prev_g = m
                        if run_k > best[0]:
                            best, best_start = (run_k, run_t), run_start
                    continue
                # a long gap and then regular ones: cross traffic slipped in
                run_k = run_t = late_k = late_t = 0
            if run_k and w and 0.6 * m <= g <= 1.5 * m:
                run_k += k
                run_t += dr
            elif m > 0 and g > 1.5 * m:
                late_k, late_t = k, dr  # a pause; whether it ends the run, the next gaps tell
                continue
            elif run_k and g < 0.6 * m and prev_g > 1.15 * m and (
                    0.75 * m <= (prev_g + dr) / (1 + k) <= 1.25 * m):
                run_k += k  # one packet a little late, the next early: on schedule
                run_t += dr
            elif w and m > 0 and 0.9 * m <= g <= 1.5 * m:
                # a run does not start with a short gap: it may be shortened by the
                # tokens left in the bucket when the queue began
                run_k, run_t, run_start = k, dr, first
            else:
                run_k = run_t = 0
            prev_g = g
            if run_k > best[0]:
                best, best_start = (run_k, run_t), run_start
        queued = best[0]
        if queued >= min_queued and best[1] > 0:
            capacity = queued * bits * 1e9 / best[1]
            run = best_start
            at = dict(got)
            if run in at and run - got[0][0] >= 2 and at[run] > got[0][1]:
                head = (run - got[0][0]) * bits * 1e9 / (at[run] - got[0][1])
        if m > 0:
            spacing = bits * 1e9 / m
    tail = None
    after = [(s, t) for s, t in got if s >= plan.skip]
    if len(after) >= 2 and after[-1][1] > after[0][1]:
        tail = (after[-1][0] - after[0][0]) * bits * 1e9 / (after[-1][1] - after[0][1])
    return TrainMeasurement(len(got), plan.count - len(got), capacity, send_bps, queued,
                            spacing, run, head, tail)


class LoadMeter:
    """Load on a host's uplink and downlink from its NIC byte counters, less probes
    and the job's own traffic; and what the downlink carried, the job's
    traffic included.

    Feed cumulative counters with `update(now, rx, tx, probe_rx, probe_tx,
    job_rx, job_tx, probe_tx_pending)` (all in wire bytes); `rates()` gives (downlink, uplink)
    load in bit/s over the last `window` seconds, or None until two readings
    exist; `peak(now)` the most of either over a `window` in the last `span`
    seconds, the load the estimates take; `carried()` the most the downlink
    carried over a `window` in the last `span` seconds.
    """

    def __init__(self, window: float = 0.5, span: float = 1.0) -> None:
        self.window = window
        self.span = span
        self._readings: deque[tuple[float, int, int, int, int, int, int, int]] = deque()
        # each whole window of the last span: (end, carried, down load, up load) bit/s
        self._windows: deque[tuple[float, float, float, float]] = deque()

    def update(self, now: float, rx: int, tx: int, probe_rx: int, probe_tx: int,
               job_rx: int = 0, job_tx: int = 0, probe_tx_pending: int = 0) -> None:
        """`probe_tx_pending`: of `probe_tx`, the bytes of trains still on
        their way, which the NIC may not have counted yet. A probe is
        counted as it is sent, the NIC's bytes as they leave a shaper's
        queue on this host: a train queued there at a window's start is
        counted by the NIC in that window and by the probes before it, and
        read as load (10.6 Mbit/s on an idle 200 Mbit/s uplink after one
        500 KB train, recorded on the emulated cluster). A window subtracts
        the bytes pending at its start too: what it cannot tell from
        probes, it does not call load."""
        r = self._readings
        if r and (rx < r[-1][1] or tx < r[-1][2]):
            r.clear()  # counters reset (interface re-created)
            self._windows.clear()
        r.append((now, rx, tx, probe_rx, probe_tx, job_rx, job_tx, probe_tx_pending))
        while len(r) > 2 and now - r[1][0] >= self.window:
            r.popleft()
        if len(r) >= 2 and now - r[0][0] >= self.window:
            (t0, rx0, _, prx0, *_), (t1, rx1, _, prx1, *_) = r[0], r[-1]
            down, up = self.rates() or (0.0, 0.0)  # (never None here: two readings)
            w = self._windows
            w.append((now, max(0, (rx1 - rx0) - (prx1 - prx0)) * 8 / (t1 - t0), down, up))
            while w[0][0] < now - self.span:  # (read or not: bounded)
                w.popleft()

    def rates(self) -> tuple[float, float] | None:
        r = self._readings
        if len(r) < 2:
            return None
        (t0, rx0, tx0, prx0, ptx0, jrx0, jtx0, pending0) = r[0]
        (t1, rx1, tx1, prx1, ptx1, jrx1, jtx1, _) = r[-1]
        dt = t1 - t0
        if dt <= 0:
            return None
        down = max(0, (rx1 - rx0) - (prx1 - prx0) - max(0, jrx1 - jrx0)) * 8 / dt
        up = max(0, (tx1 - tx0) - (ptx1 - ptx0) - pending0 - max(0, jtx1 - jtx0)) * 8 / dt
        return down, up

    def peak(self, now: float) -> tuple[float, float] | None:
        """(downlink, uplink) load in bit/s: the most of each over a whole
        `window` ending in the last `span` seconds (the latest window's until
        one has passed). Other tenants' flows dip for a moment, when one
        loses a packet or its sender is descheduled, and are back within a
        few round trips: a transfer planned on the room of such a dip finds
        it gone. Taken at the dip, the load once read a path at 1.8x its
        room, and a downlink's room proved at a dip stayed 16% short (a
        fresh-clone CI failure, issue 32's cross-traffic test). A load that
        ends is let go `span` seconds later."""
        held = [(d, u) for t, _, d, u in self._windows if t >= now - self.span]
        if not held:
            return self.rates()
        return max(d for d, _ in held), max(u for _, u in held)

    def carried(self, now: float) -> float:
        """The most the downlink carried (bit/s, probes excluded, the job's
        traffic included) over a whole `window` ending in the last `span`
        seconds; until one window has passed, over the readings so far, and
        NaN (unknown) before two. A lower bound of the downlink's capacity;
        over a span rather than now, because a train that shares the queue
        with a TCP flow can cost it a loss, and the flow then sends at half
        its rate for a while."""
        held = [rate for t, rate, _, _ in self._windows if t >= now - self.span]
        if held:
            return max(held)
        if self._windows:
            return 0.0  # windows there were, and none lately: nothing carried
        r = self._readings
        if len(r) < 2 or r[-1][0] <= r[0][0]:
            return math.nan
        (t0, rx0, _, prx0, *_), (t1, rx1, _, prx1, *_) = r[0], r[-1]
        return max(0, (rx1 - rx0) - (prx1 - prx0)) * 8 / (t1 - t0)


class BusyMeter:
    """Whether the job itself is transferring on this host: its own TCP bytes
    (in and out, from the socket counters) ran above `threshold` bit/s over
    the last `window` seconds. Feed cumulative byte counts with `update`."""

    def __init__(self, window: float = 1.0, threshold: float = 8e6) -> None:
        self.window = window
        self.threshold = threshold
        self._readings: deque[tuple[float, int]] = deque()

    def update(self, now: float, total_bytes: int) -> bool:
        r = self._readings
        if r and total_bytes < r[-1][1]:
            r.clear()  # counters started over
        r.append((now, total_bytes))
        while len(r) > 2 and now - r[1][0] >= self.window:
            r.popleft()
        return self.busy

    @property
    def busy(self) -> bool:
        r = self._readings
        if len(r) < 2 or r[-1][0] <= r[0][0]:
            return False
        return (r[-1][1] - r[0][1]) * 8 / (r[-1][0] - r[0][0]) > self.threshold


@dataclass(frozen=True)
class PathEstimate:
    bandwidth_bps: float  # available; NaN when unknown
    capacity_bps: float
    rtt_s: float
    age_s: float  # since the last capacity sample; inf when never measured
    stale: bool
    samples: int
    load_bps: float  # max(uplink load here, downlink load at the peer), payload bit/s
    passive_bps: float  # last passive (real transfer) rate, NaN if none


@dataclass(frozen=True)
class ProbeConfig:
    budget: float = 0.02  # max fraction of the path capacity spent on probes
    target: float = 0.6  # fraction of the budget planned for steady state (headroom for
    # confirmation trains, reports and acks)
    hard_cap: float = 0.75  # retries and confirmations never push probes beyond this
    cap_depth: float = 1.0  # seconds of hard_cap the token bucket holds
    min_confident: int = 6  # queued packets a sample needs to signal a capacity drop
    share: int = 1  # paths probed over the same uplink (the number of peers)
    packet_size: int = DEFAULT_PACKET_SIZE
    burst_s: float = 0.0012  # token-bucket burst to push through before queueing starts
    measure_s: float = 0.0015  # queued part of the train, for the capacity sample
    # A reading that is news (the first, or a rise) is believed from a train
    # lasting this long at that reading: one that drains token buckets of up
    # to half as long at the path's rate (issue 32: shapers allow 1 ms to 10 ms).
    verify_s: float = 0.02
    min_packets: int = 8
    max_packets: int = 2000
    min_interval: float = 0.15
    max_interval: float = 0.8
    quick_interval: float = 0.02  # confirmation / escalation probes
    startup_trains: int = 3  # quick trains right after start
    initial_bps: float = 100e6
    max_bps: float = 40e9  # the link's physical limit: the NIC's speed when known
    min_bps: float = 1e6
    stale_after: float = 3.0
    passive_fresh: float = 3.0  # a passive sample counts this long
    delivery_window: float = 3.0  # delivery-rate samples are max-filtered over this
    min_passive_bytes: int = 256 * 1024
    window: int = 5
    threshold: float = 0.12
    confirm: int = 2

    def __post_init__(self) -> None:
        if not 0 < self.budget <= 1:
            raise ValueError(f"probe budget must be in (0, 1], got {self.budget!r}")
        if self.share < 1:
            raise ValueError(f"share must be >= 1, got {self.share!r}")
        if self.stale_after <= 0:
            raise ValueError(f"stale_after must be > 0 seconds, got {self.stale_after!r}")

    @property
    def payload_ratio(self) -> float:
        return self.packet_size / (self.packet_size + WIRE_OVERHEAD)


class PathEstimator:
    """Everything one agent knows about the path to one peer, and when to probe next.

    Pure: every method takes `now` or reads the injected clock.
    """

    def __init__(self, config: ProbeConfig | None = None, clock: Clock = time.monotonic,
                 rng: random.Random | None = None) -> None:
        self.config = c = config or ProbeConfig()
        self.clock = clock
        self.rng = rng or random.Random()  # collision backoff (tests seed it)
        self.capacity = CapacityFilter(c.window, c.threshold, c.confirm)
        self.rtt = RobustFilter(5, 1e9, 1)  # plain median of the last 5
        self.hint_bps = c.initial_bps  # rate the next train is sized for
        self.peer_down_load: float | None = None  # wire bit/s at the peer's downlink
        # wire bit/s the peer's downlink carried lately, the job's traffic included
        self.peer_carried = 0.0
        self._carried_known = True  # (False: the peer's meter had no reading yet)
        self.passive_bps = math.nan
        self._passive_at: float | None = None
        self._deliveries: deque[tuple[float, float]] = deque()  # (time, bit/s)
        self._delivered_at: float | None = None  # the job proved the capacity then
        self._trains = 0
        self._quick = False
        self.lost_streak = 0  # trains in a row that got no (usable) report
        self._unqueued = 0  # trains in a row that formed no queue
        self._tokens = 0.0  # the budget's token bucket (wire bytes), see interval()
        self._tokens_at: float | None = None
        self._free_quick = 0  # quick trains in a row that did not wait for the bucket
        self._free = True  # the next train is not charged to the token bucket
        self._collided = 0  # trains in a row that met another agent's at the peer
        self._unexplained = 0  # vouching trains in a row the peer could not explain
        self._sends: deque[float] = deque(maxlen=8)  # recent send rates of this host
        self._last = ""  # the last train's outcome
        self.outcomes: dict[str, int] = {}
        # Wire bytes a train must exceed to get past the path's token bucket,
        # learnt from trains that all went through it at the sender's pace
        # (0: the default burst_s is enough). Kept: a shaper's bucket does not
        # shrink on its own, and a larger train only costs budget.
        self.burst_bytes = 0
        self.busy = False  # the job transfers on this host now (see budget())
        # the last capacity samples (payload bit/s): whether proven room stays
        self._evidence: deque[float] = deque(maxlen=EVIDENCE)
        self._proven: float | None = None  # the downlink capacity a long train proved
        self._proofs_failed = 0  # long trains in a row slowed: they proved nothing
        # The wire bytes the next train needs to prove the downlink's room
        # (0: no proof asked), and when and under which load it was asked for
        # (see _room_unproven).
        self._prove = 0
        self._proved: deque[tuple[float, float]] = deque(maxlen=PROOF_BURST)  # (time, load)
        # (wire bytes, sample) of the train that measured a first sample or a
        # rise not yet vouched for by a long enough train (see _rise_check).
        self._rise: tuple[int, float] | None = None

    # -- planning ------------------------------------------------------------

    def plan(self, train_id: int, verify: bool = True) -> TrainPlan:
        """The next train, sized to get past the burst and queue for `measure_s`;
        shorter (not less often than `max_interval`) when the budget is tight.
        Long enough to vouch for a held reading (`_rise_check`) unless `verify`
        is false (the steady state's train)."""
        c = self.config
        rate_wire = self.hint_bps / c.payload_ratio / 8  # bytes/s on the wire
        wire = c.packet_size + WIRE_OVERHEAD
        # Past the shaper's token bucket: the default's, or the one learnt
        # from trains that all went through it (`burst_bytes`).
        burst = max(2 * 1514, rate_wire * c.burst_s, self.burst_bytes)
        measure = rate_wire * c.measure_s
        affordable = self.budget_bytes_per_s() * c.max_interval - burst
        measure = max(min(measure, affordable), c.min_packets * wire if self.burst_bytes else 0)
        count = math.ceil((burst + measure) / wire)
        if self._rise is not None and verify:
            # twice the train that read it, up to one that can vouch for it
            held, reading = self._rise
            count = max(count, math.ceil(min(2 * held, self.verify_bytes(reading)) / wire))
        skip = 0
        if self._prove and verify:
            # past the bucket, then long enough to meet several bursts of any
            # paced flow (see _room_unproven)
            skip = math.ceil(burst / wire)
            count = max(count, skip + math.ceil(self._prove / wire))
        count = min(max(count, c.min_packets), c.max_packets)
        return TrainPlan(train_id, count, c.packet_size, min(skip, count // 2))

    def _steady_train_bytes(self) -> int:
        """Wire bytes of the steady state's next train (no held reading)."""
        return self.plan(0, verify=False).wire_bytes

    def budget(self) -> float:
        """The fraction of the path's capacity probes may take now: the
        configured budget, halved while the job itself transfers on this
        host (issue 32: at most 1% then, 2% idle; the job's transfers are
        measured as they go, and probes then take from them)."""
        return self.config.budget * (0.5 if self.busy else 1.0)

    def budget_bytes_per_s(self) -> float:
        """Wire bytes per second this path may spend on probes in steady state."""
        c = self.config
        return self.budget() * c.target * self.hint_bps / c.payload_ratio / 8 / c.share

    def _refill(self, now: float) -> float:
        """The budget's token bucket: refills at `hard_cap` of the budget for the
        current capacity, holds `cap_depth` seconds of it, and at least one
        steady train. Returns the fill rate.

        (With less than a train, every train went into debt and the next
        waited for two trains' tokens: behind a 10 ms bucket at 80 Mbit/s,
        218 KB trains went every 11 s against the planned 7.3, and one retry
        after a collision left the estimate stale.)"""
        c = self.config
        cap = max(self.capacity.value or 0.0, self.hint_bps)
        rate = self.budget() * c.hard_cap * cap / c.payload_ratio / 8 / c.share
        steady = float(self._steady_train_bytes())
        depth = max(rate * c.cap_depth, steady)
        if self._tokens_at is None:
            self._tokens = depth
        else:
            self._tokens = min(depth, self._tokens + rate * max(0.0, now - self._tokens_at))
        # A debt is at most one steady train at the current rate: one run up
        # at a faster path's rate (a collision's retries just before a drop
        # to a quarter) silenced the path for 1.8 s at the slower rate's
        # refill, though every byte of it was within the budget when sent.
        self._tokens = max(self._tokens, -steady)
        self._tokens_at = now
        return rate

    def record_sent(self, nbytes: int, now: float | None = None) -> None:
        """Account a train's wire bytes against the budget (start-up trains and the
        few trains following a change are not charged: their number is bounded)."""
        now = self.clock() if now is None else now
        self._refill(now)
        if not self._free:
            # A debt of at most one steady train: a long train vouching for a
            # reading (up to 20 ms of the link) would otherwise silence the
            # path for several steady intervals, and its estimate went stale.
            # Such trains are rare (the first reading, a rise).
            self._tokens = max(self._tokens - nbytes,
                               -float(self._steady_train_bytes()))

    def interval(self, now: float | None = None) -> float:
        """Delay before the next train: quick while starting up or confirming a change,
        else as long as the budget requires for a train sized for the current
        estimate (at least `min_interval`). Retries (lost trains, a descheduled
        sender) and long runs of quick trains (a flapping path) also wait for the
        budget's token bucket, so that they stay below `hard_cap` of the budget;
        start-up trains and the first few trains following a change do not.
        Call once per train."""
        now = self.clock() if now is None else now
        c = self.config
        nxt = self.plan(0).wire_bytes
        rate = self._refill(now)
        self._free = False
        if self._trains < c.startup_trains:
            self._free = True
            return max(c.quick_interval, self._backoff(nxt))
        if not self._quick:
            self._free_quick = 0
            interval = max(nxt / self.budget_bytes_per_s(), c.min_interval)
        elif (self._last == "rise"
              or (self._last == "collision" and self._rise is not None
                  and self._collided <= RISE_RETRIES)
              or self._last == "unexplained"
              or (self._free_quick < 5 and (
            self._last in ("unqueued", "escalate", "burst", "sample")
            or (self._free_quick > 0 and self._last in ("sender-slow", "lost", "collision"))
        ))):
            # following a change: a few trains in a row go at once; and so
            # does every train of a rise, each twice the last up to one that
            # vouches for it (at most 2 x verify_s of the link in all, once
            # per rise). Charged, the vouching train waited for the old, slower
            # rate's tokens: 9 s for 445 KB after a step from 50 to 200 Mbit/s
            # on a loaded host, where a descheduled sender had left the first
            # trains of the rise unable to show their bucket run dry. A train
            # of a rise that met another agent's at the peer is retried as
            # freely, after the collision's random backoff (`_backoff`), up
            # to RISE_RETRIES times: two agents stepping up into the same
            # downlink collided there, and the retry waited 5 s for tokens.
            self._free_quick += 1
            self._free = True
            return max(c.quick_interval, self._backoff(nxt))
        else:
            interval = max(c.quick_interval, self._backoff(nxt))
        # A train that met another agent's at the peer and read less than the
        # estimate is a collision or the path's drop, which must be learnt
        # within a second (issue 32). Its retry goes after the backoff alone
        # while the bucket can lend one steady train, charged: waiting for
        # the whole train's tokens after the steady one had spent them, the
        # retry went 0.22 s later, met another train again, and waited
        # 0.38 s more (a fresh-clone CI run saw a drop to 50 Mbit/s read 195
        # for more than 1 s). The loan is repaid before the next steady
        # train, so the budget holds over any run.
        loan = (float(self._steady_train_bytes())
                if self._last == "collision" and self._collided <= RISE_RETRIES else 0.0)
        if nxt > self._tokens + loan:
            interval = max(interval, (nxt - self._tokens - loan) / rate)
        return interval

    def _backoff(self, nbytes: int) -> float:
        """After trains in a row that met another agent's at the peer (or
        that the peer could not yet explain, `_slowed_unexplained`): wait
        between 1 and 2, 4, .. 16 times as long as the next train lasts, at
        random, before retrying, as Ethernet does. Agents starting
        together each send quick trains; once a train lasts as long as the
        quick interval (20 ms, as a train vouching for a new reading does,
        see `_rise_check`), retrying at that interval met the other
        agent's retries every time."""
        tries = max(self._collided, self._unexplained)
        if not tries:
            return 0.0
        lasts = nbytes * 8 / (self.hint_bps / self.config.payload_ratio)
        return lasts * self.rng.uniform(1.0, 2.0 ** min(tries, 4))

    # -- samples -------------------------------------------------------------

    def on_train(self, m: TrainMeasurement, now: float | None = None,
                 peer_down_load: float | None = None, overlapped: bool = False,
                 peer_carried: float | None = None) -> str:
        """Fold one train in. Returns how it was taken:

        * "sample": a capacity sample (kept or not by the filter);
        * "rise": the first sample, or one above the estimate, held until a
          train long enough to drain a token bucket measures it (`_rise_check`);
        * "unqueued": no queue formed, once: re-probe to confirm;
        * "escalate": no queue formed twice: the path is faster than the train
          was sized for, the next one is sized for a 4x faster path;
        * "sender-limited": no queue although the train was sized for as fast
          as this host sends: the send rate is the sample;
        * "weak": a short queued run far below the estimate (ignored);
        * "short": no measurable queue, but the few queued packets were spaced at
          the current estimate: the path is no faster (nothing learnt, no re-probe);
        * "sender-slow": the sender could not send fast enough (descheduled);
        * "unexplained": a train vouching for a held reading read less, and
          the peer's meter had no reading yet to explain it: retried;
        * "collision": another agent's train reached the peer at the same time
          (they shared its downlink): retried, unless it still read the
          estimate (then a sample);
        * "lost": (almost) nothing arrived.
        """
        now = self.clock() if now is None else now
        c = self.config
        self._trains += 1
        self._quick = False
        if peer_down_load is not None and math.isfinite(peer_down_load):
            self.peer_down_load = peer_down_load
        if peer_carried is not None:
            # (the peer's word, bounded by the physical limit; NaN: its meter
            # has no reading yet)
            self._carried_known = math.isfinite(peer_carried) and peer_carried >= 0
            self.peer_carried = (min(peer_carried, self.config.max_bps)
                                 if self._carried_known else 0.0)
        if m.send_bps is not None:
            self._sends.append(m.send_bps)
        if m.received < 3:
            self.lost_streak += 1
            return self._outcome("lost", quick=self.lost_streak == 1)
        self.lost_streak = 0
        v = self.capacity.value
        if overlapped and not (m.capacity_bps is not None and v is not None
                               and abs(m.capacity_bps - v) <= c.threshold * v):
            self._collided += 1
            return self._outcome("collision", quick=True)
        # (A train that met another at the peer can only have been slowed: one
        # that still reads the estimate confirms it. Retrying it cost a whole
        # budget interval, and the estimate went stale now and then.)
        self._collided = 0
        if m.sender_limited:
            send = m.send_bps
            if send is None or send < 0.8 * self.hint_bps:
                # the sender was slower than the path we expect (descheduled): no news
                return self._outcome("sender-slow", quick=True)
            v = self.capacity.value
            if (m.queued >= 2 and m.spacing_bps is not None and v is not None
                    and abs(m.spacing_bps - v) <= c.threshold * v):
                # a queue did form, spaced at the known capacity, but a hold-up at
                # the sender or the receiver cut it short: the path is no faster
                # (re-probing at once would spend the budget on a path that has
                # not changed, typically a small train on a busy host)
                self._unqueued = 0
                self.capacity.touch(now)
                return self._outcome("short", quick=False)
            self._unqueued += 1
            fastest = max(self._sends, default=send)
            if ((self._unqueued >= 2 or self.hint_bps >= 0.9 * fastest)
                    and self._bucket(m, send)):
                return self._outcome("burst", quick=True)
            if self.hint_bps < 0.9 * fastest and self.hint_bps < c.max_bps:
                if self._unqueued < 2 and self.capacity.value is not None:
                    return self._outcome("unqueued", quick=True)  # once may be a fluke
                # sized for a slower path: a train for a faster one next (but not
                # beyond what this host has recently managed to send)
                self._unqueued = 0
                self.hint_bps = min(max(self.hint_bps * 4, c.min_bps), fastest, c.max_bps)
                return self._outcome("escalate", quick=True)
            # sized for as fast as this host sends, and still no queue
            self._unqueued = 0
            self.capacity.add(min(send, c.max_bps), now)
            self.hint_bps = max(self.capacity.value or send, c.min_bps)
            return self._outcome("sender-limited")
        self._unqueued = 0
        if self._slowed_unexplained(m):
            self._unexplained += 1
            return self._outcome("unexplained", quick=True)
        self._unexplained = 0
        m = self._beside_the_job(m)
        assert m.capacity_bps is not None
        rise = self._rise_check(m, now)
        if rise is not None:
            return self._outcome(rise, quick=True)
        v = self.capacity.value
        if (m.queued < c.min_confident and v is not None
                and m.capacity_bps < v * (1 - c.threshold)):
            # a short queued run well below the estimate: cross traffic or jitter more
            # likely than a capacity drop; it refreshes the age but moves nothing
            self.capacity.touch(now)
            return self._outcome("weak", quick=False)
        # What the peer's downlink carried with this train (down_capacity).
        load = (self.peer_down_load or 0.0) * c.payload_ratio
        self._evidence.append(m.capacity_bps)
        if self._prove and self._train_bytes(m) >= self._prove:
            # what the train got beside the load, not its clean capacity sample
            got = m.tail_bps or 0.0
            clean = v is not None and got >= (1 - c.threshold) * v
            self._proven = min(got, m.capacity_bps) + load if clean else None
            self._proofs_failed = 0 if clean else self._proofs_failed + 1
        self._prove = 0
        # The job's own flow into the peer slows a train as any traffic does,
        # though it is no load (issue 32: a path into a host the job's bulk
        # flow filled read half its capacity, from trains sharing the queue).
        slack = max(self.load_bps(0.0), self.peer_carried * c.payload_ratio)
        self.capacity.add(m.capacity_bps, now, slack=slack)
        self._weigh_evidence()
        # while a step is being confirmed, size the next train for the larger of the
        # two, so that it queues long enough to be trusted either way
        v = self.capacity.value
        size_for = max(m.capacity_bps, v or 0.0) if self.capacity.pending else v
        self.hint_bps = min(max(size_for or m.capacity_bps, c.min_bps), c.max_bps)
        if self._room_unproven(m.capacity_bps, now):
            # long enough to meet several bursts of any paced flow
            self._prove = self.verify_bytes(self.hint_bps) // 2
            if self._proved and not self._same_load(load, self._proved[-1][1]):
                self._proofs_failed = 0  # a new load: its own two tries
            self._proved.append((now, load))
        return self._outcome("sample", quick=self.capacity.pending > 0 or self._prove > 0)

    def verify_bytes(self, rate_bps: float) -> int:
        """Wire bytes of a train that can vouch for a reading of `rate_bps`:
        `verify_s` at that rate, so that a token bucket of up to half as
        long at the path's true rate runs dry within it (see `_rise_check`)."""
        c = self.config
        return math.ceil(c.verify_s * rate_bps / c.payload_ratio / 8)

    def _train_bytes(self, m: TrainMeasurement) -> int:
        """The wire bytes of the train `m` measured (lost packets included)."""
        return (m.received + m.lost) * (self.config.packet_size + WIRE_OVERHEAD)

    def _vouches(self, train_bytes: float, reading: float) -> bool:
        """Whether a train of `train_bytes` on the wire is long enough to
        vouch for `reading` (`_rise_check`): it lasted `verify_s` at about
        that rate, or is the longest train there is."""
        c = self.config
        return (train_bytes >= self.verify_bytes(reading / (1 + c.threshold))
                or train_bytes >= c.max_packets * (c.packet_size + WIRE_OVERHEAD))

    def _slowed_unexplained(self, m: TrainMeasurement) -> bool:
        """A train vouching for a held reading read less, and the peer could
        not yet say what its downlink carried (its meter had no two
        readings): the job's flow into the peer may have slowed it, which
        `_beside_the_job` would explain a moment later. Retried, at most
        RISE_RETRIES times, rather than taken.

        Recorded in a fresh-clone CI run: h2's vouching train to h1 ran
        0.11 s after h1's agent started, beside a 50 Mbit/s job flow into
        h1; it read 48.6 of 97, h1 reported carried 0 (no reading yet), and
        h2 -> h1 stayed at 48 past the test's 5 s."""
        c = self.config
        held, x = self._rise, m.capacity_bps
        return (not self._carried_known and held is not None and x is not None
                and self._vouches(self._train_bytes(m), held[1])
                and x < held[1] * (1 - c.threshold) and self._unexplained < RISE_RETRIES)

    def _beside_the_job(self, m: TrainMeasurement) -> TrainMeasurement:
        """A longer train of a held reading that read less, while the peer's
        downlink carried the job's own flow: it shared that queue with the
        flow, and read what the flow left, not a token bucket's true rate
        (the short trains had slipped between the paced flow's bursts). The
        link carried both: the train vouches for its reading plus what the
        peer reports carried, at most the held reading.

        Recorded in a fresh-clone CI run: h2 -> h1 read 97 Mbit/s from short
        trains beside a 50 Mbit/s job flow into h1, the vouching train read
        48.6, and the path was taken for 48 (a bucket) until the next train,
        7.5 s later at that rate's budget.

        Only a train long enough to vouch for the held reading does: a
        shorter one that read less is the next rung of the rise, held at
        its own reading. (Recorded on the emulated cluster: a 23-packet
        train with 4 queued read h2's 194 Mbit/s uplink at 252; four longer
        trains read 191-195 beside a tenant's flow out of h2 into h0, each
        was lifted by what h0 carried to 243.8, the lifted reading was held
        and vouched for, and h2's paths read 90 against 42 for 15 s.)"""
        c = self.config
        held, x = self._rise, m.capacity_bps
        carried = self.peer_carried * c.payload_ratio
        if (held is None or x is None or carried <= 0
                or not self._vouches(self._train_bytes(m), held[1])
                or x >= held[1] * (1 - c.threshold)
                or x + carried < held[1] * (1 - c.threshold)):
            return m
        return replace(m, capacity_bps=min(held[1], x + carried))

    def _shared_with_the_job(self, m: TrainMeasurement) -> bool:
        """A train of a rise, too short to vouch for the held reading, read
        less, and the job's own traffic into the peer (what its downlink
        carried less its load, which is other tenants') explains the
        difference: the train shared the peer's queue with the job's flow,
        while the shorter trains had slipped between its bursts. That is no
        token bucket, and the reading is not the path's: the rise goes on.

        Recorded on the emulated cluster with both cores busy: h2's trains
        of 23 and 46 packets read h1's downlink at 97 Mbit/s beside the
        job's 50 Mbit/s flow into it; one of 92 read 47.9 and, its head
        passing at 97 and the rest queueing, was taken for a bucket run dry.
        h1 had reported carrying 52.4 with no load; the next train went
        3.7 s later at that rate's budget, and h2 -> h1 read 48 past a
        test's 5 s (and in a fresh-clone CI run).

        Only the job's share counts: a tenant's flow is load, and a train
        rightly reads what it leaves (`test_only_a_vouching_train_is_lifted_
        by_what_the_peer_carried`: a tenant's flow into the peer once lifted
        a path read through the sender's uplink to 1.25x)."""
        c = self.config
        held, x = self._rise, m.capacity_bps
        if held is None or x is None or x >= held[1] * (1 - c.threshold):
            return False
        job = max(0.0, self.peer_carried - (self.peer_down_load or 0.0)) * c.payload_ratio
        return (job > 0 and x + job >= held[1] * (1 - c.threshold)
                and not self._vouches(self._train_bytes(m), held[1]))

    def _rise_check(self, m: TrainMeasurement, now: float) -> str | None:
        """The first sample, and a sample above the estimate, are believed
        only from a train that drained the shaper's token bucket (issue 32:
        "make trains long enough to drain any burst ... lengthen the train
        until they agree", paid for only when the reading is news).

        A train that fits a token bucket goes through it, and whatever
        queues then queues behind the next link, at line rate: on the
        emulated cluster, trains of 240 packets behind a 10 ms bucket at
        300 Mbit/s read 915-1,096 Mbit/s twice in a row, and a filter that
        confirmed a step with a second sample took it; with a sender faster
        than the line every train that fits reads the line's rate, and two
        such trains of different lengths agree on it. A reading of x is
        believed from a train that

        * shows the bucket running dry (`_drained`): its sample goes to the
          filter as any, and a rise needs a second one, as any step;
        * or lasted `verify_s` at x (`verify_bytes`): it drains any bucket
          of up to about half as long at the true rate, and reads the true
          rate then; or is the longest train there is.

        Otherwise the reading is held ("rise") and the next train is twice
        as long, up to one that vouches for it: a bucket shows as a longer
        train reading less, at about twice the bucket's size rather than
        20 ms at the line rate (3 MB against a 150 Mbit/s path's 187 KB
        bucket, recorded). Every later train then starts past twice the
        packets that went ahead of the queue (`burst_bytes`).

        Returns "rise" while a reading is held, else None: the caller folds
        the sample in as usual (after a rise vouched for by a long train
        the filter's window has started over)."""
        c = self.config
        v = self.capacity.value
        wire = c.packet_size + WIRE_OVERHEAD
        train = self._train_bytes(m)
        x = m.capacity_bps
        assert x is not None
        held = self._rise
        if held is not None and self._shared_with_the_job(m):
            # (not a bucket: the rise goes on, twice as long, up to a train
            # that vouches for it beside the job's flow, `_beside_the_job`)
            self._rise = (train, held[1])
            self.capacity.touch(now)
            return "rise"
        if held is not None and train > held[0] and x < held[1] * (1 - c.threshold):
            # a longer train read less: the shorter went through a bucket (twice
            # the packets ahead of the queue: the queued part of a train must
            # outnumber them for analyze_train to take its spacing)
            past = max(2 * held[0], 2 * m.run_start * wire)
            self.burst_bytes = min(max(self.burst_bytes, past), c.max_packets * wire)
        if v is not None and x <= v * (1 + c.threshold):
            self._rise = None  # no news: an ordinary sample
            return None
        if self._drained(m):
            self._rise = None  # the filter takes it (a rise: once a second agrees)
            return None
        # (a reading within the threshold of the one the train was sized for vouches)
        if self._vouches(train, x):
            self._rise = None
            if v is not None:
                self.capacity.reset()  # the path is faster: a new window
            return None
        self._rise = (train, x)
        self.capacity.touch(now)
        return "rise"

    @staticmethod
    def _drained(m: TrainMeasurement) -> bool:
        """The train shows its bottleneck's bucket running dry: packets went
        through quickly (at least 2x the reading), then queued at a rate far
        below this host's sending (at most a quarter): no bucket ahead of a
        slower line. A queue at line rate behind a bucket reads close to
        the send rate (915-1,096 Mbit/s against 680-1,330 on the emulated
        cluster) or starts at the first packet (a sender faster than the
        line); a shaper's queue after its 1 ms bucket read 97 Mbit/s against
        1,600."""
        x, send, head = m.capacity_bps, m.send_bps, m.head_bps
        return (x is not None and send is not None and head is not None
                and m.run_start >= 2 and 4 * x <= send and 2 * x <= head)

    def _bucket(self, m: TrainMeasurement, send: float) -> bool:
        """Whether a train that formed no queue went through a token bucket
        (issue 32: tbf bursts of 64 KB or 10 ms at the rate, as real shapers
        and cloud rate limiters have): it left far faster than the path's
        known capacity, so either the path sped up or a bucket let all of it
        through. The next train is twice as long, past such a bucket, and
        measures which; a faster path is then believed from a train long
        enough, as any rise (`_rise_check`: the first train past a
        bucket can leave it partly full, and measured 2-3x the rate now and
        then). Taking the send rate as the capacity instead
        read a 30 Mbit/s path at 1,232. Up to the largest train; past it the
        old rules (escalate, then the send rate) hold."""
        c = self.config
        v = self.capacity.value
        wire = c.packet_size + WIRE_OVERHEAD
        train = self._train_bytes(m)
        if train >= c.max_packets * wire or (v is not None and send < 1.5 * v):
            return False
        # (With no estimate yet, likewise: the send rate taken at start-up
        # behind a bucket stayed the estimate, since no later train left
        # 1.5x faster than it.)
        self._unqueued = 0
        self.burst_bytes = min(max(2 * train, self.burst_bytes), c.max_packets * wire)
        return True

    def steady_interval(self) -> float:
        """Seconds between trains in steady state (the budget's pace)."""
        c = self.config
        return max(self.plan(0).wire_bytes / self.budget_bytes_per_s(), c.min_interval)

    def _outcome(self, name: str, quick: bool = False) -> str:
        self.outcomes[name] = self.outcomes.get(name, 0) + 1
        self._last = name
        self._quick = quick
        return name

    def on_rtt(self, seconds: float, now: float | None = None) -> None:
        self.rtt.add(seconds, self.clock() if now is None else now)

    def passive_problem(self, nbytes: int, seconds: float) -> str | None:
        """Why a reported transfer cannot be true (None: it can): a duration
        that is not a finite positive number, or a rate above the physical
        limit of this host's link (`max_bps`, the NIC's speed when known)."""
        if not (math.isfinite(seconds) and seconds > 0) or nbytes < 0:
            return f"{nbytes} bytes in {seconds!r} s is no transfer"
        rate = nbytes * 8 / seconds
        if rate > self.config.max_bps:
            return (f"{nbytes} bytes in {seconds:g} s is {rate / 1e6:,.0f} Mbit/s, above "
                    f"this host's link ({self.config.max_bps / 1e6:,.0f} Mbit/s)")
        return None

    def on_passive(self, nbytes: int, seconds: float, now: float | None = None) -> bool:
        """A real transfer of `nbytes` took `seconds`. Small transfers (slow start
        dominated) are ignored; returns whether the sample was used."""
        now = self.clock() if now is None else now
        if nbytes < self.config.min_passive_bytes or self.passive_problem(nbytes, seconds):
            return False
        self.passive_bps = nbytes * 8 / seconds
        self._passive_at = now
        return True

    def on_delivery(self, bps: float, now: float | None = None) -> bool:
        """A delivery-rate sample of the job's own TCP flow to the peer
        (payload bit/s; the kernel's, as BBR takes it: bytes delivered per
        interval, while the flow was not app-limited). The estimate takes the
        largest of the last `delivery_window` seconds as a passive sample,
        and while that is the capacity the path needs no trains (see
        `interval`): the job's transfer measures it (issue 32: "prefer them
        while the job is sending, and send active trains only when the link
        is idle"). A sample above this host's link, or no number, is
        refused (returns False)."""
        now = self.clock() if now is None else now
        c = self.config
        if not (math.isfinite(bps) and 0 < bps <= c.max_bps):
            return False
        d = self._deliveries
        d.append((now, bps))
        while d and d[0][0] < now - c.delivery_window:
            d.popleft()
        self.passive_bps = max(r for _, r in d)
        self._passive_at = now
        v = self.capacity.value
        if v is not None and self.passive_bps >= (1 - c.threshold) * v:
            self._delivered_at = now
            self.capacity.touch(now)  # the job's flow shows the capacity holds
        return True

    def delivering(self, now: float | None = None) -> bool:
        """The job's own flow showed the path's capacity within the last
        `delivery_window` seconds: active trains would tell nothing more."""
        now = self.clock() if now is None else now
        at = self._delivered_at
        return at is not None and now - at <= self.config.delivery_window

    # -- reading -------------------------------------------------------------

    def down_capacity(self) -> float | None:
        """A lower bound of the peer's downlink capacity in payload bit/s (see
        the module's docstring): C, or more where a long train proved it.
        None: no C yet."""
        cap = self.capacity.value
        if cap is None:
            return None
        return cap if self._proven is None else max(cap, self._proven)

    def _weigh_evidence(self) -> None:
        """After each capacity sample: room proven on the peer's downlink
        stays proven while most of the last EVIDENCE samples are clean (a
        burst of cross traffic slows a train now and then; a downlink
        without room slows most of them)."""
        cap = self.capacity.value
        slowed = sum(sample < (1 - self.config.threshold) * cap
                     for sample in self._evidence) if cap is not None else EVIDENCE
        if slowed > EVIDENCE // 2:
            self._proven = None

    def _room_unproven(self, sample: float, now: float) -> bool:
        """A clean sample no proof accounts for: the train went through at
        the path's capacity, yet the peer's downlink, less its load now,
        leaves less than that, because its room was proven under a lighter
        load, or never. The next train goes at once and lasts `verify_s` / 2
        at the capacity: a train that long meets several bursts of any paced
        flow, so it comes through clean only where the downlink has room for
        it beside the load, and then proves that room (`down_capacity`). At
        most `PROOF_BURST` every `PROOF_WINDOW` seconds, and only under a load other
        than the last one's, unless the last one's train was the first slowed
        under it: a burst of the flow meets a long train now and then, and a
        path into the loaded host then read 0 until the load changed or 30 s
        passed (a fresh-clone CI failure: h3 -> h0 at 0 against 117 Mbit/s).
        Two slowed in a row say the downlink has no room.

        (Issue 32: a tenant's flow of half of h0's downlink read two paths
        into h0 that it left room for at 0 for up to 30 s: the old proof,
        five clean trains in a row, took five trains at the budget's pace
        under the new load. And those short trains proved room that was not
        there: a paced flow's 1 ms bursts let them through clean.)"""
        c = self.config
        cap = self.capacity.value
        if cap is None or sample < (1 - c.threshold) * cap:
            return False
        load = (self.peer_down_load or 0.0) * c.payload_ratio
        if (self.down_capacity() or cap) - load >= (1 - c.threshold) * cap:
            return False
        p = self._proved
        if p and self._proofs_failed != 1 and self._same_load(load, p[-1][1]):
            return False  # the last proof was under this load
        return len(p) < PROOF_BURST or now - p[0][0] >= PROOF_WINDOW

    def _same_load(self, a: float, b: float) -> bool:
        return abs(a - b) <= self.config.threshold * max(a, b)

    def load_bps(self, local_up_load: float | None) -> float:
        """Load on the path in payload bit/s: the busier of our uplink and the
        peer's downlink (wire bit/s from the counters, scaled to payload)."""
        loads = [x for x in (local_up_load, self.peer_down_load) if x is not None]
        return max(loads, default=0.0) * self.config.payload_ratio

    def snapshot(self, now: float | None = None, local_up_load: float | None = None,
                 up_capacity: float | None = None) -> PathEstimate:
        """The estimate now. `local_up_load`: this host's uplink load (wire
        bit/s); `up_capacity`: the largest capacity of this host's paths, a
        lower bound of its uplink's (payload bit/s; default this path's)."""
        now = self.clock() if now is None else now
        c = self.config
        cap = self.capacity.value
        last = self.capacity.last_sample
        age = math.inf if last is None else max(0.0, now - last)
        load = self.load_bps(local_up_load)
        bw = math.nan
        if cap is not None:
            # Each link's load comes off that link's capacity only.
            up_load = (local_up_load or 0.0) * c.payload_ratio
            down_load = (self.peer_down_load or 0.0) * c.payload_ratio
            # What the peer's downlink carries (its load and the job's own
            # traffic) proves that much of it, and the path has at least the
            # smaller of its two links: trains that share the downlink's queue
            # with the job's flow read a share, not the capacity.
            carried = max(down_load, self.peer_carried * c.payload_ratio)
            up_cap = max(cap, up_capacity or 0.0)
            cap = max(cap, min(up_cap, carried))
            up = up_cap - up_load
            down = max(self.down_capacity() or cap, carried) - down_load
            bw = max(min(cap, up, down), 0.0)
        fresh_passive = self._passive_at is not None and now - self._passive_at <= c.passive_fresh
        if fresh_passive:
            bw = self.passive_bps if math.isnan(bw) else max(bw, min(self.passive_bps,
                                                                     cap or math.inf))
            if cap is None:
                age = now - self._passive_at  # type: ignore[operator]
        # Never above the physical limit of this host's link.
        bw = min(bw, c.max_bps) if not math.isnan(bw) else bw
        return PathEstimate(
            bandwidth_bps=bw,
            capacity_bps=math.nan if cap is None else cap,
            rtt_s=math.nan if self.rtt.value is None else self.rtt.value,
            age_s=age,
            # A path behind a large bucket is probed less often (its trains
            # are larger, the budget the same): stale only when overdue.
            stale=math.isnan(bw) or age > max(c.stale_after, 2.5 * self.steady_interval()),
            samples=self.capacity.count,
            load_bps=load,
            passive_bps=self.passive_bps,
        )
