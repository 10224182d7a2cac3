"""Decision time of the controller's scheduling core: one full re-plan.

The controller re-plans on every event (request, completion, bandwidth
change), so `mlfabric.scheduling.schedule.plan(snapshot, config)` must be cheap. This
times one call on a synthetic snapshot, in one run: the "mlfabric" policy
(shortest-transfer-first with deadlines and drops; its search runs in the
compiled kernel mlfabric.scheduling._stf.schedule_stf when built), the same policy on
the pure-Python reference (checked to give the identical plan), and the
"fifo" baseline (max-min fair share, same snapshot, same entry point), with
the ratio to fifo and to the 10 ms target (1,000 pending over 1,000 hosts).
Times include building the link tables and the directives.

Workload (all seeded): `--servers` server hosts, the other hosts are workers;
each pending update goes from a random worker to a random server. Capacities
are uniform in [1, 10] Gbit/s (uplinks and downlinks drawn independently, so
some workers are slower than the server link and some are not); a fraction
of the (worker, server) pairs has a measured pair rate; a fraction of the
workers has a transfer running. Update sizes are equal (one model) or mixed
(1 to 64 MiB). Base versions lag the server by 0..pending versions and
tau_max defaults to 1.5 x pending, so deadlines force some updates late in the
order and drop a few.

    python benchmarks/bench_schedule.py                      # target + curve
    python benchmarks/bench_schedule.py --hosts 1000 --pending 1000 --repeats 21
    python benchmarks/bench_schedule.py --curve 100,1000,3000,10000 --sizes mixed
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from collections import Counter

from mlfabric.scheduling import schedule
from mlfabric.scheduling.schedule import (
    Capacities,
    PendingUpdate,
    PlanConfig,
    PlanInput,
    RunningTransfer,
    ServerState,
    plan,
)

GBIT = 1e9 / 8  # bytes/s
MiB = 1 << 20
TARGET_SECONDS = 0.010  # median, 1,000 pending over 1,000 hosts (issue 4)


def make_snapshot(
    hosts: int,
    pending: int,
    *,
    servers: int = 1,
    sizes: str = "equal",
    tau_max: int | None = None,
    running_fraction: float = 0.1,
    pair_fraction: float = 0.1,
    seed: int = 0,
) -> PlanInput:
    rng = random.Random(seed)
    now = 1000.0
    server_hosts = list(range(servers))
    workers = list(range(servers, hosts))
    up = {h: rng.uniform(1, 10) * GBIT for h in range(hosts)}
    down = {h: rng.uniform(1, 10) * GBIT for h in range(hosts)}
    pair = {}
    for w in workers:
        for s in server_hosts:
            if rng.random() < pair_fraction:
                pair[(w, s)] = rng.uniform(0.5, 10) * GBIT
    version = 10_000
    lag = pending  # base versions lag the server by up to one version per pending update
    updates = []
    for uid in range(pending):
        size = 16 * MiB if sizes == "equal" else rng.randint(1 * MiB, 64 * MiB)
        updates.append(
            PendingUpdate(
                id=uid,
                source=rng.choice(workers),
                destination=rng.choice(server_hosts),
                size=size,
                base_version=version - rng.randint(0, lag),
                norm=1.0,
                arrival=now - rng.uniform(0, 1),
            )
        )
    # Running transfers share their server's downlink (and fit their uplinks).
    senders = rng.sample(workers, int(running_fraction * len(workers)))
    dest = {w: rng.choice(server_hosts) for w in senders}
    fan_in = {s: max(1, sum(1 for w in senders if dest[w] == s)) for s in server_hosts}
    running = [
        RunningTransfer(
            id=pending + i,
            source=w,
            destination=dest[w],
            rate=min(up[w], down[dest[w]] / fan_in[dest[w]]) * rng.uniform(0.5, 1),
            end=now + rng.uniform(0.001, 0.1),
        )
        for i, w in enumerate(senders)
    ]
    net = Capacities(up=up, down=down, pair=pair)
    return PlanInput(now, updates, running, net, ServerState(version, len(running)))


def time_plan(snapshot: PlanInput, config: PlanConfig, repeats: int,
              use_kernel: bool = True) -> tuple[float, object]:
    """Median seconds of one plan() call (GC off while timing, as in timeit).
    The best run is kept in BEST, to show how noisy the machine was."""
    result = plan(snapshot, config, use_kernel=use_kernel)  # warm up
    samples = []
    gc.disable()
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            plan(snapshot, config, use_kernel=use_kernel)
            samples.append(time.perf_counter() - t0)
    finally:
        gc.enable()
    BEST[id(snapshot), config.policy, use_kernel] = min(samples)
    return statistics.median(samples), result


BEST: dict[tuple, float] = {}


def describe(result) -> str:
    reasons = Counter(d.reason for d in result.drops)
    dropped = ", ".join(f"{n} {r}" for r, n in sorted(reasons.items())) or "0 dropped"
    return f"{len(result.order)} sent ({len(result.send_now())} now), {dropped}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hosts", type=int, default=1000)
    ap.add_argument("--pending", type=int, default=1000)
    ap.add_argument("--curve", default="100,1000,3000,10000",
                    help="host counts for the curve (pending = hosts); '' to skip")
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--sizes", choices=("equal", "mixed"), default="equal")
    ap.add_argument("--tau-max", type=int, default=None,
                    help="staleness bound (default: 1.5 x pending); -1 for no deadlines")
    ap.add_argument("--idle-factor", type=float, default=1.0)
    ap.add_argument("--running", type=float, default=0.1, help="fraction of workers sending")
    ap.add_argument("--pairs", type=float, default=0.1, help="fraction of measured pairs")
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--reference-max", type=int, default=3000,
                    help="also time the pure-Python reference up to this many pending")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    def tau_for(pending: int) -> int | None:
        if args.tau_max is None:
            return pending + pending // 2
        return None if args.tau_max < 0 else args.tau_max

    kernel = "compiled kernel" if schedule._stf_kernel is not None else "NOT BUILT (python)"
    print(f"python {sys.version.split()[0]}; mlfabric policy: {kernel}; servers={args.servers} "
          f"sizes={args.sizes} running={args.running} pairs={args.pairs} "
          f"idle_factor={args.idle_factor}; median of {args.repeats} runs")
    rows = [(args.hosts, args.pending)]
    if args.curve:
        rows += [(int(h), int(h)) for h in args.curve.split(",")]
    print(f"{'hosts':>6} {'pending':>7} {'tau_max':>7} {'mlfabric':>9} {'(best)':>9} "
          f"{'python':>9} {'fifo':>8} {'mlf/fifo':>8} {'/10 ms':>6}  outcome (mlfabric)")
    for hosts, pending in rows:
        tau = tau_for(pending)
        snap = make_snapshot(hosts, pending, servers=args.servers, sizes=args.sizes,
                             tau_max=tau, running_fraction=args.running,
                             pair_fraction=args.pairs, seed=args.seed)
        config = PlanConfig("mlfabric", tau, args.idle_factor)
        stf, res = time_plan(snap, config, args.repeats)
        if pending <= args.reference_max:
            ref, ref_res = time_plan(snap, config, max(3, args.repeats // 4), use_kernel=False)
            assert ref_res == res, "kernel and reference disagree"
            ref_ms = f"{ref * 1e3:7.2f}ms"
        else:
            ref_ms = "-"
        fifo, _ = time_plan(snap, PlanConfig("fifo", tau), args.repeats)
        best = BEST[id(snap), "mlfabric", True]
        print(f"{hosts:>6} {pending:>7} {tau!s:>7} {stf * 1e3:7.2f}ms {best * 1e3:7.2f}ms "
              f"{ref_ms:>9} {fifo * 1e3:6.2f}ms {stf / fifo:>8.2f} {stf / TARGET_SECONDS:>6.2f}  "
              f"{describe(res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
