"""The simulator at scale: fifo vs mlfabric for 100, 1,000 and 10,000 workers.

bench_controller.py's scenario (validated against the emulated cluster by
sim_validate.py), scaled so the load on the server stays the same: one
server and N workers; each worker's share of the server's downlink is
12.5 Mbit/s (8 workers: 100 Mbit/s) and halves during the middle third of
the expected run; the server's uplink is 10x its downlink; workers have
1 Gbit/s links; 2 MiB updates; compute 1.2 s +-20 %; one push in flight;
tau_max = N (8 workers: 8); the workers start uniformly over the first
compute time. The controller re-plans on every event (unless
--replan-every-ms). With --decision-latency measured each re-plan takes the
wall time it took here: its directives leave when it ends, and the events
that arrive meanwhile are answered together by the next one, as
mlfabric.controller.controller answers the events of one turn of its loop.

    .venv/bin/python benchmarks/bench_sim.py [--scales 100,1000,10000] [--steps 8,4,2]
        [--replan-every-ms 0,0,0] [--decision-latency none|measured] [--shards 1]
        [--controllers 1] [--controller-view static|live] [--landing-report worker|server]
        [--timeline SECONDS]

With --shards S the server is S shards (hosts s0..s{S-1}), each with 1/S of
the downlink (so each worker's share stays the same) and a part of every
update; the change in the middle third is then s0's downlink alone (one
shard's host loses half its link to another tenant). With --controllers C
the shards are split between C controllers (shard k to controller k mod C,
as `mlfabric controller --etcd` splits them at start), each with its part
of every worker uplink and busy with its own re-plans; busy is then the
busiest controller's.

With --controller-view live the controller is told each rate change as it
happens (ideal agents); by default it knows only the configured rates, and
learns the rest from its own transfers. With --landing-report server each
server tells the controller of a landing itself, one message after it,
before the worker once the answer has reached it (two), as a server
started with `--controller` does.

Prints per scale and policy: pushes, applied, dropped (by reason), delay
and push-to-applied distributions (and where some were not applied, every
push's time to its outcome: a fifo server refuses the stalest, which
waited longest), bytes into the server, and the
controller's decision time: the wall time of each real `decide()` call in
the run (median, p99, max), the most updates pending at one call, and busy
= total decision time / simulated time (above 1, a controller that
re-plans once per event could not keep up), and how many events each
re-plan answered. Last column: the wall time the simulation itself took.
With --timeline SECONDS, every SECONDS of simulated time: the first server
downlink's load (payload over its capacity) and flows, the rate the
controller plans it by over the rate it is shaped to (2.00: twice what it
gives), and the transfers waiting for a go and let go (`Result.timeline`).
The process keeps freed memory for reuse as `mlfabric controller` does
(`runtime.memory.reuse_freed_blocks`), so decisions take the time they take
there.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from mlfabric.runtime import memory
from mlfabric.sim.engine import (
    MIB,
    RateChange,
    Scenario,
    add_controller_arguments,
    simulate,
)


def scenario(n: int, steps: int, replan_ms: float, args: argparse.Namespace) -> Scenario:
    down = n * args.share_mbit / args.shards  # each shard's
    expected = steps * (args.compute_ms / 1e3 + 0.3)  # as bench_controller.py
    changes = ()
    first = "h0" if args.shards == 1 else "s0"
    if args.change_factor != 1.0:
        changes = (RateChange(expected / 3, first, down_mbit=down * args.change_factor),
                   RateChange(2 * expected / 3, first, down_mbit=down))
    return Scenario(workers=n, shards=args.shards, controllers=args.controllers,
                    update_bytes=int(args.update_mib * MIB),
                    steps=steps,
                    compute=args.compute_ms / 1e3, jitter=0.2, max_in_flight=1, tau_max=n,
                    server_down_mbit=down, server_up_mbit=10 * down, worker_up_mbit=1000.0,
                    worker_down_mbit=1000.0, changes=changes,
                    start_spread=args.compute_ms / 1e3, seed=args.seed,
                    replan_every=replan_ms / 1e3, decision_latency=args.decision_latency,
                    controller_view=args.controller_view, landing_report=args.landing_report)


def fmt(s: dict[str, Any], wall: float) -> list[str]:
    d, p = s["delay"], s["push_to_applied"]
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(s["reasons"].items())) or "-"
    held = (f"  held {s['held']} ({s['held_expired']} past their wait)"
            if s["policy"] != "fifo" else "")  # (docs/scheduling.md: the goes' names)
    out = [f"  {s['policy']:9s} pushes {s['pushes']}  applied {s['applied']}  dropped "
           f"{s['dropped']} ({reasons}){held}  into server "
           f"{s['bytes_into_server'] / MIB:.0f} MiB  simulated {s['end']:.2f} s  "
           f"sim wall {wall:.1f} s"]
    if d["count"]:
        out.append(f"            delay mean {d['mean']:.1f} std {d['std']:.1f} p50 {d['p50']:.0f} "
                   f"p99 {d['p99']:.0f} max {d['max']:.0f}   push-to-applied mean "
                   f"{p['mean']:.3f} s std {p['std']:.3f} p50 {p['p50']:.3f} p99 "
                   f"{p['p99']:.3f} max {p['max']:.3f}")
    o = s["push_to_outcome"]
    if o["count"] > p["count"]:  # refused or dropped: the time to their outcome too
        out.append(f"            every push to its outcome, {o['count']}: mean {o['mean']:.3f} s "
                   f"p50 {o['p50']:.3f} p99 {o['p99']:.3f}")
    ds = s.get("decision_seconds")
    if ds:
        out.append(f"            decision time p50 {ds['p50'] * 1e3:.3f} ms p99 "
                   f"{ds['p99'] * 1e3:.3f} ms max {ds['max'] * 1e3:.3f} ms over "
                   f"{ds['count']} re-plans, pending max {s['pending_max']}, busy "
                   f"{s['controller_busy']:.2f}")
        ev = s["events_per_decision"]
        if ev["count"]:
            out.append(f"            events per re-plan mean {ev['mean']:.2f} p99 "
                       f"{ev['p99']:.0f} max {ev['max']:.0f}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scales", default="100,1000,10000")
    ap.add_argument("--steps", default="8,4,2", help="pushes per worker, per scale")
    ap.add_argument("--share-mbit", type=float, default=12.5,
                    help="server downlink per worker (Mbit/s)")
    ap.add_argument("--change-factor", type=float, default=0.5,
                    help="server downlink factor in the middle third (1: no change)")
    ap.add_argument("--update-mib", type=float, default=2.0)
    ap.add_argument("--compute-ms", type=float, default=1200.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", type=int, default=1, help="server shards (see above)")
    ap.add_argument("--controllers", type=int, default=1,
                    help="controllers splitting the shards (see above)")
    ap.add_argument("--policies", default="fifo,mlfabric")
    ap.add_argument("--timeline", type=float, default=None, metavar="SECONDS",
                    help="print the server link and the controller every SECONDS of "
                         "simulated time")
    ap.add_argument("--replan-every-ms", default="0,0,0",
                    help="per scale: the controller re-plans at most this often (0: on "
                         "every event, as mlfabric.controller.controller does)")
    add_controller_arguments(ap)
    args = ap.parse_args()
    memory.reuse_freed_blocks()  # as `mlfabric controller` runs its decisions
    scales = [int(x) for x in args.scales.split(",")]
    steps = [int(x) for x in args.steps.split(",")]
    replan = [float(x) for x in args.replan_every_ms.split(",")]
    if args.timeline is not None and not args.timeline > 0:
        print(f"--timeline must be > 0 simulated seconds, got {args.timeline}", file=sys.stderr)
        return 2
    if not len(steps) == len(replan) == len(scales):
        print(f"--steps and --replan-every-ms need one value per scale ({len(scales)})",
              file=sys.stderr)
        return 2

    def progress(now: float, done: int, total: int) -> None:
        print(f"    ... simulated {now:.2f} s, {done}/{total} pushes done", file=sys.stderr,
              flush=True)

    try:
        for n, k, every in zip(scales, steps, replan, strict=True):
            sc = scenario(n, k, every, args)
            how = f"at most every {every:g} ms" if every else "on every event"
            if args.decision_latency == "measured":
                how += ", each taking the time it took here"
            servers = "server downlink" if sc.shards == 1 else f"{sc.shards} shards, downlink"
            if sc.controllers > 1:
                servers = f"{sc.controllers} controllers, {servers}"
            changed = "" if sc.shards == 1 else " on s0"
            print(f"{n} workers, {k} steps: {servers} {sc.server_down_mbit:g} Mbit/s "
                  f"({args.change_factor:g}x in the middle third{changed}), tau_max "
                  f"{sc.tau_max}, re-plans {how}", flush=True)
            for policy in args.policies.split(","):
                t0 = time.perf_counter()
                result = simulate(sc, policy, timer=time.perf_counter, progress=progress,
                                  progress_every=100_000, sample_every=args.timeline)
                for line in fmt(result.summary(), time.perf_counter() - t0):
                    print(line, flush=True)
                if result.timeline:
                    print(f"            {'t (s)':>7s} {'load':>5s} {'flows':>6s} "
                          f"{'plans by':>8s} {'waiting':>8s} {'let go':>7s}")
                for x in result.timeline:
                    print(f"            {x.t:7.2f} {x.load:5.2f} {x.flows:6d} {x.planned:8.2f} "
                          f"{x.waiting:8d} {x.running:7d}", flush=True)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
