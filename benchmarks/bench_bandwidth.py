"""Benchmark the bandwidth agents on the emulated cluster: error, reaction time, cost.

Each scenario builds a 3-host testbed (mlfabric.tools.testbed, tbf-shaped links),
starts one agent process per host and polls all six path estimates every
50 ms. Per scenario, in one run, it reports

* **error**: median over the steady-state polls and the paths of
  |estimate - truth| / truth, against the physical truth: the shaped rate less
  header overhead (datagram payload, 1472 of 1514 bytes per frame), or, with
  cross traffic, the remainder after the cross flow's measured wire rate;
* **reaction**: seconds until every affected path is within 10% (15% with
  cross traffic) of the new truth: after the agents are ready, after a rate
  change, after the cross flow starts;
* **overhead**: the busiest NIC's bytes (probes, reports, acks) in a 4 s
  steady-state window, as a fraction of its rate (the budget is 2%); with
  --steady S, the worst 4 s window of S seconds (NIC counters read every 0.1 s);
* **re-probes**: trains that found no queue ("unqueued", "escalate" in
  mlfabric_agent_probe_trains_total) per 100 trains, over the whole run: each
  costs the budget a quick train, an escalation one sized for a 4x faster path;

and, for the static rates, the tool a user would pick instead: a bulk TCP
test (iperf-like, 1 s) from h0 to h1, with its error against the TCP goodput
of the link and its cost (the whole link for a second). Medians over --runs.

The "shapers" scenario is issue 32's accuracy matrix: an asymmetric 5-host
cluster (ASYMMETRIC: up and down rates differ per host, so a path's
bottleneck is the sender's uplink or the receiver's downlink), every agent
probing every other, each directed pair's estimate read once a second for
--seconds (60) after a settling time, under each shaper: token buckets of
1 ms at the rate, 64 KB and 10 ms at the rate (each with a 50 ms queue),
and 1 ms buckets with a TCP flow of other traffic taking half of h0's
300 Mbit/s downlink (the truth for paths into h0 is then the smaller of the
path's rate and what the flow leaves). Per case: the median, p90 and
largest |estimate - truth| / truth over every pair-sample (a stale
estimate counts as an error of 100%), and the share of samples off by more
than 25%; medians over --runs. Goal: median <= 5%, p90 <= 10%, none > 25%
(within 15% with cross traffic). The case "job bulk h1 -> h0" runs the
job's own bulk TCP flow from h1 (80 Mbit/s uplink) into h0, started before
the agents, which know its port (--job-port): the job's traffic is not
load, so the truth is the idle cluster's, and its overhead counts the
agents' probe bytes only (goal: 1% of each link while the job transfers).

    sudo python benchmarks/bench_bandwidth.py                # 3 runs, ~3 minutes
    sudo python benchmarks/bench_bandwidth.py --runs 5 --rates 50 100 200 400
    sudo python benchmarks/bench_bandwidth.py --runs 9 --scenarios change
    sudo python benchmarks/bench_bandwidth.py --runs 5 --rates 50 --scenarios static --steady 30
    sudo python benchmarks/bench_bandwidth.py --runs 3 --scenarios shapers [--seconds 60]
"""

from __future__ import annotations

import argparse
import os
import platform
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlfabric.agent.daemon import query_estimates, read_net_dev  # noqa: E402
from mlfabric.tools import traffic  # noqa: E402
from mlfabric.tools.testbed import Testbed, require_root  # noqa: E402
from mlfabric.tools.token_cli import agent_secrets  # noqa: E402
from mlfabric.tools.workload import scrape_metrics  # noqa: E402
from mlfabric.wire import auth  # noqa: E402
from mlfabric.wire.agent_auth import cluster_credential  # noqa: E402

# issue 32's asymmetric cluster: (uplink, downlink) Mbit/s per host
ASYMMETRIC = {"h0": (300.0, 300.0), "h1": (80.0, 300.0), "h2": (200.0, 100.0),
              "h3": (120.0, 240.0), "h4": (60.0, 150.0)}
SHAPERS = ("burst 1ms", "burst 64KB", "burst 10ms", "cross tcp 50% into h0",
           "cross udp 50% into h0", "job bulk h1 -> h0")
PORT = 7400
METRICS_PORT = 9470
WINDOW = 4.0  # seconds over which the probe overhead is judged
PAYLOAD = 1472 / 1514
TCP_PAYLOAD = 1448 / 1514
POLL = 0.05
Truth = Callable[[str, str], float]


class Cluster:
    def __init__(self, tb: Testbed) -> None:
        self.tb = tb
        self.procs: list[subprocess.Popen[str]] = []
        self.cleanups: list[Callable[[], None]] = []

    def start(self, *extra: str) -> float:
        self.launched = time.monotonic()
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        secrets = Path(tempfile.mkdtemp(prefix="bench-bandwidth-"))
        self.cleanups.append(lambda: shutil.rmtree(secrets, ignore_errors=True))
        cluster_token, _ = agent_secrets(secrets, "bench")
        self.cluster = cluster_credential(auth.load_token(cluster_token))
        for h in self.tb.hosts:
            peers = [f"--peer={p.name}={p.ip}:{PORT}" for p in self.tb.hosts if p is not h]
            argv = [sys.executable, "-m", "mlfabric", "--log-level", "WARNING", "agent",
                    "--name", h.name, "--listen", f"{h.ip}:{PORT}", *peers,
                    "--cluster-token-file", str(cluster_token),
                    "--metrics-port", str(METRICS_PORT), "--metrics-host", h.ip, *extra]
            self.procs.append(self.tb.popen(h, argv, stdout=subprocess.PIPE, text=True, env=env))
        for p in self.procs:
            assert p.stdout is not None
            ready, _, _ = select.select([p.stdout], [], [], 15)
            assert ready and "ready" in p.stdout.readline(), "agent did not start"
        return time.monotonic()

    def estimates(self) -> dict[tuple[str, str], float]:
        out = {}
        for h in self.tb.hosts:
            with h.enter():
                est = query_estimates(h.ip, PORT, self.cluster, timeout=2)
            for e in est.estimates:
                out[(h.name, e.peer)] = float("nan") if e.stale else e.bandwidth_bps
        return out

    def errors(self, truth: Truth, pairs) -> list[float]:
        ests = self.estimates()
        return [abs(ests[p] - truth(*p)) / truth(*p) for p in pairs]

    def reaction(self, truth: Truth, pairs, tol: float, timeout: float = 10.0) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            errs = self.errors(truth, pairs)
            if all(e <= tol for e in errs):  # NaN (stale) compares False
                return time.monotonic() - t0
            time.sleep(POLL)
        return float("inf")

    def steady_error(self, truth: Truth, pairs, seconds: float = 2.0) -> float:
        errs: list[float] = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            errs += self.errors(truth, pairs)
            time.sleep(POLL)
        return statistics.median(errs)

    def counters(self) -> dict[str, tuple[int, int]]:
        """Every host's NIC (rx, tx) byte counters now."""
        out = {}
        for h in self.tb.hosts:
            with h.enter():
                got = read_net_dev(h.ifname)
            assert got is not None
            out[h.name] = got
        return out

    def overhead(self, rate: float, seconds: float = WINDOW) -> float:
        """The busiest NIC direction's rate over the worst WINDOW s of `seconds` (>= WINDOW)."""
        readings = [(time.monotonic(), self.counters())]
        while readings[-1][0] - readings[0][0] < seconds:
            time.sleep(0.1)
            readings.append((time.monotonic(), self.counters()))
        worst = 0.0
        for i, (t0, before) in enumerate(readings):
            # the first reading at least WINDOW s later closes this window
            closing = next((r for r in readings[i:] if r[0] - t0 >= WINDOW), None)
            if closing is None:
                break
            t1, after = closing
            for name, (rx0, tx0) in before.items():
                rx1, tx1 = after[name]
                worst = max(worst, (rx1 - rx0) * 8 / (t1 - t0), (tx1 - tx0) * 8 / (t1 - t0))
        return worst / (rate * 1e6)

    def overhead_per_link(self, rates: dict[str, tuple[float, float]],
                          seconds: float = WINDOW) -> float:
        """The largest share of its own link's rate that any host's uplink or
        downlink carried over `seconds` (probes, reports and acks, with no job
        traffic; cross traffic, if any, is excluded by the caller's choice of
        window: run it without)."""
        t0, before = time.monotonic(), self.counters()
        time.sleep(seconds)
        t1, after = time.monotonic(), self.counters()
        worst = 0.0
        for name, (rx0, tx0) in before.items():
            rx1, tx1 = after[name]
            up, down = rates[name]
            worst = max(worst, (tx1 - tx0) * 8 / (t1 - t0) / (up * 1e6),
                        (rx1 - rx0) * 8 / (t1 - t0) / (down * 1e6))
        return worst

    def probes_per_link(self, rates: dict[str, tuple[float, float]],
                        seconds: float) -> dict[tuple[str, str], float]:
        """Like `overhead_per_link`, counting only probe datagrams (the
        agents' own counters, per peer), for a window with the job's traffic
        on the links: the share of each link ("up" or "down", host)."""
        def sent() -> dict[tuple[str, str], float]:
            out = {}
            for h in self.tb.hosts:
                for key, value in scrape_metrics(h, METRICS_PORT).items():
                    if key.startswith('mlfabric_agent_probe_sent_bytes_total{peer="'):
                        out[(h.name, key.split('"')[1])] = value
            return out

        t0, before = time.monotonic(), sent()
        time.sleep(seconds)
        t1, after = time.monotonic(), sent()
        up: dict[str, float] = {}
        down: dict[str, float] = {}
        for (a, b), v in after.items():
            rate = (v - before.get((a, b), 0.0)) * 8 / (t1 - t0)
            up[a] = up.get(a, 0.0) + rate
            down[b] = down.get(b, 0.0) + rate
        return {**{("up", h): r / (rates[h][0] * 1e6) for h, r in up.items()},
                **{("down", h): r / (rates[h][1] * 1e6) for h, r in down.items()}}

    def reprobes(self) -> float:
        """Trains that found no queue, per 100 trains, over all agents so far."""
        total = unqueued = 0.0
        for h in self.tb.hosts:
            for key, value in scrape_metrics(h, METRICS_PORT).items():
                if key.startswith("mlfabric_agent_probe_trains_total{"):
                    total += value
                    if 'outcome="unqueued"' in key or 'outcome="escalate"' in key:
                        unqueued += value
        return 100 * unqueued / max(total, 1.0)

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(10)
        for cleanup in self.cleanups:
            cleanup()


@contextmanager
def cluster(rate: float):
    with Testbed(hosts=3, rate_mbit=rate) as tb:
        c = Cluster(tb)
        try:
            yield tb, c
        finally:
            c.stop()


def pairs_of(tb: Testbed) -> list[tuple[str, str]]:
    return [(a.name, b.name) for a in tb.hosts for b in tb.hosts if a is not b]


def static(rate: float, steady: float = WINDOW) -> dict[str, float]:
    with cluster(rate) as (tb, c):
        ready = c.start()
        pairs = pairs_of(tb)
        truth: Truth = lambda a, b: rate * 1e6 * PAYLOAD  # noqa: E731
        reaction = c.reaction(truth, pairs, 0.10)
        from_launch = ready - c.launched + reaction
        time.sleep(1.0)
        error = c.steady_error(truth, pairs)
        overhead = c.overhead(rate, steady)
        reprobes = c.reprobes()
        # the peer a user would pick instead: a 1 s bulk TCP test h0 -> h1
        ct = tb.cross_traffic("h0", "h1", proto="tcp", duration=1.0)
        ct.wait(5.0)
        s = ct.received_samples
        tcp = (s[-1].total - s[0].total) * 8 / (s[-1].time - s[0].time) if len(s) > 1 else 0.0
        tcp_err = abs(tcp - rate * 1e6 * TCP_PAYLOAD) / (rate * 1e6 * TCP_PAYLOAD)
    return {"reaction_s": reaction, "from_launch_s": from_launch, "error": error,
            "overhead": overhead, "reprobes_per_100": reprobes, "tcp_error": tcp_err}


def change(high: float = 200, low: float = 50) -> dict[str, float]:
    with cluster(high) as (tb, c):
        c.start()
        pairs = pairs_of(tb)
        involved = [p for p in pairs if "h0" in p]

        def truth_for(r: float) -> Truth:
            return lambda a, b: (r if "h0" in (a, b) else high) * 1e6 * PAYLOAD

        c.reaction(truth_for(high), pairs, 0.10)
        out = {}
        for r, key in ((low, "down"), (high, "up")):
            time.sleep(1.5)
            tb.set_rate("h0", up=r, down=r)
            out[f"{key}_reaction_s"] = c.reaction(truth_for(r), involved, 0.10)
            time.sleep(0.5)
            out[f"{key}_error"] = c.steady_error(truth_for(r), involved, 1.0)
    return out


def cross(proto: str, rate: float = 100) -> dict[str, float]:
    with cluster(rate) as (tb, c):
        c.start()
        pairs = pairs_of(tb)
        full = rate * 1e6 * PAYLOAD
        c.reaction(lambda a, b: full, pairs, 0.10)
        time.sleep(1.0)
        loaded = [("h0", "h1"), ("h0", "h2"), ("h2", "h1")]
        ct = tb.cross_traffic("h0", "h1", rate_mbit=rate / 2, proto=proto)
        t_start = time.monotonic()
        # the truth needs the flow's real rate: estimate it as it runs, then refine
        remainder = {"v": (rate - rate / 2 / (TCP_PAYLOAD if proto == "tcp" else PAYLOAD))
                     * 1e6 * PAYLOAD}

        def truth(a: str, b: str) -> float:
            return remainder["v"] if (a, b) in loaded else full

        reaction = c.reaction(truth, pairs, 0.15)
        time.sleep(max(0.0, 1.5 - (time.monotonic() - t_start)))
        t1 = time.monotonic()
        error_samples_start = t1
        error = c.steady_error(truth, loaded, 2.0)
        goodput = traffic.rate_mbit(ct.received_samples, error_samples_start, time.monotonic())
        wire = goodput * (1 / TCP_PAYLOAD if proto == "tcp" else 1514 / 1472)
        measured_remainder = (rate - wire) * 1e6 * PAYLOAD
        # recompute the error against the measured remainder
        remainder["v"] = measured_remainder
        error = c.steady_error(truth, loaded, 1.0)
        ct.stop()
    return {"reaction_s": reaction, "error": error, "cross_wire_mbit": wire,
            "remainder_mbit": measured_remainder / 1e6}


OVERHEAD_WINDOW = 20.0


def shapers(case: str, seconds: float, settle: float = 10.0) -> dict[str, float]:
    """One case of the accuracy matrix (see the module's docstring)."""
    burst = case.split()[1] if case.startswith("burst") else "1ms"
    with Testbed(hosts=len(ASYMMETRIC), rates=ASYMMETRIC, burst=burst,
                 queue_ms=50.0) as tb:
        c = Cluster(tb)
        try:
            job = None
            if case.startswith("job"):
                # the job's own bulk flow, running before the agents start: it is
                # the job's to plan, not load, so the truth is unchanged
                job = tb.cross_traffic("h1", "h0", proto="tcp")
                c.start("--job-port", str(job.port))
            else:
                c.start()
            rates = {h.name: (h.up_mbit, h.down_mbit) for h in tb.hosts}
            cross_mbit = 0.0
            ct = None
            time.sleep(settle)
            # settled, before any other traffic; over 20 s, several probe intervals
            # (behind 10 ms buckets a path's trains are 5-11 s apart, so a 4 s
            # window holds one train or none of each path)
            extra: dict[str, float] = {}
            if job is None:
                overhead = c.overhead_per_link(rates, seconds=OVERHEAD_WINDOW)
            else:
                shares = c.probes_per_link(rates, seconds=OVERHEAD_WINDOW)
                overhead = max(shares.values())
                # the goal on the links the job transfers on: 1%
                extra["job_links"] = max(shares[("up", "h1")], shares[("down", "h0")])
            proto = case.split()[1]
            if case.startswith("cross"):
                # another tenant's flow into h0 (from h2, whose uplink has room)
                cross_mbit = rates["h0"][1] / 2
                ct = tb.cross_traffic("h2", "h0", rate_mbit=cross_mbit, proto=proto)
            # its rate on the wire: TCP segments or UDP datagrams of full frames
            per_wire = TCP_PAYLOAD if proto == "tcp" else PAYLOAD

            def truth(a: str, b: str) -> float:
                down = rates[b][1] - (cross_mbit / per_wire if b == "h0" else 0.0)
                up = rates[a][0] - (cross_mbit / per_wire if a == "h2" else 0.0)
                return min(up, down) * 1e6 * PAYLOAD

            time.sleep(settle / 2)
            errs: list[float] = []
            t0 = time.monotonic()
            while time.monotonic() - t0 < seconds:
                tick = time.monotonic()
                ests = c.estimates()
                for p in pairs_of(tb):
                    e = ests[p]
                    errs.append(1.0 if e != e else abs(e - truth(*p)) / truth(*p))
                time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
            for flow in (ct, job):
                if flow is not None:
                    flow.stop()
        finally:
            c.stop()
    errs.sort()
    return {"median": statistics.median(errs), "p90": errs[int(0.9 * (len(errs) - 1))],
            "max": errs[-1], "over_25": sum(e > 0.25 for e in errs) / len(errs),
            "samples": float(len(errs)), "overhead": overhead, **extra}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rates", type=float, nargs="+", default=[50, 100, 200])
    ap.add_argument("--scenarios", nargs="+", choices=["static", "change", "cross", "shapers"],
                    default=["static", "change", "cross"])
    ap.add_argument("--seconds", type=float, default=60.0,
                    help="shapers: seconds of once-a-second samples per case")
    ap.add_argument("--cases", nargs="+", choices=SHAPERS, default=list(SHAPERS),
                    metavar="CASE", help=f"shapers: which cases ({', '.join(SHAPERS)})")
    ap.add_argument("--steady", type=float, default=WINDOW,
                    help="seconds of steady state to find the worst 4 s probe overhead in")
    args = ap.parse_args()
    if args.steady < WINDOW:
        ap.error(f"--steady must be at least {WINDOW:g} s (one window), got {args.steady:g}")
    require_root()
    results: dict[str, list[dict[str, float]]] = {}
    for run in range(args.runs):
        if "static" in args.scenarios:
            for rate in args.rates:
                results.setdefault(f"static {rate:g}", []).append(static(rate, args.steady))
        if "change" in args.scenarios:
            results.setdefault("change 200<->50", []).append(change())
        if "cross" in args.scenarios:
            for proto in ("tcp", "udp"):
                results.setdefault(f"cross {proto} 50%", []).append(cross(proto))
        if "shapers" in args.scenarios:
            for case in args.cases:
                res = shapers(case, args.seconds)
                print(f"  {case}: " + ", ".join(f"{k}={v:.3g}" for k, v in res.items()),
                      file=sys.stderr, flush=True)
                results.setdefault(f"shapers {case}", []).append(res)
        print(f"run {run + 1}/{args.runs} done", file=sys.stderr, flush=True)

    def med(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    print(f"# bench_bandwidth: {args.runs} runs, medians; {platform.node()}, "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}")
    print()
    matrix = {n: r for n, r in results.items() if n.startswith("shapers")}
    results = {n: r for n, r in results.items() if not n.startswith("shapers")}
    if matrix:
        print(f"asymmetric 5-host cluster {ASYMMETRIC} (up, down Mbit/s), every directed "
              f"pair once a second for {args.seconds:g} s; error = |estimate - truth| / truth")
        print()
        print("| case | median | p90 | largest | samples > 25% | probe overhead (busiest link, "
              f"{OVERHEAD_WINDOW:g} s; with the job's flow: probes only) |")
        print("|---|---|---|---|---|---|")
        for name, rows in matrix.items():
            job = (f" (the job's links: {med(rows, 'job_links'):.2%})"
                   if "job_links" in rows[0] else "")
            print(f"| {name.removeprefix('shapers ')} | {med(rows, 'median'):.1%} | "
                  f"{med(rows, 'p90'):.1%} | {med(rows, 'max'):.1%} | "
                  f"{med(rows, 'over_25'):.1%} | {med(rows, 'overhead'):.2%}{job} |")
        print()
    if results:
        print("| scenario | error | reaction (s) | probe overhead (worst 4 s of "
              f"{args.steady:g} s) | re-probes per 100 trains | bulk TCP test error | "
              "bulk TCP test cost |")
        print("|---|---|---|---|---|---|---|")
    for name, rows in results.items():
        if name.startswith("static"):
            print(f"| {name} Mbit/s | {med(rows, 'error'):.1%} | "
                  f"{med(rows, 'reaction_s'):.2f} after ready, "
                  f"{med(rows, 'from_launch_s'):.2f} after launch | {med(rows, 'overhead'):.2%} | "
                  f"{med(rows, 'reprobes_per_100'):.2f} | "
                  f"{med(rows, 'tcp_error'):.1%} | 100% for 1 s |")
        elif name.startswith("change"):
            print(f"| 200 -> 50 Mbit/s | {med(rows, 'down_error'):.1%} | "
                  f"{med(rows, 'down_reaction_s'):.2f} | | | | |")
            print(f"| 50 -> 200 Mbit/s | {med(rows, 'up_error'):.1%} | "
                  f"{med(rows, 'up_reaction_s'):.2f} | | | | |")
        else:
            print(f"| {name} of 100 Mbit/s (remainder {med(rows, 'remainder_mbit'):.1f}) | "
                  f"{med(rows, 'error'):.1%} | {med(rows, 'reaction_s'):.2f} | | | | |")
    print()
    print("per-run values:")
    for name, rows in {**matrix, **results}.items():
        for r in rows:
            print(f"  {name}: " + ", ".join(f"{k}={v:.3g}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
