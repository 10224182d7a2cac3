"""Time to accuracy under multi-tenant contention, on the emulated cluster.

One scenario, several systems, the same namespaces: a server host, N worker
hosts with heterogeneous links, two hosts of other tenants whose traffic
starts, stops and moves during the run, and one compute straggler. Each
system trains the same model (the digits MLP of `mlfabric.tools.demo_model`, wide
enough to be a few MB) from the same initial weights until the held-out
accuracy reaches the target or the time limit passes:

* ``fifo``: the plain asynchronous parameter server (controller ``--policy
  fifo``: every update goes at once);
* ``mlfabric``: the controller's ordering with deadlines and drops, fed by
  agents on every host (the server's host included: it reports the other
  tenants' load on the server's downlink; every agent is told the server's
  port, ``--job-port``, so the job's own pushes do not count as load);
* ``mlfabric-agg``: ``mlfabric`` with aggregation: every worker host's agent
  is also an aggregator (``--aggregate``), and the controller routes groups
  of updates through them when that pays (docs/design.md, "Aggregation");
* ``mlfabric-agg-wait``: ``mlfabric-agg`` whose controller lets the server's
  downlink wait up to ``Scenario.group_wait`` for a group (``--group-wait``),
  so groups take nearly every worker (docs/design.md, "Aggregation");
* ``mlfabric-static``: the same policy without agents: the controller plans
  on the configured link capacities only (to see what the agents' picture
  adds or costs);
* ``mlfabric-agg-static``: ``mlfabric-agg`` planned on the configured
  capacities only (the agents run, as aggregators);
* ``mlfabric-agg-wait-late-pull``: ``mlfabric-agg-wait`` whose workers pull
  the next model only once their update's outcome is known, as ``fifo``'s
  do: the held pull the server streams is off (to measure what it adds);
* ``mlfabric-colocated``: ``mlfabric`` with the model partitioned over one
  server shard on every worker host (S = workers, as BytePS co-locates
  them): each link carries a share of the updates instead of the server
  host's downlink carrying them all;
* ``mlfabric-2shards``: ``mlfabric`` with two server shards on dedicated
  hosts (the server's host and a second one with the same link);
* ``mlfabric-colocated-agg``: ``mlfabric-colocated`` with aggregation as in
  ``mlfabric-agg``: each shard's parts are grouped on their own, and an
  aggregator sums one shard's parts and forwards them to that shard;
* ``mlfabric-colocated-agg-wait``: ``mlfabric-colocated-agg`` whose
  controller waits for groups as ``mlfabric-agg-wait``'s does;
* ``mlfabric-idle-off``: ``mlfabric`` whose controller never drops an update
  forced in at tau_max for idling the server (``--idle-factor off``): what
  the brief's idle rule gains or costs;
* ``mlfabric-adaptive``: ``mlfabric`` whose workers offer compressed forms
  of their updates (``compression="adaptive"``) and whose controller sends
  each whole unless it would drop it, then with the least compression that
  lets it go (issue 35);
* ``mlfabric-colocated-adaptive``: ``mlfabric-colocated`` whose workers
  offer compressed forms as ``mlfabric-adaptive``'s do;
* ``mlfabric-colocated-significance``: ``mlfabric-colocated`` whose workers
  hold a push until it is significant (``significance=SIGNIFICANCE``,
  Gaia's filter, issue 35);
* ``mlfabric-colocated-agg-adaptive``: ``mlfabric-colocated-agg`` whose
  workers offer compressed forms as ``mlfabric-adaptive``'s do: grouped
  updates go whole (with what waited in the residual), the others as the
  controller chooses;
* ``ddp``: synchronous data parallelism, PyTorch DistributedDataParallel over
  gloo, one rank per worker host (needs ``mlfabric[torch]``);
* ``ddp-powersgd``: ``ddp`` with PyTorch's PowerSGD communication hook
  (rank 4, error feedback and warm start, compressing from the second step):
  the peer with compression a user would pick (issue 35).

`run_system` runs one system once and returns a `RunResult`; the benchmark
(`benchmarks/contention.py`) and `mlfabric demo --contention` call it. Time 0
is when every worker is connected and holds the initial model (for ddp: when
the process group is formed), so process start-up is not counted. Accuracy is
measured on each new version of the server's model (pulled every
SAMPLE_EVERY seconds on the server's own host, so the pulls cross no link)
or, for ddp, by rank 0 on its replica of the model after every step.

Process entry points (run inside the namespaces): ``python -m
mlfabric.tools.contention ps-worker ...`` and ``... ddp-rank ...``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError
from .demo_model import accuracy, init_params, load_digits_split, loss_and_grads, shard
from .workload import scrape_metrics, serving_address, wait_for_line

SYSTEMS: tuple[str, ...] = ("fifo", "mlfabric", "mlfabric-agg", "mlfabric-agg-wait", "ddp",
                             "mlfabric-static", "mlfabric-agg-static",
                             "mlfabric-agg-wait-late-pull", "mlfabric-colocated",
                             "mlfabric-2shards", "mlfabric-colocated-agg",
                             "mlfabric-colocated-agg-wait", "mlfabric-idle-off",
                             "mlfabric-adaptive", "ddp-powersgd", "mlfabric-colocated-adaptive",
                             "mlfabric-colocated-significance", "mlfabric-colocated-agg-adaptive")
DDP_SYSTEMS = ("ddp", "ddp-powersgd")
POWERSGD_RANK = 4
# Sharded systems: where their shards run (see `shard_hosts`).
SHARDED = ("mlfabric-colocated", "mlfabric-2shards", "mlfabric-colocated-agg",
           "mlfabric-colocated-agg-wait", "mlfabric-colocated-adaptive",
           "mlfabric-colocated-significance", "mlfabric-colocated-agg-adaptive")
# mlfabric-colocated-significance's workers hold pushes smaller than this
# fraction of the model (Gaia's significance filter; Gaia used 0.01 to 0.05).
SIGNIFICANCE = 0.01


def aggregates(system: str) -> bool:
    """Whether `system` routes updates through aggregators."""
    return system.startswith(("mlfabric-agg", "mlfabric-colocated-agg"))
# This suffix: workers pull only once their update's outcome is known.
LATE_PULL = "-late-pull"
JOB = "contention"
CONTROLLER_PORT = 7071
AGENT_PORT = 7400
AGGREGATE_PORT = 7401
DDP_PORT = 29511
METRICS_PORT = 9109
AGENT_METRICS_PORT = 9110
# How often the server's model is pulled to measure its accuracy: about a
# third of a step, as DDP's rank 0 measures after every step.
SAMPLE_EVERY = 0.1


@dataclass(frozen=True)
class Scenario:
    """What every system faces. Rates are Mbit/s, (up, down)."""

    name: str = "contended"
    workers: int = 8
    hidden: int = 8192  # 64 -> 8192 -> 10: 614,410 float32 parameters, 2.46 MB
    batch: int = 32
    eta: float = 0.05  # parameter server: each push is -eta * grad
    gamma: float = 0.3  # server momentum
    tau_max: int = 8
    in_flight: int = 1  # pushes a PS worker may have outstanding (2: half are dropped stale)
    group_wait: float = 0.4  # mlfabric-agg-wait: the controller's --group-wait, seconds
    ddp_lr: float = 0.3  # ddp: SGD on the averaged gradient of workers * batch samples
    ddp_momentum: float = 0.3
    target: float = 0.90
    time_limit: float = 150.0
    server_link: tuple[float, float] = (1000.0, 100.0)
    worker_links: tuple[tuple[float, float], ...] = (
        (1000.0, 1000.0), (200.0, 200.0), (1000.0, 1000.0), (500.0, 500.0),
        (1000.0, 1000.0), (200.0, 200.0), (500.0, 500.0), (1000.0, 1000.0))
    straggler: int | None = 3  # worker index with slower compute
    straggler_factor: float = 3.0
    contention: bool = True
    # Where the other tenants' flows go: "server" loads the server host's
    # downlink and a few worker links in turn; "everywhere" also the second
    # server host's and more worker links at once (two of them at any time).
    tenants: str = "server"
    period: float = 30.0  # the cross-traffic pattern repeats with this period
    # Each tenant flow is paced at 60% of the link it loads, at most this. The
    # emulated network runs on the same CPU as the job: a 600 Mbit/s flow
    # between two namespaces takes 1.3 of this machine's 2 cores (60 Mbit/s:
    # 0.26), which would starve the job's processes and measure that instead
    # of the network. None: no bound (the scenario before 2026-11-23's last run).
    tenant_max_mbit: float | None = 150.0
    # Every link's MTU: jumbo frames, as in most training clusters (and AWS's
    # default inside a VPC). At 1500 the emulated network's per-packet work costs
    # this 2-core machine 5.3x the CPU per byte (benchmarks/bench_testbed_mtu.py),
    # which every system then pays in slower steps: a limit of the emulation, not
    # of the network modelled. 1500: the scenario before 2026-11-24.
    mtu: int = 9000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.workers < 2:
            raise ConfigError(f"a scenario needs at least 2 workers, got {self.workers}")
        if len(self.worker_links) < self.workers:
            raise ConfigError(f"worker_links lists {len(self.worker_links)} links for "
                              f"{self.workers} workers")
        if self.straggler is not None and not 0 <= self.straggler < self.workers:
            raise ConfigError(f"straggler must be a worker index below {self.workers}, "
                              f"got {self.straggler}")
        if isinstance(self.tau_max, bool) or not isinstance(self.tau_max, int) or self.tau_max < 1:
            raise ConfigError(f"tau_max must be a whole number of versions >= 1, got "
                              f"{self.tau_max!r}")
        if not 0 < self.target < 1:
            raise ConfigError(f"target accuracy must be between 0 and 1, got {self.target}")
        if not self.time_limit > 0:
            raise ConfigError(f"time_limit must be a positive number of seconds, got "
                              f"{self.time_limit}")
        if not 0 < self.group_wait < math.inf:
            raise ConfigError(f"group_wait must be a positive number of seconds, got "
                              f"{self.group_wait}")
        from .testbed import check_mtu

        check_mtu(self.mtu)
        if self.tenants not in ("server", "everywhere"):
            raise ConfigError(f"tenants must be 'server' or 'everywhere', got {self.tenants!r}")
        if self.tenant_max_mbit is not None and not self.tenant_max_mbit > 0:
            raise ConfigError(f"tenant_max_mbit must be a positive rate in Mbit/s (or None: "
                              f"no bound), got {self.tenant_max_mbit}")

    @property
    def model_bytes(self) -> int:
        return 4 * (64 * self.hidden + self.hidden + self.hidden * 10 + 10)

    def slowdown(self, worker: int) -> float:
        return self.straggler_factor if worker == self.straggler else 1.0


def uncontended(sc: Scenario) -> Scenario:
    """The same cluster without other tenants' traffic and without the straggler."""
    return replace(sc, name="uncontended", contention=False, straggler=None)


def contended_everywhere(sc: Scenario) -> Scenario:
    """The tenants load worker hosts' links as much as the server hosts'."""
    return replace(sc, name="contended-everywhere", tenants="everywhere")


# --- the other tenants' traffic (pure: a list of timed actions) ---------------------


@dataclass(frozen=True)
class Flow:
    """Another tenant's paced TCP flow from `src` to `dst` (host indices: 0 is the
    server's host, 1..N the workers, N+1 and N+2 the tenants' own hosts, N+3
    the second server host)."""

    start: float
    stop: float
    src: int
    dst: int
    rate_mbit: float


def tenant_flows(sc: Scenario) -> list[Flow]:
    """The cross-traffic pattern, repeated every `sc.period` seconds up to the
    time limit. Each third of a period loads other links: the server's
    downlink and one worker's, then two other workers' (one downlink, one
    uplink), then the server's again with a third worker's. Each flow is paced
    at 60% of the link it loads, so it takes a share without starving it, and
    at most `sc.tenant_max_mbit`."""
    if not sc.contention:
        return []
    n = sc.workers
    a, b = n + 1, n + 2
    third = sc.period / 3
    cap = sc.tenant_max_mbit if sc.tenant_max_mbit is not None else float("inf")
    rate = min(cap, 0.6 * sc.server_link[1])

    def worker(i: int) -> int:
        return 1 + (i % n)

    def down(i: int) -> float:
        return min(cap, 0.6 * sc.worker_links[(worker(i) - 1)][1])

    def up(i: int) -> float:
        return min(cap, 0.6 * sc.worker_links[(worker(i) - 1)][0])

    if sc.tenants == "server":
        pattern = [
            (0, a, 0, rate), (0, b, worker(2), down(2)),
            (1, a, worker(4), down(4)), (1, worker(1), b, up(1)),
            (2, a, 0, rate), (2, b, worker(6), down(6)),
        ]
    else:  # every third: a server host's downlink, a worker's downlink and another's uplink
        pattern = [
            (0, a, 0, rate), (0, b, worker(2), down(2)), (0, worker(5), b, up(5)),
            (1, a, n + 3, rate), (1, b, worker(4), down(4)), (1, worker(1), a, up(1)),
            (2, a, 0, rate), (2, b, worker(6), down(6)), (2, worker(3), b, up(3)),
        ]
    flows = []
    t = 0.0
    while t < sc.time_limit:
        for k, src, dst, r in pattern:
            start = t + k * third
            if start < sc.time_limit:
                flows.append(Flow(start, min(start + third, sc.time_limit), src, dst, r))
        t += sc.period
    return flows


# --- results ------------------------------------------------------------------------


@dataclass
class RunResult:
    system: str
    scenario: str
    reached: bool
    time_to_target: float | None  # seconds from time 0, None if not reached
    wall: float
    curve: list[tuple[float, float]] = field(default_factory=list)  # (seconds, accuracy)
    applied: int = 0
    dropped: int = 0
    held: int = 0  # pushes the significance filter kept with their worker
    delay_mean: float = 0.0
    delay_std: float = 0.0
    delay_max: int = 0
    server_bytes_in: float | None = None  # None for ddp: there is no server
    groups: int = 0  # aggregation groups the controller formed
    grouped: int = 0  # updates routed through an aggregator as members of those
    rescued: int = 0  # of those, updates the policy had dropped (--rescue-drops)
    drop_reasons: dict[str, int] = field(default_factory=dict)  # the controller's drops
    # Aggregation, mean seconds per group: measured by the aggregators (first
    # member in -> last member in; forward -> the server's answer) and as the
    # controller planned them (a member's go -> ready; ready -> delivered).
    gather_mean: float | None = None
    forward_mean: float | None = None
    planned_gather_mean: float | None = None
    planned_forward_mean: float | None = None
    # Workers offering compressed forms: each go's choice, (seconds from time
    # 0, codec or "whole"), from the decision log (issue 35).
    codecs: list[tuple[float, str]] = field(default_factory=list)
    # Mbit/s into the one server's host while another tenant's flow loads its
    # downlink, and while none does (`link_mbit`); None for systems whose
    # bytes reach it through aggregators or other shards' hosts.
    server_mbit_loaded: float | None = None
    server_mbit_free: float | None = None
    # ... and what the tenant's flows into it got meanwhile (paced at
    # Flow.rate_mbit), measured at their receiving end.
    tenant_mbit_server: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarise_outcomes(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    delays = np.array([r["delay"] for r in records if r["applied"]], dtype=float)
    # A push the significance filter held never left its worker: not a drop.
    held = sum(1 for r in records if not r["applied"]
               and (r.get("reason") or "").startswith("held:"))
    out = {
        "applied": int(delays.size),
        "dropped": sum(1 for r in records if not r["applied"]) - held,
        "delay_mean": float(delays.mean()) if delays.size else 0.0,
        "delay_std": float(delays.std()) if delays.size else 0.0,
        "delay_max": int(delays.max()) if delays.size else 0,
    }
    if held:
        out["held"] = held
    return out


def read_decisions(decision_log: Path, t0: float = 0.0) -> dict[str, Any]:
    """From a controller's decision log: the aggregation groups formed, their
    members, how many of those were rescued drops, the drops by reason, and
    each go's compressed form if its worker offered any (at seconds from
    `t0`, the run's time 0 on the controller's clock: both are the host's
    monotonic clock)."""
    out: dict[str, Any] = {"groups": 0, "grouped": 0, "rescued": 0, "drop_reasons": {},
                           "codecs": []}
    if not decision_log.exists():
        return out
    planned: dict[int, dict[str, Any]] = {}  # group by its first member, until that one's go
    gather, forward = [], []
    for line in decision_log.read_text().splitlines():
        event = json.loads(line)
        if event.get("event") == "group":
            out["groups"] += 1
            out["grouped"] += len(event["ids"])
            out["rescued"] += event.get("rescued", 0)
            planned[event["ids"][0]] = event
        elif event.get("event") == "go" and "via" in event and event["id"] in planned:
            g = planned.pop(event["id"])
            gather.append(g["ready"] - event["at"])
            forward.append(g["delivered"] - g["ready"])
        elif event.get("event") == "go" and "codec" in event:
            out["codecs"].append((round(event["at"] - t0, 6), event["codec"]))
        elif event.get("event") == "drop":
            reasons = out["drop_reasons"]
            reasons[event["reason"]] = reasons.get(event["reason"], 0) + 1
    if gather:
        out["planned_gather_mean"] = float(np.mean(gather))
        out["planned_forward_mean"] = float(np.mean(forward))
    return out


def transfer_spans(decision_log: Path, t0: float = 0.0) -> list[tuple[float, float, float]]:
    """(go, done, bytes) of every transfer a controller's decision log shows
    let go straight to its server and reported done, in seconds from `t0`
    (the run's time 0 on the controller's clock). Transfers through an
    aggregator are left out: their bytes cross the server's link in the
    aggregate, at other times."""
    if not decision_log.exists():
        return []
    gone: dict[int, tuple[float, float]] = {}
    spans = []
    for line in decision_log.read_text().splitlines():
        event = json.loads(line)
        kind = event.get("event")
        if kind == "go" and "via" not in event and "nbytes" in event:
            gone[event["id"]] = (event["at"] - t0, float(event["nbytes"]))
        elif kind == "done" and event.get("id") in gone:
            at, nbytes = gone.pop(event["id"])
            spans.append((at, event["at"] - t0, nbytes))
    return spans


def link_mbit(spans: Sequence[tuple[float, float, float]],
              loaded: Sequence[tuple[float, float]], end: float
              ) -> tuple[float | None, float | None]:
    """Mbit/s the job moved over a link during the parts of [0, end] inside
    the `loaded` intervals (another tenant's flow on it; they may overlap)
    and during the rest: each (go, done, bytes) span's bytes spread evenly
    over it, bytes outside [0, end] not counted. None for a part of no
    length. Why: on one link shared with a tenant's TCP flow, a job that
    sends one transfer at a time gets about half of it, and one that sends
    eight at once eight ninths; this shows which a run got."""
    merged: list[list[float]] = []
    for a, b in sorted((max(a, 0.0), min(b, end)) for a, b in loaded):
        if b <= a:
            continue
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    loaded_s = sum(b - a for a, b in merged)
    in_loaded = in_free = 0.0
    for go, done, nbytes in spans:
        if done <= go:
            continue
        inside = max(0.0, min(done, end) - max(go, 0.0))
        overlap = sum(max(0.0, min(done, b) - max(go, a)) for a, b in merged)
        in_loaded += nbytes * overlap / (done - go)
        in_free += nbytes * (inside - overlap) / (done - go)
    free_s = end - loaded_s

    def mbit(nbytes: float, seconds: float) -> float | None:
        return nbytes * 8 / seconds / 1e6 if seconds > 0 else None

    return mbit(in_loaded, loaded_s), mbit(in_free, free_s)


def samples_mbit(series: Sequence[Sequence[tuple[float, int]]], start: float, end: float
                 ) -> float | None:
    """Mbit/s over several flows' (time, bytes so far) samples, each counted
    between its first and last sample inside [start, end]: the bytes all
    of them moved there over the seconds they were measured. None if no
    flow has two samples there."""
    nbytes = seconds = 0.0
    for samples in series:
        inside = [(t, n) for t, n in samples if start <= t <= end]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            continue
        nbytes += inside[-1][1] - inside[0][1]
        seconds += inside[-1][0] - inside[0][0]
    return nbytes * 8 / seconds / 1e6 if seconds > 0 else None


def aggregator_seconds(samples: Sequence[dict[str, float]]) -> dict[str, float]:
    """Mean gather and forward seconds per group over the aggregators' metrics."""
    out = {}
    for part in ("gather", "forward"):
        count = sum(s.get(f"mlfabric_aggregator_{part}_seconds_count", 0.0) for s in samples)
        total = sum(s.get(f"mlfabric_aggregator_{part}_seconds_sum", 0.0) for s in samples)
        if count:
            out[f"{part}_mean"] = total / count
    return out


def first_reach(curve: Sequence[tuple[float, float]], target: float) -> float | None:
    return next((t for t, acc in curve if acc >= target), None)


# --- driving one system on a testbed ------------------------------------------------


def cluster_rates(sc: Scenario) -> dict[str, tuple[float | None, float | None]]:
    rates: dict[str, tuple[float | None, float | None]] = {"h0": sc.server_link}
    for i in range(sc.workers):
        rates[f"h{i + 1}"] = sc.worker_links[i]
    rates[f"h{sc.workers + 3}"] = sc.server_link  # the second server host
    return rates


def cluster_hosts(sc: Scenario) -> int:
    return sc.workers + 4  # server, workers, two tenants, a second server


def shard_hosts(sc: Scenario, system: str) -> list[int]:
    """The hosts (indices) of a system's servers, in shard order: one server
    on h0 unless sharded."""
    if system.startswith("mlfabric-colocated"):
        return list(range(1, sc.workers + 1))
    if system == "mlfabric-2shards":
        return [0, sc.workers + 3]
    return [0]


# One compute thread per process, as the DDP ranks have (torch.set_num_threads(1)).
# numpy's OpenBLAS otherwise starts a thread per core, which spins after every
# matrix product: measured in an uncontended mlfabric-agg run, the 8 workers
# took 0.89 of the machine's 2 cores with it and 0.41 without.
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _popen(tb: Any, host: Any, argv: list[str], tmp: Path, **kw: Any) -> subprocess.Popen[str]:
    env = {**ONE_THREAD, **os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)
    return tb.popen(host, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True, cwd=tmp, env=env, **kw)


def _go(procs: Sequence[subprocess.Popen[str]]) -> None:
    """Release workers waiting at their start line (they read 'go' on stdin)."""
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()


def _wait_go() -> None:
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("stdin closed before the start signal")


def _stop(procs: Sequence[subprocess.Popen[str]], sig: int = signal.SIGTERM,
          timeout: float = 20.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def _start_traffic(tb: Any, sc: Scenario) -> Any:
    from .testbed import StartTraffic, StopTraffic

    events: list[tuple[float, Any]] = []
    for k, f in enumerate(tenant_flows(sc)):
        key = f"flow{k}"
        events.append((f.start, StartTraffic(key, f"h{f.src}", f"h{f.dst}", f.rate_mbit)))
        events.append((f.stop, StopTraffic(key)))
    return tb.schedule(events) if events else None


def _stop_traffic(sched: Any) -> None:
    """Cancel what the schedule has not done yet and end the flows it started:
    a cancelled schedule leaves its traffic running, and the next run must
    start on quiet links."""
    if sched is None:
        return
    sched.cancel()
    for handle in list(sched.handles.values()):
        handle.stop()


def run_system(tb: Any, sc: Scenario, system: str, *, progress: Callable[[str], None] | None = None,
               keep: Path | None = None) -> RunResult:
    """Run `system` once on testbed `tb` (built with `cluster_hosts`/`cluster_rates`).
    With `keep`, the controller's decision log is copied there (to study a run)."""
    if system not in SYSTEMS:
        raise ConfigError(f"system must be one of {SYSTEMS}, got {system!r}")
    with tempfile.TemporaryDirectory(prefix="mlfabric-contention-") as d:
        tmp = Path(d)
        if system in DDP_SYSTEMS:
            return _run_ddp(tb, sc, tmp, progress, system)
        try:
            return _run_ps(tb, sc, system, tmp, progress)
        finally:
            if keep is not None and (tmp / "decisions.jsonl").exists():
                keep.mkdir(parents=True, exist_ok=True)
                shutil.copy(tmp / "decisions.jsonl",
                            keep / f"{sc.name}-{system}-seed{sc.seed}.decisions.jsonl")


def _write_common(tmp: Path, sc: Scenario) -> tuple[Path, Path]:
    from ..wire import auth
    from .token_cli import agent_secrets

    token = tmp / "job.token"
    token.write_text(auth.generate_token())
    token.chmod(0o600)
    agent_secrets(tmp, JOB)  # cluster.token, JOB.agent-key (_agent_flags)
    init = tmp / "init.npz"
    np.savez(init, **init_params(sc.hidden, seed=sc.seed))  # type: ignore[arg-type]
    return token, init


def _run_ps(tb: Any, sc: Scenario, system: str, tmp: Path,
            progress: Callable[[str], None] | None) -> RunResult:
    policy = "fifo" if system == "fifo" else "mlfabric"
    # A plain parameter server's worker pulls once its push is answered;
    # mlfabric's pulls with the push (pull(including=...)).
    pull = "after-outcome" if system == "fifo" or system.endswith(LATE_PULL) else "with-push"
    base = system.removesuffix(LATE_PULL)

    token, init = _write_common(tmp, sc)
    h0 = tb.host("h0")
    workers = [tb.host(f"h{i + 1}") for i in range(sc.workers)]
    servers = [tb.host(f"h{k}") for k in shard_hosts(sc, system)]
    py = [sys.executable, "-m", "mlfabric", "--log-level", "WARNING"]
    procs: list[subprocess.Popen[str]] = []
    helpers: list[subprocess.Popen[str]] = []
    sched = None
    try:
        for i, host in enumerate(servers):
            shard = ["--shard", f"{i}/{len(servers)}"] if len(servers) > 1 else []
            helpers.append(_popen(tb, host, [
                *py, "server", "--listen", f"{host.ip}:0", "--job", JOB, "--token-file",
                str(token), "--init", str(init), "--momentum", str(sc.gamma), "--tau-max",
                str(sc.tau_max), "--metrics-port", str(METRICS_PORT), "--metrics-host",
                "127.0.0.1", *shard], tmp))
        srv_addr = ",".join(serving_address(p, f"server {i}", timeout=90.0)
                            for i, p in enumerate(helpers))
        rates = cluster_rates(sc)
        links = []
        for host in dict.fromkeys([h0, *servers, *workers]):
            up, down = rates[host.name]
            links += ["--link", f"{host.ip}={up}/{down}"]
        agents: list[str] = []
        # the servers' traffic is the job's own: the agents do not count it as load
        job_port = [a for address in srv_addr.split(",")
                    for a in ("--job-port", address.rpartition(":")[2])]
        if base in ("mlfabric", "mlfabric-agg", "mlfabric-agg-wait", "mlfabric-agg-static",
                    "mlfabric-idle-off", "mlfabric-adaptive", *SHARDED):
            measured = base != "mlfabric-agg-static"  # the controller reads the agents
            # Each worker host's agent measures the paths to the server hosts, and
            # each server host's agent (a worker's too, when co-located) the paths
            # from the workers: together, others' load on every link the job uses.
            for host in dict.fromkeys([*workers, *servers]):
                peer_hosts = [p for p in workers if p is not host] if host in servers \
                    else servers
                peers = [a for p in peer_hosts for a in ("--peer", f"{p.ip}={p.ip}:{AGENT_PORT}")]
                aggregate = []
                if aggregates(base) and host in workers:
                    aggregate = ["--aggregate", f"{host.ip}:{AGGREGATE_PORT}", "--job", JOB,
                                 "--token-file", str(token), "--servers", srv_addr,
                                 "--metrics-port",
                                 str(AGENT_METRICS_PORT), "--metrics-host", host.ip]
                    agents += ["--aggregator", f"{host.ip}={host.ip}:{AGGREGATE_PORT}"]
                helpers.append(_popen(tb, host, [*py, "agent", "--name", host.ip, "--listen",
                                                 f"{host.ip}:{AGENT_PORT}", *job_port, *peers,
                                                 "--cluster-token-file",
                                                 str(tmp / "cluster.token"), *aggregate], tmp))
                if measured:
                    agents += ["--agent", f"{host.ip}={host.ip}:{AGENT_PORT}"]
            if measured:
                agents += ["--agent-key-file", str(tmp / f"{JOB}.agent-key")]
        # A group of every worker is full: it goes without waiting out the rest.
        wait = (["--group-wait", str(sc.group_wait), "--max-fan-in", str(sc.workers)]
                if base.endswith("-agg-wait") else [])
        ctl = _popen(tb, h0, [*py, "controller", "--listen", f"{h0.ip}:{CONTROLLER_PORT}",
                              "--job", JOB, "--token-file", str(token), "--tau-max",
                              str(sc.tau_max), "--policy", policy, "--decision-log",
                              str(tmp / "decisions.jsonl"), *links, *agents, *wait,
                              *(["--idle-factor", "off"] if base == "mlfabric-idle-off"
                                else [])], tmp)
        helpers.append(ctl)
        ctl_addr = serving_address(ctl, "the controller", timeout=90.0)
        for i, w in enumerate(workers):
            # With agents, each client reports its finished transfers to its host's
            # agent (passive samples of what the path delivers to the job).
            report = (["--agent", f"{w.ip}:{AGENT_PORT}", "--agent-key-file",
                       str(tmp / f"{JOB}.agent-key")] if agents else [])
            procs.append(_popen(tb, w, [
                sys.executable, "-m", "mlfabric.tools.contention", "ps-worker", *report,
                "--server", srv_addr,
                "--controller", ctl_addr, "--token-file", str(token), "--host", w.ip,
                "--index", str(i), "--workers", str(sc.workers), "--hidden", str(sc.hidden),
                "--batch", str(sc.batch), "--eta", str(sc.eta), "--in-flight",
                str(sc.in_flight), "--pull", pull, "--slowdown", str(sc.slowdown(i)),
                "--seed", str(sc.seed),
                *(["--compression", "adaptive"] if base.endswith("-adaptive") else []),
                *(["--significance", str(SIGNIFICANCE)] if base.endswith("-significance")
                  else [])],
                tmp))
        for i, p in enumerate(procs):
            wait_for_line(p, "ready", f"worker {i}", timeout=90.0)
        _, _, x_test, y_test = load_digits_split(seed=sc.seed)
        monitor = _Monitor(servers, srv_addr.split(","), token)
        try:
            sched = _start_traffic(tb, sc)
            t0 = time.monotonic()
            _go(procs)
            if progress is not None:
                progress(f"{system:8s} started")
            curve = _watch_server(monitor, sc, t0, progress, f"{system:8s}", x_test, y_test)
            wall = time.monotonic() - t0
        finally:
            monitor.close()
        _stop(procs, timeout=45.0)
        records: list[dict[str, Any]] = []
        for i, p in enumerate(procs):
            out = p.stdout.read() if p.stdout else ""
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]
            if p.returncode != 0 or not lines:
                err = p.stderr.read() if p.stderr else ""
                raise RuntimeError(f"worker {i} failed ({p.returncode}): {err[-1500:]}")
            records += json.loads(lines[-1])["outcomes"]
        counted = [_server_bytes_in(host) for host in servers]
        bytes_in = None if None in counted else sum(c for c in counted if c is not None)
        decisions = read_decisions(tmp / "decisions.jsonl", t0)
        if shard_hosts(sc, system) == [0] and not aggregates(base):
            # The tenant's flows into the server's host, by their schedule key.
            into = {f"flow{k}": f for k, f in enumerate(tenant_flows(sc)) if f.dst == 0}
            decisions["server_mbit_loaded"], decisions["server_mbit_free"] = link_mbit(
                transfer_spans(tmp / "decisions.jsonl", t0),
                [(f.start, f.stop) for f in into.values()], wall)
            if sched is not None:
                decisions["tenant_mbit_server"] = samples_mbit(
                    [[(x.time, x.total) for x in h.received_samples]
                     for key, h in sched.handles.items() if key in into], t0, t0 + wall)
        if aggregates(base):
            decisions.update(aggregator_seconds(
                [scrape_metrics(w, AGENT_METRICS_PORT) for w in workers]))
    finally:
        _stop_traffic(sched)
        _stop(procs)
        _stop(helpers)
    return RunResult(system=system, scenario=sc.name,
                     reached=first_reach(curve, sc.target) is not None,
                     time_to_target=first_reach(curve, sc.target), wall=wall, curve=curve,
                     server_bytes_in=bytes_in, **decisions, **summarise_outcomes(records))


class _Monitor:
    """Pulls the servers' model for the accuracy curve, each shard's part on
    that shard's own host (its connection made inside the host's namespace,
    so the pulls cross no link): one link of its own per shard, each on an
    event loop thread started inside that host."""

    def __init__(self, hosts: Sequence[Any], addresses: Sequence[str], token: Path) -> None:
        from ..client import aio
        from ..client.core import resolve_token
        from ..client.shards import check_shards
        from ..runtime.loop_thread import LoopThread

        secret = resolve_token(None, str(token))
        self._runners: list[LoopThread] = []
        self._clients: list[Any] = []
        try:
            for host, address in zip(hosts, addresses, strict=True):
                with host.enter():  # the loop thread, and so its sockets, live there
                    runner = LoopThread(name=f"monitor-{host.name}")
                self._runners.append(runner)
                self._clients.append(runner.run(aio.connect(address, job=JOB, token=secret,
                                                            name="contention-monitor",
                                                            push_timeout=None)))
            self.partition = check_shards(
                list(addresses), [c.welcome_shard for c in self._clients],
                [c.specs for c in self._clients])
        except BaseException:
            self.close()
            raise

    def pull(self) -> tuple[Any, dict[str, np.ndarray]]:
        answers = [r.run(c.pull(), 60.0) for r, c in zip(self._runners, self._clients,
                                                          strict=True)]
        if self.partition is None:
            return answers[0]
        return (tuple(v for v, _ in answers), self.partition.join([p for _, p in answers]))

    def close(self) -> None:
        for r, c in zip(self._runners, self._clients, strict=False):
            r.run(c.close(), 10.0)
        for r in self._runners:
            r.stop()


def _watch_server(ps: Any, sc: Scenario, t0: float, progress: Callable[[str], None] | None,
                  label: str, x_test: np.ndarray, y_test: np.ndarray
                  ) -> list[tuple[float, float]]:
    """Pull the server's model every SAMPLE_EVERY seconds and measure the
    held-out accuracy of each new version, until the target or the time
    limit. A point's time is when its pull returned: the model existed then."""
    curve: list[tuple[float, float]] = []
    seen = None
    while True:
        version, params = ps.pull()
        t = time.monotonic() - t0
        if version != seen:
            seen = version
            acc = accuracy(params, x_test, y_test)
            curve.append((round(t, 3), acc))
            if progress is not None:
                progress(f"{label} {t:6.1f} s  held-out accuracy {acc:.3f} (target {sc.target})")
            if acc >= sc.target:
                return curve
        if t >= sc.time_limit:
            return curve
        time.sleep(max(0.0, SAMPLE_EVERY - (time.monotonic() - t0 - t)))  # a period, not a sync


def _server_bytes_in(h0: Any) -> float | None:
    with h0.enter():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics",
                                        timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return None
    for line in text.splitlines():
        if line.startswith("mlfabric_server_received_bytes_total"):
            return float(line.split()[-1])
    return None


def _run_ddp(tb: Any, sc: Scenario, tmp: Path, progress: Callable[[str], None] | None,
             system: str = "ddp") -> RunResult:
    _, init = _write_common(tmp, sc)
    workers = [tb.host(f"h{i + 1}") for i in range(sc.workers)]
    master = workers[0]
    procs: list[subprocess.Popen[str]] = []
    sched = None
    try:
        for i, w in enumerate(workers):
            procs.append(_popen(tb, w, [
                sys.executable, "-m", "mlfabric.tools.contention", "ddp-rank", "--rank", str(i),
                "--workers", str(sc.workers), "--master", f"{master.ip}:{DDP_PORT}",
                "--ifname", w.ifname, "--init", str(init), "--hidden", str(sc.hidden),
                "--batch", str(sc.batch), "--lr", str(sc.ddp_lr), "--momentum",
                str(sc.ddp_momentum), "--slowdown", str(sc.slowdown(i)), "--seed",
                str(sc.seed), "--target", str(sc.target), "--time-limit", str(sc.time_limit),
                *(["--powersgd", str(POWERSGD_RANK)] if system == "ddp-powersgd" else [])],
                tmp))
        for i, p in enumerate(procs):
            wait_for_line(p, "ready", f"ddp rank {i}", timeout=180)
        _go(procs)
        sched = _start_traffic(tb, sc)  # rank 0 starts its clock at the first step's barrier
        curve: list[tuple[float, float]] = []
        assert procs[0].stdout is not None
        for line in procs[0].stdout:
            if line.startswith("acc "):
                _, t, acc = line.split()
                curve.append((float(t), float(acc)))
                if progress is not None:
                    progress(f"{system:8s} {float(t):6.1f} s  held-out accuracy "
                             f"{float(acc):.3f} (target {sc.target})")
            elif line.startswith("end "):
                wall = float(line.split()[1])
                break
        else:
            _stop(procs)
            errs = [f"rank {i} (exit {p.returncode}): "
                    f"{(p.stderr.read() if p.stderr else '')[-800:]}" for i, p in enumerate(procs)]
            raise RuntimeError("ddp rank 0 ended without a result: " + " | ".join(errs))
        for i, p in enumerate(procs):
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"ddp rank {i} did not stop") from None
    finally:
        _stop_traffic(sched)
        _stop(procs)
    reach = first_reach(curve, sc.target)
    return RunResult(system=system, scenario=sc.name, reached=reach is not None,
                     time_to_target=reach, wall=wall, curve=curve)


# --- the processes ------------------------------------------------------------------


def _compute_seconds(fn: Callable[[], Any]) -> float:
    """Median time of one minibatch's gradient here (for the straggler's extra time)."""
    times = []
    for _ in range(5):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


class _Straggler:
    """Wraps a client: every push waits (factor - 1) x the compute time first."""

    def __init__(self, ps: Any, extra: float) -> None:
        self.ps, self.extra = ps, extra

    def pull(self, timeout: float | None = None, *, including: Any = None) -> Any:
        return self.ps.pull(timeout, including=including)

    def push(self, update: Any, base_version: int) -> Any:
        if self.extra > 0:
            time.sleep(self.extra)  # emulated slow compute
        return self.ps.push(update, base_version=base_version)


def ps_worker(args: argparse.Namespace) -> int:
    import mlfabric

    from .demo_model import train_worker

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    x_train, y_train, _, _ = load_digits_split(seed=args.seed)
    x, y = shard(x_train, y_train, args.workers, args.index)
    outcomes: list[dict[str, Any]] = []

    def record(o: Any) -> None:
        outcomes.append({"t": time.monotonic(), "applied": bool(o.applied),
                         "delay": int(o.delay if o.delay is not None else -1),
                         "reason": o.reason})

    with mlfabric.connect(args.server, job=JOB, token_file=args.token_file,
                          controller=args.controller, host=args.host, agent=args.agent,
                          agent_key_file=args.agent_key_file,
                          compression=args.compression,
                          significance=args.significance) as ps:
        _, params = ps.pull()
        idx = np.arange(min(args.batch, len(x)))
        extra = (args.slowdown - 1) * _compute_seconds(
            lambda: loss_and_grads(params, x[idx], y[idx]))
        print("ready", flush=True)
        _wait_go()
        unresolved = 0
        try:
            train_worker(_Straggler(ps, extra), x, y, steps=10**9, batch_size=args.batch,
                         eta=args.eta, seed=args.seed * 100 + args.index, on_outcome=record,
                         stop=stop, max_in_flight=args.in_flight, timeout=15.0,
                         pull_with_push=args.pull == "with-push")
        except TimeoutError:
            unresolved = 1  # a push still without its outcome when the run ended
    print(json.dumps({"outcomes": outcomes, "unresolved": unresolved}), flush=True)
    return 0


def ddp_rank(args: argparse.Namespace) -> int:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = args.ifname
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=args.rank,
                            world_size=args.workers, timeout=datetime.timedelta(seconds=180))
    x_train, y_train, x_test, y_test = load_digits_split(seed=args.seed)
    x_np, y_np = shard(x_train, y_train, args.workers, args.rank)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    init = np.load(args.init)
    first, second = torch.nn.Linear(64, args.hidden), torch.nn.Linear(args.hidden, 10)
    with torch.no_grad():  # the same initial weights as the parameter server's
        first.weight.copy_(torch.from_numpy(init["w1"].T.copy()))
        first.bias.copy_(torch.from_numpy(init["b1"]))
        second.weight.copy_(torch.from_numpy(init["w2"].T.copy()))
        second.bias.copy_(torch.from_numpy(init["b2"]))
    model = torch.nn.Sequential(first, torch.nn.Tanh(), second)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if args.powersgd:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        # From the second step (PowerSGD's error feedback and warm start need
        # one plain step first; its default waits 1,000), as its paper tunes it.
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=args.powersgd,
            start_powerSGD_iter=2, use_error_feedback=True, warm_start=True,
            random_seed=args.seed)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)
    loss_fn = torch.nn.CrossEntropyLoss()
    rng = np.random.default_rng(args.seed * 100 + args.rank)

    def local_grad() -> None:
        idx = torch.from_numpy(rng.integers(0, len(x), args.batch))
        loss_fn(model(x[idx]), y[idx]).backward()
        model.zero_grad()

    extra = (args.slowdown - 1) * _compute_seconds(local_grad)
    xt, yt = torch.from_numpy(x_test), torch.from_numpy(y_test)
    print("ready", flush=True)
    _wait_go()
    dist.barrier()
    t0 = time.monotonic()
    flag = torch.zeros(1)
    step = 0
    while True:
        if extra > 0:
            time.sleep(extra)  # emulated slow compute
        idx = torch.from_numpy(rng.integers(0, len(x), args.batch))
        opt.zero_grad()
        loss_fn(ddp(x[idx]), y[idx]).backward()  # DDP all-reduces the gradients here
        opt.step()
        step += 1
        if args.rank == 0:
            t = time.monotonic() - t0
            with torch.no_grad():
                acc = float((model(xt).argmax(1) == yt).float().mean())
            print(f"acc {t:.3f} {acc:.6f}", flush=True)
            flag[0] = 1.0 if acc >= args.target or t >= args.time_limit else 0.0
        dist.broadcast(flag, 0)
        if flag[0] > 0:
            break
    if args.rank == 0:
        print(f"end {time.monotonic() - t0:.3f} {step}", flush=True)
    dist.destroy_process_group()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlfabric.contention",
                                description="processes of the contention benchmark")
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("ps-worker")
    w.add_argument("--server", required=True)
    w.add_argument("--controller", default=None)
    w.add_argument("--token-file", required=True)
    w.add_argument("--host", default=None)
    w.add_argument("--agent", default=None, help="this host's agent, for transfer reports")
    w.add_argument("--agent-key-file", default=None, help="the job's agent key (with --agent)")
    w.add_argument("--compression", default=None, help="as mlfabric.connect's (issue 35)")
    w.add_argument("--significance", type=float, default=None,
                   help="as mlfabric.connect's (issue 35)")
    w.add_argument("--index", type=int, required=True)
    w.add_argument("--in-flight", type=int, default=2)
    w.add_argument("--pull", choices=["with-push", "after-outcome"], default="with-push",
                   help="with-push: pull(including=push), the server may stream the model; "
                        "after-outcome: pull once the push is answered")
    w.add_argument("--eta", type=float, required=True)
    r = sub.add_parser("ddp-rank")
    r.add_argument("--powersgd", type=int, default=0, metavar="RANK",
                   help="register PyTorch's PowerSGD hook of this rank (0: plain DDP)")
    r.add_argument("--rank", type=int, required=True)
    r.add_argument("--master", required=True)
    r.add_argument("--ifname", required=True)
    r.add_argument("--init", required=True)
    r.add_argument("--lr", type=float, required=True)
    r.add_argument("--momentum", type=float, default=0.0)
    r.add_argument("--target", type=float, required=True)
    r.add_argument("--time-limit", type=float, required=True)
    for q in (w, r):
        q.add_argument("--workers", type=int, required=True)
        q.add_argument("--hidden", type=int, required=True)
        q.add_argument("--batch", type=int, default=32)
        q.add_argument("--slowdown", type=float, default=1.0)
        q.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    return ps_worker(args) if args.cmd == "ps-worker" else ddp_rank(args)


if __name__ == "__main__":
    sys.exit(main())


# --- `mlfabric demo --contention` -----------------------------------------------------


def demo_scenario(time_limit: float = 60.0) -> Scenario:
    """The small scale a new user runs: 4 workers, a 1.2 MB model, one round."""
    return Scenario(name="contended (demo)", workers=4, hidden=4096, eta=0.05, target=0.90,
                    time_limit=time_limit,
                    worker_links=((1000.0, 1000.0), (200.0, 200.0), (1000.0, 1000.0),
                                  (500.0, 500.0)),
                    straggler=3, server_link=(1000.0, 100.0))


def run_demo(systems: Sequence[str] = ("fifo", "mlfabric", "mlfabric-agg", "mlfabric-agg-wait"),
             time_limit: float = 60.0,
             out: Any = sys.stdout) -> list[RunResult]:
    """Run each system once on a fresh emulated cluster and print a comparison."""
    from .testbed import Testbed, require_root

    if os.geteuid() != 0:
        raise ConfigError(
            "mlfabric demo --contention needs root: it builds an emulated cluster of network "
            "namespaces joined by tc-shaped veth links, with other tenants' traffic; run it "
            "as root (sudo mlfabric demo --contention); `mlfabric demo` needs no root")
    require_root()
    sc = demo_scenario(time_limit)
    print(f"mlfabric demo --contention: {sc.workers} workers train a {sc.model_bytes / 1e6:.1f} "
          f"MB MLP to {sc.target} held-out accuracy on an emulated cluster: the server's "
          f"downlink {sc.server_link[1]:g} Mbit/s, workers on 200-1000 Mbit/s links (MTU "
          f"{sc.mtu}), other "
          f"tenants' traffic moving every {sc.period / 3:g} s, worker {sc.straggler} computing "
          f"{sc.straggler_factor:g}x slower. Systems: {', '.join(systems)}.", file=out,
          flush=True)
    results = []
    with Testbed(hosts=cluster_hosts(sc), rate_mbit=1000.0, rates=cluster_rates(sc),
                 mtu=sc.mtu) as tb:
        for system in systems:
            def show(msg: str) -> None:
                print(f"\r  {msg}", end="", file=out, flush=True)

            results.append(run_system(tb, sc, system, progress=show))
            print(file=out)
    print(file=out)
    print(format_results(sc, results), file=out, flush=True)
    return results


def format_results(sc: Scenario, results: Sequence[RunResult]) -> str:
    w = max([len("system"), *(len(r.system) for r in results)])
    lines = [f"  {'system':{w}s} {'time to ' + str(sc.target):>16s} {'delay mean':>10s} "
             f"{'std':>5s} {'max':>4s} {'applied':>8s} {'dropped':>8s} {'server MB in':>13s}"]
    for r in results:
        t = f"{r.time_to_target:.1f} s" if r.time_to_target is not None else (
            f"> {sc.time_limit:.0f} s")
        if r.system in DDP_SYSTEMS:
            lines.append(f"  {r.system:{w}s} {t:>16s}")
            continue
        mb = f"{r.server_bytes_in / 1e6:.0f}" if r.server_bytes_in is not None else "?"
        lines.append(f"  {r.system:{w}s} {t:>16s} {r.delay_mean:10.2f} {r.delay_std:5.2f} "
                     f"{r.delay_max:4d} {r.applied:8d} {r.dropped:8d} {mb:>13s}")
    return "\n".join(lines)
