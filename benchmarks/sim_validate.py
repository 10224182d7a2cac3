"""The simulator against the emulated cluster: bench_controller.py's scenario, sim vs measured.

8 workers, 2 MiB updates, compute 1.2 s +-20 %, server downlink 100 Mbit/s
(50 Mbit/s in the middle third of the expected run), tau_max 8, one push
in flight, 8 steps; both policies.

    .venv/bin/python benchmarks/sim_validate.py [--sim-runs 15]
        simulate only; compare with the figures recorded in RESULTS.md
        (or with --records FILE from an earlier --measure)
    sudo .venv/bin/python benchmarks/sim_validate.py --measure --rounds 3 [--out FILE]
        also run the emulated cluster (as bench_controller.py does, policies
        alternated), save every push, and simulate each measured run with the
        same seed and the workers' start times taken from that run
    sudo .venv/bin/python benchmarks/sim_validate.py --measure --shards 4
        the same with the model over 4 server shards, each on its own host
        with 1/4 of the downlink (the middle third's change on shard 0's)
    sudo .venv/bin/python benchmarks/sim_validate.py --measure --shards 4 --controllers 1,2,4
        the same with 1, 2 and 4 controllers (an etcd on h0, controller k
        beside shard k; several controllers, issue 34), alternated within
        each round; the simulator splits the shards the same way

Prints, per policy, the push-to-applied mean (and delay, drops) of the
measured runs and of the simulated ones, their medians and the ratio sim /
measured (the goal of issue 7: within 20 %).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from mlfabric.sim.engine import MIB, TCP_GOODPUT, RateChange, Scenario, simulate

# benchmarks/RESULTS.md, "mlfabric ordering vs the plain asynchronous PS on an
# emulated cluster (issue 4)", "Compute-dominated": medians of 3 runs per
# policy, measured with the controller code of the overload rule.
RECORDED = {"mlfabric": {"seconds_mean": 0.561, "delay_mean": 6.547, "dropped": 0.0},
            "fifo": {"seconds_mean": 0.677, "delay_mean": 5.310, "dropped": 6.0}}
POLICIES = ("mlfabric", "fifo")


def scenario(args: argparse.Namespace, seed: int, starts: tuple[float, ...] = (),
             **kw: Any) -> Scenario:
    expected = args.steps * (args.compute_ms / 1e3 + 0.3)  # as bench_controller.py
    changes = ()
    first = "h0" if args.shards == 1 else "s0"  # (the simulator's name of shard 0's host)
    if args.change_to is not None:
        changes = (RateChange(expected / 3, first, down_mbit=args.change_to / args.shards),
                   RateChange(2 * expected / 3, first, down_mbit=args.down_mbit / args.shards))
    return Scenario(workers=args.workers, shards=args.shards,
                    update_bytes=int(args.model_mib * MIB),
                    steps=args.steps, compute=args.compute_ms / 1e3, jitter=0.2,
                    max_in_flight=args.in_flight, tau_max=args.tau_max,
                    server_up_mbit=1000.0, server_down_mbit=args.down_mbit / args.shards,
                    worker_up_mbit=1000.0, worker_down_mbit=1000.0, changes=changes,
                    seed=seed, starts=starts, **kw)


def sim_row(sc: Scenario, policy: str) -> dict[str, float]:
    s = simulate(sc, policy).summary()
    return {"seconds_mean": s["push_to_applied"].get("mean", 0.0),
            "delay_mean": s["delay"].get("mean", 0.0), "dropped": float(s["dropped"]),
            "wall": s["end"]}


def measured_row(records: list[dict[str, Any]]) -> dict[str, float]:
    applied = [r for r in records if r["applied"]]
    return {"seconds_mean": statistics.fmean(r["seconds"] for r in applied),
            "delay_mean": statistics.fmean(r["delay"] for r in applied),
            "dropped": float(len(records) - len(applied))}


def starts_of(run: dict[str, Any], args: argparse.Namespace) -> tuple[float, ...]:
    """Each worker's start (its first pull) relative to the rate schedule's t = 0,
    from its first push: less its first compute time (the seeded draw
    workload.py made) and two pulls of the model at the server's uplink."""
    steps, seed = args.steps, run["seed"]
    pulls = 2 * (args.model_mib * MIB / (1000e6 / 8 * TCP_GOODPUT) + 0.001)
    starts = []
    for i in range(args.workers):
        mine = run["records"][i * steps:(i + 1) * steps]
        first = min(r["start"] for r in mine)
        compute = args.compute_ms / 1e3 * (1 + 0.2 * (2 * random.Random(seed * 100 + i)
                                                       .random() - 1))
        starts.append(max(0.0, first - compute - pulls - run["t0"]))
    return tuple(starts)


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    from mlfabric.tools.testbed import SetRate, Testbed, require_root
    from mlfabric.tools.workload import run_policy

    require_root()
    runs = []
    expected = args.steps * (args.compute_ms / 1e3 + 0.3)
    # Shard i's server on host h{i} (the controller beside shard 0), each
    # with 1/S of the downlink; the workers on the hosts after them.
    down = args.down_mbit / args.shards
    servers = {f"h{i}": (1000.0, down) for i in range(args.shards)}
    with Testbed(hosts=args.workers + args.shards, rate_mbit=1000.0, rates=servers) as tb:
        for r in range(args.rounds):
            order = [(c, p) for c in args.controllers for p in POLICIES]
            order = order[r % len(order):] + order[:r % len(order)]  # alternated
            for controllers, policy in order:
                t0: list[float] = []

                def during(tb: Any, t0: list[float] = t0) -> None:
                    t0.append(time.monotonic())
                    if args.change_to is not None:
                        tb.schedule([(expected / 3, SetRate("h0", down=args.change_to
                                                            / args.shards)),
                                     (2 * expected / 3, SetRate("h0", down=down))])

                summary, records = run_policy(
                    tb, policy, model_bytes=int(args.model_mib * MIB), steps=args.steps,
                    tau_max=args.tau_max, compute_ms=args.compute_ms, seed=r,
                    max_in_flight=args.in_flight, link_mbit=servers, during=during,
                    shard_hosts=[f"h{i}" for i in range(1, args.shards)],
                    controllers=controllers)
                runs.append({"policy": policy, "seed": r, "t0": t0[0], "records": records,
                             "controllers": controllers})
                print(f"measured round {r + 1}, {controllers} controller(s)  {summary.row()}",
                      file=sys.stderr, flush=True)
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measure", action="store_true", help="run the emulated cluster (root)")
    ap.add_argument("--records", type=Path, help="measured runs saved by --measure --out")
    ap.add_argument("--out", type=Path, help="save the measured runs here (JSON)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sim-runs", type=int, default=15,
                    help="without measured runs: simulated runs per policy (seeds 0..n-1)")
    ap.add_argument("--start-delay", type=float, default=0.5,
                    help="without measured runs: seconds until the workers start")
    ap.add_argument("--start-spread", type=float, default=0.5,
                    help="without measured runs: the workers start uniformly over this")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--compute-ms", type=float, default=1200.0)
    ap.add_argument("--in-flight", type=int, default=1)
    ap.add_argument("--model-mib", type=float, default=2.0)
    ap.add_argument("--down-mbit", type=float, default=100.0)
    ap.add_argument("--change-to", type=float, default=50.0)
    ap.add_argument("--tau-max", type=int, default=8)
    ap.add_argument("--no-slow-start", action="store_true")
    ap.add_argument("--shards", type=int, default=1,
                    help="server shards, each on its own host with 1/S of --down-mbit "
                         "(needs --measure or --records: RESULTS.md has no sharded figures)")
    ap.add_argument("--controllers", default="1",
                    help="with --measure: controllers per run, a list alternated within each "
                         "round, e.g. 1,2,4 (1..shards; several need etcd: the test extra)")
    args = ap.parse_args()
    args.controllers = [int(x) for x in args.controllers.split(",")]
    if not all(1 <= c <= args.shards for c in args.controllers):
        ap.error(f"--controllers must each be 1..shards ({args.shards}), got {args.controllers}")
    if args.shards < 1:
        ap.error(f"--shards must be >= 1, got {args.shards}")
    if args.shards > 1 and not (args.measure or args.records):
        ap.error("--shards > 1 compares with measured runs: give --measure (root) or "
                 "--records FILE")
    kw = {"slow_start": not args.no_slow_start}

    runs: list[dict[str, Any]] = []
    if args.measure:
        runs = measure(args)
        if args.out:
            args.out.write_text(json.dumps(runs))
    elif args.records:
        runs = json.loads(args.records.read_text())

    fields = ("seconds_mean", "delay_mean", "dropped")
    if runs:
        print("run by run: measured vs simulated (same seed, measured worker start times)")
        by_policy: dict[str, list[tuple[dict[str, float], dict[str, float]]]] = {}
        for run in runs:
            starts = starts_of(run, args)
            m = measured_row(run["records"])
            c = run.get("controllers", 1)
            s = sim_row(scenario(args, run["seed"], starts, controllers=c, **kw), run["policy"])
            name = run["policy"] if c == 1 else f"{run['policy']}/{c}c"
            by_policy.setdefault(name, []).append((m, s))
            print(f"  {name:9s} seed {run['seed']}  starts "
                  f"{min(starts):.2f}-{max(starts):.2f}s  push-to-applied measured "
                  f"{m['seconds_mean']:.3f}s sim {s['seconds_mean']:.3f}s  delay "
                  f"{m['delay_mean']:.2f} / {s['delay_mean']:.2f}  dropped "
                  f"{m['dropped']:.0f} / {s['dropped']:.0f}")
        print()
        print(f"medians of {args.rounds} runs per policy")
        print(f"  {'policy':9s} {'field':14s} {'measured':>9s} {'sim':>9s} {'sim/meas':>9s}")
        for policy, pairs in by_policy.items():
            for f in fields:
                a = statistics.median(m[f] for m, _ in pairs)
                b = statistics.median(s[f] for _, s in pairs)
                ratio = f"{b / a:9.2f}" if a else f"{'-':>9s}"
                print(f"  {policy:9s} {f:14s} {a:9.3f} {b:9.3f} {ratio}")
        return 0

    print(f"{args.sim_runs} simulated runs per policy (seeds 0..{args.sim_runs - 1}; workers "
          f"start at {args.start_delay} s + U(0, {args.start_spread}) s), against the "
          f"medians recorded in RESULTS.md")
    print(f"  {'policy':9s} {'field':14s} {'measured':>9s} {'sim p50':>9s} {'sim p25':>9s} "
          f"{'sim p75':>9s} {'sim/meas':>9s}")
    for policy in POLICIES:
        rows = [sim_row(scenario(args, seed, start_delay=args.start_delay,
                                 start_spread=args.start_spread, **kw), policy)
                for seed in range(args.sim_runs)]
        for f in fields:
            xs = sorted(r[f] for r in rows)
            q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
            a = RECORDED[policy][f]
            ratio = f"{q[1] / a:9.2f}" if a else f"{'-':>9s}"
            print(f"  {policy:9s} {f:14s} {a:9.3f} {q[1]:9.3f} {q[0]:9.3f} {q[2]:9.3f} {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
