"""A discrete-event, flow-level simulation of one job on a big-switch cluster.

`simulate(scenario, policy)` runs the loop of `mlfabric.tools.workload` for every
worker (pull the model, compute, push an update, wait for its outcome) on
a simulated network (`mlfabric.sim.flownet`: hosts with an uplink and a
downlink, capacities that change over time, concurrent flows sharing links
max-min fairly, as TCP shares them), with the real controller's decision
code in the loop: a `ControlState` with `control.fifo_policy` or
`policies.mlfabric_policy`, asked on every event exactly as
`mlfabric.controller.controller` asks it (a request, a completion, its own wake-up
time), its directives carried out as the client carries them out (go: send
now; drop: the push ends unapplied with the reason). The server applies
updates in the order their last byte lands and refuses those staler than
tau_max, as `mlfabric.server.store` does.

The simulation is pure: no I/O, no clock. The controller's decision time
is measured, when asked, by timing the real `decide` calls with a timer the
caller passes in; nothing simulated depends on it. What is modelled and
what is not: docs/simulator.md.

    python -m mlfabric.sim --workers 8 --policy both --update-mib 2 \\
        --server-down-mbit 100 --compute-ms 1200 --steps 8 --seed 0
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import os
import random
import secrets
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, cast

from ..controller.directives import DecisionFile, carry_out
from ..controller.state import ControlState, Drop, Go
from ..errors import ConfigError
from ..runtime import memory
from ..runtime.metrics import ControllerMetrics
from ..scheduling import plan as control
from ..scheduling.plan import Network
from ..server.holds import Holds
from ..wire.protocol import Connection
from .flownet import FlowNet, SlowStart

MIB = 1 << 20
SERVER = "h0"
POLICIES = ("fifo", "mlfabric")
# TCP payload per wire frame: MSS 1448 B (1500 MTU less IP, TCP and timestamp
# headers) in a 1514 B Ethernet frame, which is what the testbed's tbf meters.
TCP_GOODPUT = 1448 / 1514
STALE = "stale"  # the server's reason for refusing an update (delay > tau_max)
MAX_SHARDS = 1024  # as many as one job's model is split over (client.shards)


@dataclass(frozen=True)
class RateChange:
    """At `at` seconds, `host`'s uplink and/or downlink become these rates (Mbit/s,
    as shaped on the wire; None leaves a direction as it is)."""

    at: float
    host: str
    up_mbit: float | None = None
    down_mbit: float | None = None


DECISION_LATENCIES = ("none", "measured")
LANDING_REPORTS = ("worker", "server")
CONTROLLER_VIEWS = ("static", "live")


@dataclass(frozen=True)
class Scenario:
    """One job: a server on host h0 and `workers` workers on h1..hN; with
    `shards` > 1, shard k's server on host s{k} (k = 0..shards-1), each
    update split into one part per shard as `mlfabric.sharding` splits one
    tensor (sizes differ by at most one byte).

    Rates are what the links are shaped to (Mbit/s on the wire); flows get
    `goodput` of them as payload. `message_latency` is the one-way time of
    every small message (request, directive, outcome, report, pull request).
    Workers' compute times follow workload.py: compute x (1 + jitter x U(-1,
    1)) from random.Random(seed * 100 + i), i = 0..N-1."""

    workers: int = 8
    shards: int = 1
    # Controllers, each planning the shards k with k mod controllers equal to
    # its index (as `mlfabric controller --etcd` splits them at start), with
    # its part of every worker uplink (`Network.up_share`), each busy with its
    # own re-plans (they run on hosts of their own).
    controllers: int = 1
    update_bytes: int = 2 * MIB
    steps: int = 8
    compute: float = 1.2  # seconds per step, before jitter
    jitter: float = 0.2
    max_in_flight: int = 1
    tau_max: int | None = 8
    server_up_mbit: float = 1000.0
    server_down_mbit: float = 100.0
    worker_up_mbit: float = 1000.0
    worker_down_mbit: float = 1000.0
    changes: tuple[RateChange, ...] = ()
    goodput: float = TCP_GOODPUT
    slow_start: bool = True  # new flows ramp up as TCP does (flownet.SlowStart)
    queue_delay: float = 0.05  # round-trip added by a saturated link's queue (tbf: 50 ms)
    base_rtt: float = 2e-4  # round trip over idle links
    message_latency: float = 0.001
    apply_seconds: float = 0.0  # from the last byte landing to the outcome leaving
    start_delay: float = 0.0  # when the workers start (after the rate schedule's t=0)
    start_spread: float = 0.0  # each worker starts up to this much later (uniform)
    starts: tuple[float, ...] = ()  # per worker start times; replace the two above
    stragglers: float = 0.0  # fraction of workers whose compute is slower ...
    straggler_factor: float = 1.0  # ... by this factor
    seed: int = 0
    idle_factor: float | None = 1.0  # the mlfabric policy's drop rule
    controller_view: str = "static"  # "static": configured rates; "live": true rates
    # 0: the controller re-plans on every event, as mlfabric.controller.controller does;
    # > 0: at most once per this many seconds (events in between wait for it).
    replan_every: float = 0.0
    # "none": a re-plan takes no simulated time (the run is deterministic).
    # "measured": it takes the wall time its decide() took here; its directives
    # leave when it ends, and the events that arrive meanwhile share the next
    # re-plan, as mlfabric.controller.controller's do (the run then depends on this
    # machine's speed: what a controller built from this code keeps up with).
    decision_latency: str = "none"
    until: float = math.inf  # stop the run at this simulated time
    # Who tells the controller a transfer has landed. "worker": its worker,
    # once the server's answer has reached it (two messages after the
    # landing), as mlfabric does by default. "server": the server itself
    # (one message), as `mlfabric server --controller` does; the worker's
    # report still follows, and only times the transfer.
    landing_report: str = "worker"
    # Servers apply a push that lands before the transfers its go named
    # only once they have landed (`Go.after`, as mlfabric's do); False:
    # each as it lands, as before issue 34's names (to measure them).
    keep_order: bool = True

    def __post_init__(self) -> None:
        def positive(name: str, v: float) -> None:
            if not (v > 0 and math.isfinite(v)):
                raise ConfigError(f"{name} must be a finite number > 0, got {v!r}")

        def at_least_zero(name: str, v: float) -> None:
            if not (v >= 0 and math.isfinite(v)):
                raise ConfigError(f"{name} must be a finite number >= 0, got {v!r}")

        if self.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {self.workers}")
        if not 1 <= self.shards <= MAX_SHARDS:
            raise ConfigError(f"shards must be in 1..{MAX_SHARDS}, got {self.shards}")
        if not 1 <= self.controllers <= self.shards:
            raise ConfigError(f"controllers must be in 1..shards ({self.shards}): each plans at "
                              f"least one shard, got {self.controllers}")
        if self.update_bytes < self.shards:
            raise ConfigError(f"update_bytes must be >= 1 per shard, got {self.update_bytes} "
                              f"for {self.shards} shard(s)")
        if self.steps < 0:
            raise ConfigError(f"steps must be >= 0, got {self.steps}")
        if self.max_in_flight < 1:
            raise ConfigError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.tau_max is not None and self.tau_max < 0:
            raise ConfigError(f"tau_max must be >= 0 (or None for no bound), got {self.tau_max}")
        for name in ("server_up_mbit", "server_down_mbit", "worker_up_mbit",
                     "worker_down_mbit", "straggler_factor"):
            positive(name, getattr(self, name))
        positive("base_rtt", self.base_rtt)
        for name in ("compute", "message_latency", "queue_delay", "replan_every",
                     "apply_seconds", "start_delay", "start_spread"):
            at_least_zero(name, getattr(self, name))
        if not 0 <= self.jitter < 1:
            raise ConfigError(f"jitter must be in [0, 1), got {self.jitter}")
        if not 0 < self.goodput <= 1:
            raise ConfigError(f"goodput must be in (0, 1], got {self.goodput}")
        if not 0 <= self.stragglers <= 1:
            raise ConfigError(f"stragglers must be a fraction in [0, 1], got {self.stragglers}")
        if self.decision_latency not in DECISION_LATENCIES:
            raise ConfigError(f"decision_latency must be one of {DECISION_LATENCIES}, got "
                              f"{self.decision_latency!r}")
        if self.landing_report not in LANDING_REPORTS:
            raise ConfigError(f"landing_report must be one of {LANDING_REPORTS}, got "
                              f"{self.landing_report!r}")
        if self.controller_view not in CONTROLLER_VIEWS:
            raise ConfigError(
                f"controller_view must be 'static' or 'live', got {self.controller_view!r}")
        if self.starts and len(self.starts) != self.workers:
            raise ConfigError(f"starts has {len(self.starts)} times for {self.workers} workers; "
                              f"give one per worker (or none)")
        for t in self.starts:
            at_least_zero("a worker's start time", t)
        for c in self.changes:
            if c.host not in self.hosts():
                servers = "h0 (server)" if self.shards == 1 else \
                    f"s0 to s{self.shards - 1} (servers)"
                raise ConfigError(f"rate change for unknown host {c.host!r}; hosts are "
                                  f"{servers} and h1 to h{self.workers} (workers)")
            for v in (c.up_mbit, c.down_mbit):
                if v is not None and not (v >= 0 and math.isfinite(v)):
                    raise ConfigError(f"rate change at {c.at} s: rate {v} Mbit/s must be >= 0")
            at_least_zero("rate change time", c.at)

    def servers(self) -> list[str]:
        """Shard k's server host, by k."""
        return [SERVER] if self.shards == 1 else [f"s{k}" for k in range(self.shards)]

    def hosts(self) -> list[str]:
        return [*self.servers(), *(f"h{i}" for i in range(1, self.workers + 1))]

    def parts(self) -> list[int]:
        """Bytes of an update's part per shard."""
        base, extra = divmod(self.update_bytes, self.shards)
        return [base + (k < extra) for k in range(self.shards)]

    def nominal(self) -> tuple[dict[str, float], dict[str, float]]:
        """Configured (up, down) Mbit/s per host at t = 0."""
        up = {h: self.worker_up_mbit for h in self.hosts()}
        down = {h: self.worker_down_mbit for h in self.hosts()}
        for server in self.servers():
            up[server], down[server] = self.server_up_mbit, self.server_down_mbit
        return up, down


@dataclass
class PushRecord:
    """One push, what became of it and when (seconds of simulated time)."""

    worker: int
    step: int
    base_version: int  # shard 0's
    pushed: float  # push() called
    sent: float | None = None  # the first directive to send arrived (None: never sent)
    landed: float | None = None  # its last byte reached the server (the last shard's)
    done: float | None = None  # the outcome reached the worker (the last shard's)
    applied: bool = False  # by every shard
    delay: int | None = None  # staleness at the server (None if not sent; shards: the most)
    reason: str | None = None  # why not applied: a drop reason or "stale" (the first)
    base_versions: tuple[int, ...] = ()  # per shard
    parts_left: int = 1  # parts whose outcome has not come

    @property
    def seconds(self) -> float | None:
        """push-to-outcome time, as workload.py records it."""
        return None if self.done is None else self.done - self.pushed


@dataclass(frozen=True)
class Sample:
    """The first server's downlink, and the controllers, at simulated time `t`.

    `load` is the payload its flows carry over its capacity then; `flows`
    how many cross it; `planned` the rate the first controller plans it
    by (configuration, agents and its closed loop's cap) over the rate it
    is shaped to then (2.0: it plans by twice what the link gives).
    `waiting` and `running` are the transfers all controllers hold pending
    and let go."""

    t: float
    load: float
    flows: int
    planned: float
    waiting: int
    running: int


@dataclass
class Result:
    policy: str
    scenario: Scenario
    records: list[PushRecord]
    end: float  # simulated time when the last worker finished
    bytes_into_server: float  # payload bytes of pushes that reached the server
    decision_seconds: list[float] = field(default_factory=list)  # wall time per decide()
    decision_pending: list[int] = field(default_factory=list)  # pending updates per decide()
    decision_events: list[int] = field(default_factory=list)  # events each decide() answered
    max_utilization: float = 0.0  # highest link load / capacity seen (audit runs)
    events: int = 0
    busy: list[float] = field(default_factory=list)  # decide() wall time, per controller
    # Pushes a server held for the transfers their go said to follow
    # (`Go.after`), and of them those applied when the wait ran out.
    held: int = 0
    held_expired: int = 0
    timeline: list[Sample] = field(default_factory=list)  # simulate(sample_every=)

    def summary(self) -> dict[str, Any]:
        recs = self.records
        applied = [r for r in recs if r.applied]
        delays = sorted(r.delay for r in applied if r.delay is not None)
        secs = sorted(r.seconds for r in applied if r.seconds is not None)
        # Every push, refused or dropped too: fifo's server refuses the
        # stalest, which waited longest, so its push-to-applied leaves out
        # its slowest pushes (577 of 4,000 at 1,000 workers over 4 shards).
        outcome = sorted(r.seconds for r in recs if r.seconds is not None)
        reasons: dict[str, int] = {}
        for r in recs:
            if not r.applied:
                key = r.reason or "unresolved"
                reasons[key] = reasons.get(key, 0) + 1
        out: dict[str, Any] = {
            "policy": self.policy, "workers": self.scenario.workers, "pushes": len(recs),
            "applied": len(applied), "dropped": len(recs) - len(applied), "reasons": reasons,
            "delay": _stats(delays), "push_to_applied": _stats(secs),
            "push_to_outcome": _stats(outcome),
            "bytes_into_server": self.bytes_into_server, "end": self.end,
            "decisions": len(self.decision_pending),
            "pending_max": max(self.decision_pending, default=0),
            "events_per_decision": _stats(sorted(self.decision_events)),
            "held": self.held, "held_expired": self.held_expired,
        }
        if self.decision_seconds:
            ds = sorted(self.decision_seconds)
            out["decision_seconds"] = _stats(ds)
            # The busiest controller's share of the run spent deciding.
            busiest = max(self.busy, default=sum(ds))
            out["controller_busy"] = busiest / self.end if self.end > 0 else 0.0
        return out


def _stats(xs: list[float] | list[int]) -> dict[str, float]:
    """count, mean, std (population), p50, p99, max of sorted `xs`."""
    if not xs:
        return {"count": 0}
    return {"count": len(xs), "mean": statistics.fmean(xs), "std": statistics.pstdev(xs),
            "p50": _quantile(xs, 0.5), "p99": _quantile(xs, 0.99), "max": float(xs[-1])}


def _quantile(sorted_xs: list[float] | list[int], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = q * (len(sorted_xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return float(sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo))


def make_policy(name: str, idle_factor: float | None = 1.0) -> control.Policy:
    """The controller's policy function for `name`, as `mlfabric controller` builds it."""
    if name == "fifo":
        return control.fifo_policy
    if name == "mlfabric":
        from ..scheduling.policies import Mlfabric

        return Mlfabric(idle_factor=idle_factor)  # as the real controller builds it
    raise ConfigError(f"policy must be one of {POLICIES}, got {name!r}")


def mbit(rate_mbit: float) -> float:
    """Mbit/s -> bytes/s."""
    return rate_mbit * 1e6 / 8


# --- the simulation ----------------------------------------------------------------------


@dataclass
class _Worker:
    index: int  # 0-based; host h{index + 1}
    host: str
    rng: random.Random
    slow: float  # compute-time factor (1, or straggler_factor)
    steps_started: int = 0
    in_flight: deque[PushRecord] = field(default_factory=deque)
    blocked: bool = False  # waiting for its oldest push to settle
    finished: bool = False


@dataclass(eq=False)
class _Held:
    """A push a server holds (`server.holds.Holds`), and its ticket."""

    w: _Worker
    req: int
    ticket: int


class _Sim:
    def __init__(self, sc: Scenario, policy: str, *, timer: Callable[[], float] | None,
                 audit: bool, progress: Callable[[float, int, int], None] | None,
                 progress_every: int, sample_every: float | None = None) -> None:
        self.sc = sc
        self.policy_name = policy
        self.timer = timer
        self.progress = progress
        self.progress_every = progress_every
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        hosts = sc.hosts()
        self.link_up = {h: 2 * k for k, h in enumerate(hosts)}
        self.link_down = {h: 2 * k + 1 for k, h in enumerate(hosts)}
        up, down = sc.nominal()
        self.wire_up, self.wire_down = dict(up), dict(down)  # Mbit/s now, as shaped
        caps = []
        for h in hosts:
            caps += [mbit(up[h]) * sc.goodput, mbit(down[h]) * sc.goodput]
        ramp = SlowStart(base_rtt=sc.base_rtt, queue_delay=sc.queue_delay) if sc.slow_start \
            else None
        self.net = FlowNet(caps, audit=audit, slow_start=ramp, hops=2)
        self.on_flow_end: dict[int, Callable[[], None]] = {}
        # The closed loop (order guard, rates learnt from the job's transfers)
        # as `mlfabric controller` runs it: for the mlfabric policy.
        closed = policy == "mlfabric"
        self.controllers = [
            _Controller(self, k, ControlState(
                make_policy(policy, sc.idle_factor), tau_max=sc.tau_max,
                network=self._controller_network(up, down, k), guard_order=closed,
                learn_rates=closed))
            for k in range(sc.controllers)]
        self.servers = sc.servers()
        self.parts = sc.parts()
        self.versions = [0] * sc.shards  # each shard server's
        self.bytes_in = 0.0
        # Per shard, as its server keeps them: the tickets applied or refused,
        # and the pushes landed before those their go named (`Go.after`; one
        # controller plans a shard, so its transfer ids are the tickets); how
        # many were held, and how many waited out their `after_seconds`.
        self._holds = [Holds() for _ in range(sc.shards)]
        self.held = self.held_expired = 0
        self.records: list[PushRecord] = []
        # (worker, request) -> the push, the shard of this part, when it was let go
        self.by_request: dict[tuple[int, int], tuple[PushRecord, int]] = {}
        self._sent: dict[tuple[int, int], float] = {}
        self._requests = 0
        self.decision_seconds: list[float] = []
        self.decision_pending: list[int] = []
        self.decision_events: list[int] = []
        self.events = 0
        self.total_pushes = sc.workers * sc.steps
        self.finished_workers = 0
        straggle = random.Random(f"stragglers-{sc.seed}")
        slow = set(straggle.sample(range(sc.workers), round(sc.stragglers * sc.workers)))
        spread = random.Random(f"start-{sc.seed}")
        self.workers = []
        for i in range(sc.workers):
            w = _Worker(i, f"h{i + 1}", random.Random(sc.seed * 100 + i),
                        sc.straggler_factor if i in slow else 1.0)
            self.workers.append(w)
            offset = sc.start_delay + (spread.random() * sc.start_spread if sc.start_spread
                                       else 0.0)
            if sc.starts:
                offset = sc.starts[i]
            self.at(offset, self._worker_start, w)
        for c in sorted(sc.changes, key=lambda c: c.at):
            self.at(c.at, self._rate_change, c)
        self.timeline: list[Sample] = []
        self.sample_every = sample_every
        if sample_every is not None:
            self.at(0.0, self._sample)

    # -- the event loop --------------------------------------------------------------------

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def after(self, dt: float, fn: Callable[..., None], *args: Any) -> None:
        self.at(self.now + dt, fn, *args)

    def run(self) -> None:
        events = self._events
        while self.finished_workers < len(self.workers):
            t_event = events[0][0] if events else math.inf
            t_flow = self.net.next_completion()
            t = min(t_event, t_flow)
            if t > self.sc.until:
                break
            if t == math.inf:
                raise ConfigError(
                    f"the simulation stalled at t={self.now:.3f} s: flows are left on links "
                    f"of capacity 0 and nothing is scheduled to change that")
            self.now = t
            for flow in self.net.advance(t):  # flows that end by now go first
                self.on_flow_end.pop(flow.id)()
            if t_event <= t:
                _, _, fn, args = heapq.heappop(events)
                fn(*args)
            self.events += 1
            if self.progress is not None and self.events % self.progress_every == 0:
                done = sum(r.done is not None for r in self.records)
                self.progress(self.now, done, self.total_pushes)

    def flow(self, src: str, dst: str, nbytes: float, then: Callable[[], None],
             pace: float | None = None, pace_seconds: float | None = None) -> None:
        """`nbytes` from src to dst, then `then`; a `pace` (bytes/s on the wire,
        as a go's) holds its payload to `goodput` of it, for `pace_seconds`
        (None: to its end)."""
        max_rate = math.inf if pace is None else pace * self.sc.goodput
        fid = self.net.start((self.link_up[src], self.link_down[dst]), nbytes, max_rate)
        if pace is not None and pace_seconds is not None:
            self.after(pace_seconds, self.net.set_max_rate, fid)
        self.on_flow_end[fid] = then

    def _sample(self) -> None:
        """One `Sample`, and the next one `sample_every` later while workers run."""
        server = self.servers[0]
        link = self.link_down[server]
        capacity = float(self.net.capacity[link])
        load = float(self.net.loads()[link]) / capacity if capacity > 0 else 0.0
        shaped = mbit(self.wire_down[server])
        planned = self.controllers[0].state.network.down_rate(server)
        self.timeline.append(Sample(
            self.now, load, self.net.flows_on(link),
            planned / shaped if shaped > 0 else math.inf,
            sum(len(c.state.pending) for c in self.controllers),
            sum(len(c.state.active) for c in self.controllers)))
        if self.finished_workers < len(self.workers):
            assert self.sample_every is not None
            self.after(self.sample_every, self._sample)

    # -- network changes ---------------------------------------------------------------------

    def _controller_network(self, up: dict[str, float], down: dict[str, float],
                            controller: int) -> Network:
        """What controller `controller` is told: link rates in bytes/s on the
        wire, as an operator writes them with --link (no header overhead
        taken off), and its part of the uplinks (the shards it plans)."""
        floor = 1.0  # the scheduling core refuses capacity 0; a measured 0 is floored
        planned = len(range(controller, self.sc.shards, self.sc.controllers))
        return Network(default=mbit(self.sc.worker_up_mbit),
                       up={h: max(mbit(r), floor) for h, r in up.items()},
                       down={h: max(mbit(r), floor) for h, r in down.items()},
                       up_share=planned / self.sc.shards)

    def _rate_change(self, c: RateChange) -> None:
        if c.up_mbit is not None:
            self.wire_up[c.host] = c.up_mbit
            self.net.set_capacity(self.link_up[c.host], mbit(c.up_mbit) * self.sc.goodput)
        if c.down_mbit is not None:
            self.wire_down[c.host] = c.down_mbit
            self.net.set_capacity(self.link_down[c.host], mbit(c.down_mbit) * self.sc.goodput)
        if self.sc.controller_view == "live":
            for ctl in self.controllers:
                ctl.state.set_network(self._controller_network(self.wire_up, self.wire_down,
                                                               ctl.index))
                ctl.replan()

    # -- workers (workload.py's loop) --------------------------------------------------

    def _worker_start(self, w: _Worker) -> None:
        self._pull(w, lambda versions: self._next_step(w))  # the initial pull

    def _pull(self, w: _Worker, then: Callable[[tuple[int, ...]], None]) -> None:
        """Every shard's part, concurrently; `then(versions)` once all are in."""
        versions = list(self.versions)
        left = [len(self.servers)]

        def serve(k: int) -> None:
            versions[k] = self.versions[k]  # the shard's snapshot when the request lands
            self.flow(self.servers[k], w.host, self.parts[k], arrived)

        def arrived() -> None:
            left[0] -= 1
            if not left[0]:
                then(tuple(versions))

        for k in range(len(self.servers)):
            self.after(self.sc.message_latency, serve, k)

    def _next_step(self, w: _Worker) -> None:
        if w.steps_started == self.sc.steps:
            if not w.in_flight:
                self._finish(w)
            else:
                w.blocked = True  # settles every push still in flight
                self._settle(w)
            return
        w.steps_started += 1
        self._pull(w, lambda version: self._compute(w, version))

    def _compute(self, w: _Worker, versions: tuple[int, ...]) -> None:
        sc = self.sc
        seconds = sc.compute * (1 + sc.jitter * (2 * w.rng.random() - 1)) * w.slow
        self.after(seconds, self._push, w, versions)

    def _push(self, w: _Worker, base_versions: tuple[int, ...]) -> None:
        rec = PushRecord(w.index, w.steps_started, base_versions[0], pushed=self.now,
                         base_versions=base_versions, parts_left=len(base_versions))
        self.records.append(rec)
        w.in_flight.append(rec)
        for k, base in enumerate(base_versions):  # a request per part, as ShardedClient's
            self._requests += 1
            self.by_request[(w.index, self._requests)] = (rec, k)
            self.after(self.sc.message_latency, self._ctl_request, w, self._requests, k, base)
        if len(w.in_flight) >= self.sc.max_in_flight:
            w.blocked = True
            self._settle(w)
        else:
            self._next_step(w)

    def _go(self, w: _Worker, req: int, pace: float | None = None,
            pace_seconds: float | None = None, ticket: int | None = None,
            follow: tuple[tuple[int, ...], float | None] | None = None) -> None:
        rec, k = self.by_request[(w.index, req)]
        if rec.sent is None:
            rec.sent = self.now
        self._sent[(w.index, req)] = self.now
        self.flow(w.host, self.servers[k], self.parts[k],
                  lambda: self._land(w, req, ticket, follow), pace, pace_seconds)

    def _outcome(self, w: _Worker, req: int, applied: bool, delay: int | None,
                 reason: str | None, report: tuple[int, bool, int | None] | None) -> None:
        """One part's outcome; the push's once every part has one (as
        ShardedOutcome: applied by every shard, the first refusal's reason;
        the delay, the most any shard measured, applying it or not)."""
        rec, k = self.by_request.pop((w.index, req))
        sent = self._sent.pop((w.index, req), None)
        first = rec.parts_left == len(self.servers)
        rec.parts_left -= 1
        rec.applied = applied and (first or rec.applied)
        if delay is not None:
            rec.delay = delay if rec.delay is None else max(rec.delay, delay)
        if not applied and rec.reason is None:
            rec.reason = reason
        if report is not None:
            version, ok, d = report
            # The worker reports the time from its go to the server's answer.
            seconds = self.now - sent if sent is not None else None
            self.after(self.sc.message_latency, self._ctl_done, w, req, version, ok, d, seconds,
                       k)
        if rec.parts_left == 0:
            rec.done = self.now
            self._settle(w)

    def _settle(self, w: _Worker) -> None:
        """workload.py settles its oldest push first, while too many are in flight
        (all of them once its steps are done)."""
        if not w.blocked:
            return
        limit = 1 if w.steps_started == self.sc.steps else self.sc.max_in_flight
        while w.in_flight and len(w.in_flight) >= limit and w.in_flight[0].done is not None:
            w.in_flight.popleft()
        if len(w.in_flight) < limit:
            w.blocked = False
            self._next_step(w)

    def _finish(self, w: _Worker) -> None:
        w.finished = True
        self.finished_workers += 1

    # -- the server (store.py's rule) ------------------------------------------------------

    def _land(self, w: _Worker, req: int, ticket: int | None = None,
              follow: tuple[tuple[int, ...], float | None] | None = None) -> None:
        """The last byte is in: applied now, or (a go's `after`, as the
        server does) once the transfers it names have landed, or its
        `after_seconds` have passed."""
        rec, k = self.by_request[(w.index, req)]
        rec.landed = self.now
        self.bytes_in += self.parts[k]
        if follow is not None and ticket is not None and self.sc.keep_order:
            held = _Held(w, req, ticket)
            waits = self._holds[k].missing(follow[0])
            if waits and self._holds[k].hold(held, waits):
                self.held += 1
                self.after(follow[1] or 0.0, self._hold_expired, k, held)
                return
        self._apply(w, req, ticket)

    def _hold_expired(self, k: int, held: _Held) -> None:
        if self._holds[k].drop(held):
            self.held_expired += 1
            self._apply(held.w, held.req, held.ticket)

    def _apply(self, w: _Worker, req: int, ticket: int | None = None) -> None:
        """Apply (or refuse) a landed push, answer it; then the pushes held
        for its ticket alone go, in the order they came (as
        `ServerProtocol.finish_push` and `ParameterServer.landed`)."""
        rec, k = self.by_request[(w.index, req)]
        delay = self.versions[k] - rec.base_versions[k]
        tau = self.sc.tau_max
        if tau is not None and delay > tau:
            applied, reason = False, STALE
        else:
            self.versions[k] += 1
            applied, reason = True, None
        version = self.versions[k]
        answer = self.sc.apply_seconds + self.sc.message_latency
        if self.sc.landing_report == "server" and ticket is not None:
            # The server reports the landing itself, a message before the
            # worker's report (which still comes, and only times it).
            self.after(answer, self._ctl_landed, ticket, rec.base_versions[k], version,
                       applied, delay, k)
        report = (version, applied, delay)
        self.after(answer, self._outcome, w, req, applied, delay, reason, report)
        if ticket is not None:
            for key in self._holds[k].landed(ticket):
                h = cast(_Held, key)
                self._apply(h.w, h.req, h.ticket)

    # -- the controller (controller.py's event handling) ------------------------------------

    def _ctl_request(self, w: _Worker, req: int, shard: int, base_version: int) -> None:
        ctl = self.controllers[shard % len(self.controllers)]
        ctl.state.request(w.index, req, host=w.host, dst=self.servers[shard],
                          nbytes=self.parts[shard], base_version=base_version, norm=1.0,
                          now=self.now, shard=shard)
        ctl.replan()

    def _ctl_landed(self, ticket: int, base_version: int, version: int, applied: bool,
                    delay: int | None, shard: int) -> None:
        ctl = self.controllers[shard % len(self.controllers)]
        if ctl.state.landed(ticket, shard=shard, version=version, applied=applied,
                            delay=delay, now=self.now, base_version=base_version) is not None:
            ctl.replan()

    def _ctl_done(self, w: _Worker, req: int, version: int, applied: bool,
                  delay: int | None, seconds: float | None, shard: int) -> None:
        ctl = self.controllers[shard % len(self.controllers)]
        before = ctl.state.network
        t = ctl.state.done(w.index, req, version=version, applied=applied, delay=delay,
                           now=self.now, seconds=seconds)
        if t is None or t.landed_at is None or ctl.state.network is not before:
            ctl.replan()  # (one its server reported changed nothing else to plan by)


class _Controller:
    """One controller (controller.py's event handling): re-plans on every
    event, or once it may (replan_every, decision_latency), together with
    the events that come meanwhile."""

    def __init__(self, sim: _Sim, index: int, state: ControlState) -> None:
        self.sim, self.index, self.state = sim, index, state
        self._wake_gen = 0
        self._replan_ok = 0.0  # the earliest next re-plan (replan_every, decision_latency)
        self._events_waiting = 0  # events since the last re-plan
        self._batched = False  # a re-plan is scheduled at _replan_ok
        self.busy = 0.0  # wall time spent deciding
        # Decisions charged as measured: each action is carried out as the
        # controller does (`directives.carry_out`: counted in its metrics,
        # its record serialised into a decision log, its directive encoded
        # and MACed), into a log on /dev/null and an encoder in place of
        # the socket. A deployed controller keeps a decision log (the
        # systemd unit's and the Kubernetes manifests' --decision-log).
        self._metrics: ControllerMetrics | None = None
        self._wire: Connection | None = None
        if sim.sc.decision_latency == "measured":
            self._metrics = ControllerMetrics()
            self._wire = Connection()
            self._wire.protect(secrets.token_bytes(32), secrets.token_bytes(32))

    def _wake(self, gen: int) -> None:
        if gen == self._wake_gen:
            self.replan()

    def _batched_replan(self) -> None:
        self._batched = False
        self._replan_when_free()

    def replan(self) -> None:
        """An event: re-plan now, or once the controller may."""
        self._events_waiting += 1
        self._replan_when_free()

    def _replan_when_free(self) -> None:
        sim = self.sim
        if sim.now < self._replan_ok:
            if not self._batched:
                self._batched = True
                sim.at(self._replan_ok, self._batched_replan)
            return
        measured = sim.sc.decision_latency == "measured"
        timer = sim.timer or (time.perf_counter if measured else None)
        pending = len(self.state.pending)
        spent = 0.0
        # When each action was taken, into the decision: the controller sends
        # each as it is taken (`ControlState.decide`'s on_action).
        taken: list[float] = []
        if timer is not None:
            t0 = timer()

            def carried_out(action: Go | Drop) -> None:
                assert self._metrics is not None and self._wire is not None
                carry_out(action, sim.now, metrics=self._metrics, tau_max=self.state.tau_max,
                          version=self.state.version, send=self._wire.send,
                          log=_log_to_null)
                taken.append(timer() - t0)

            decisions = self.state.decide(sim.now, carried_out if measured else None)
            spent = timer() - t0
            sim.decision_seconds.append(spent)
            self.busy += spent
        else:
            decisions = self.state.decide(sim.now)
        sim.decision_pending.append(pending)
        sim.decision_events.append(self._events_waiting)
        self._events_waiting = 0
        busy = spent if measured else 0.0  # the controller is deciding until now + busy
        self._replan_ok = sim.now + max(sim.sc.replan_every, busy)
        for k, action in enumerate(decisions.actions):
            lat = (taken[k] if measured else 0.0) + sim.sc.message_latency
            t = action.transfer
            w = sim.workers[cast(int, t.owner)]  # (t.req names the part)
            if isinstance(action, Go):
                follow = None if action.after is None else (action.after, action.after_seconds)
                sim.after(lat, sim._go, w, t.req, action.pace, action.pace_seconds, t.id,
                          follow)
            else:
                assert isinstance(action, Drop)
                sim.after(lat, sim._outcome, w, t.req, False, None, action.reason, None)
        self._wake_gen += 1  # cancels the previous timer, as call_later's handle does
        if decisions.wake_at is not None:
            sim.at(max(sim.now + busy, decisions.wake_at), self._wake, self._wake_gen)


_null_log: DecisionFile | None = None


def _log_to_null(record: dict[str, Any]) -> None:
    """A decision's record logged as `--decision-log` does, to /dev/null."""
    global _null_log
    if _null_log is None:
        _null_log = DecisionFile(os.devnull)
    _null_log.write_line(json.dumps(record))


def simulate(scenario: Scenario, policy: str, *, timer: Callable[[], float] | None = None,
             audit: bool = False, progress: Callable[[float, int, int], None] | None = None,
             progress_every: int = 20000, sample_every: float | None = None) -> Result:
    """Run `scenario` under `policy` ("fifo" or "mlfabric") and return every push.

    `timer` (e.g. time.perf_counter) times each controller decision; `audit`
    checks every bandwidth allocation against the link capacities;
    `progress(now, pushes_done, pushes_total)` is called every
    `progress_every` events; with `sample_every` (simulated seconds) the
    result's `timeline` holds a `Sample` from 0 on at that interval (what
    showed a link idling while transfers waited: benchmarks/RESULTS.md, "A
    round of a wide downlink")."""
    if policy not in POLICIES:
        raise ConfigError(f"policy must be one of {POLICIES}, got {policy!r}")
    if sample_every is not None and not (sample_every > 0 and math.isfinite(sample_every)):
        raise ConfigError(f"sample_every must be > 0 simulated seconds, got {sample_every!r}")
    sim = _Sim(scenario, policy, timer=timer, audit=audit, progress=progress,
               progress_every=progress_every, sample_every=sample_every)
    sim.run()
    end = max((r.done for r in sim.records if r.done is not None), default=sim.now)
    return Result(policy, scenario, sim.records, end, sim.bytes_in, sim.decision_seconds,
                  sim.decision_pending, sim.decision_events, sim.net.max_utilization,
                  sim.events, [c.busy for c in sim.controllers], sim.held, sim.held_expired,
                  sim.timeline)


# --- command line ------------------------------------------------------------------------


def parse_change(spec: str) -> RateChange:
    """SECONDS:HOST=UP/DOWN (Mbit/s; '-' leaves a direction unchanged)."""
    try:
        at, rest = spec.split(":", 1)
        host, rates = rest.split("=", 1)
        parts = rates.split("/")
        if len(parts) > 2:
            raise ValueError(spec)
        up, down = parts[0], parts[1] if len(parts) == 2 else "-"
        return RateChange(float(at), host, None if up == "-" else float(up),
                          None if down == "-" else float(down))
    except ValueError:
        raise ConfigError(f"--change {spec!r}: expected SECONDS:HOST=UP/DOWN in Mbit/s, e.g. "
                          f"4:h0=-/50 (server downlink 50 Mbit/s from t=4 s)") from None


def scenario_from_args(args: argparse.Namespace, seed: int) -> Scenario:
    return Scenario(
        workers=args.workers, shards=args.shards, controllers=args.controllers,
        update_bytes=round(args.update_mib * MIB),
        steps=args.steps,
        compute=args.compute_ms / 1e3, jitter=args.jitter, max_in_flight=args.in_flight,
        tau_max=None if args.tau_max < 0 else args.tau_max,
        server_up_mbit=args.server_up_mbit, server_down_mbit=args.server_down_mbit,
        worker_up_mbit=args.worker_mbit, worker_down_mbit=args.worker_mbit,
        changes=tuple(parse_change(c) for c in args.change), goodput=args.goodput,
        slow_start=not args.no_slow_start, queue_delay=args.queue_ms / 1e3,
        message_latency=args.latency_ms / 1e3, start_delay=args.start_delay,
        start_spread=args.start_spread, stragglers=args.stragglers,
        straggler_factor=args.straggler_factor, seed=seed, idle_factor=args.idle_factor,
        controller_view=args.controller_view, replan_every=args.replan_every_ms / 1e3,
        decision_latency=args.decision_latency, landing_report=args.landing_report)


def add_controller_arguments(p: argparse.ArgumentParser) -> None:
    """What the simulated controller is told, how long its re-plans take and
    who tells it of a landing: `python -m mlfabric.sim`'s options and
    benchmarks/bench_sim.py's."""
    p.add_argument("--controller-view", choices=CONTROLLER_VIEWS, default="static",
                   help="static: the controller knows the configured rates (--link), not "
                        "their changes; live: it is told every change at once (ideal "
                        "agents)")
    p.add_argument("--decision-latency", choices=DECISION_LATENCIES, default="none",
                   help="none: a re-plan takes no simulated time; measured: the wall time "
                        "it took here, each directive carried out as the controller does "
                        "(counted, logged, encoded) and leaving as it is taken, and the "
                        "events meanwhile are answered together by the next one (as the "
                        "controller's are)")
    p.add_argument("--landing-report", choices=LANDING_REPORTS, default="worker",
                   help="who tells the controller a transfer landed: worker (after the "
                        "server's answer, as mlfabric does by default) or server (one "
                        "message sooner, as `mlfabric server --controller` does; the "
                        "worker's report then only times the transfer)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--shards", type=int, default=1,
                   help="server shards, on hosts s0..s{N-1} (1: one server, on h0); each "
                        "has the --server-*-mbit links and gets one part of every update")
    p.add_argument("--controllers", type=int, default=1,
                   help="controllers, 1..shards: controller c plans shards k with k mod "
                        "controllers = c, with its part of every worker uplink, and is busy "
                        "with its own re-plans")
    p.add_argument("--policy", choices=[*POLICIES, "both"], default="both")
    p.add_argument("--update-mib", type=float, default=2.0,
                   help="update (and model) size, over all shards")
    p.add_argument("--server-down-mbit", type=float, default=100.0, help="each server's")
    p.add_argument("--server-up-mbit", type=float, default=1000.0, help="each server's")
    p.add_argument("--worker-mbit", type=float, default=1000.0, help="workers' up and down")
    p.add_argument("--change", action="append", default=[], metavar="SECONDS:HOST=UP/DOWN",
                   help="a rate change, e.g. 4:h0=-/50 (repeat; '-' keeps a direction)")
    p.add_argument("--compute-ms", type=float, default=1200.0)
    p.add_argument("--jitter", type=float, default=0.2, help="relative compute-time jitter")
    p.add_argument("--steps", type=int, default=8, help="pushes per worker")
    p.add_argument("--in-flight", type=int, default=1, help="pushes outstanding per worker")
    p.add_argument("--tau-max", type=int, default=8, help="staleness bound; -1 for none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, default=1, help="runs with seeds seed, seed+1, ...")
    p.add_argument("--goodput", type=float, default=TCP_GOODPUT,
                   help="payload fraction of the wire rate (default: TCP, 1448/1514)")
    p.add_argument("--no-slow-start", action="store_true",
                   help="flows take their max-min share at once (no TCP ramp)")
    p.add_argument("--queue-ms", type=float, default=50.0,
                   help="round trip added by a saturated link's queue (testbed tbf: 50)")
    p.add_argument("--latency-ms", type=float, default=1.0,
                   help="one-way time of every small message")
    p.add_argument("--start-delay", type=float, default=0.0,
                   help="seconds from t=0 (rate changes) to the workers' start")
    p.add_argument("--start-spread", type=float, default=0.0,
                   help="workers start uniformly over this many seconds")
    p.add_argument("--stragglers", type=float, default=0.0, help="fraction of slow workers")
    p.add_argument("--straggler-factor", type=float, default=1.0)
    p.add_argument("--idle-factor", type=float, default=1.0)
    p.add_argument("--replan-every-ms", type=float, default=0.0,
                   help="re-plan at most this often (0: on every event, as the controller "
                        "does)")
    add_controller_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON summary per run")
    p.add_argument("--progress-every", type=int, default=20000, metavar="EVENTS",
                   help="a progress line on stderr every this many events")


def _row(s: dict[str, Any]) -> str:
    d, p = s["delay"], s["push_to_applied"]
    dm = (f"delay mean {d['mean']:6.2f} std {d['std']:6.2f} max {d['max']:5.0f}"
          if d["count"] else "delay -")
    pm = (f"push-to-applied mean {p['mean']:7.3f}s std {p['std']:7.3f}s" if p["count"]
          else "push-to-applied -")
    text = (f"{s['policy']:9s} pushes {s['pushes']:6d}  applied {s['applied']:6d}  "
            f"dropped {s['dropped']:5d}  {dm}  {pm}  "
            f"into server {s['bytes_into_server'] / MIB:9.1f} MiB  end {s['end']:7.2f}s")
    if "decision_seconds" in s:
        ds = s["decision_seconds"]
        text += f"  decide p50 {ds['p50'] * 1e3:.3f} ms p99 {ds['p99'] * 1e3:.3f} ms"
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlfabric.sim",
                                description="Simulate one job's transfers under fifo and "
                                            "mlfabric (flow-level, same controller code).")
    add_arguments(p)
    args = p.parse_args(argv)
    policies = list(POLICIES) if args.policy == "both" else [args.policy]
    memory.reuse_freed_blocks()  # as `mlfabric controller` runs its decisions

    def progress(now: float, done: int, total: int) -> None:
        print(f"  ... t={now:8.2f}s  {done}/{total} pushes done", file=sys.stderr, flush=True)

    try:
        scenarios = [scenario_from_args(args, args.seed + k) for k in range(max(1, args.seeds))]
        for sc in scenarios:
            for policy in policies:
                result = simulate(sc, policy, timer=time.perf_counter, progress=progress,
                                  progress_every=max(1, args.progress_every))
                s = result.summary()
                if args.json:
                    print(json.dumps({**s, "seed": sc.seed,
                                      "scenario": asdict(sc)}, default=str), flush=True)
                else:
                    print(f"seed {sc.seed}  {_row(s)}", flush=True)
    except ConfigError as exc:
        print(f"mlfabric.sim: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mlfabric.sim: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
