"""The divergence bound per shard on an emulated cluster: each shard's measured
||w_s - w_r||_2 against its share of --div-max (needs root).

Issue 31's measure: S shards (4), each with a replica, and 8 workers. The
shards' servers run on h0..h(S-1), their replicas on the next S hosts and
the controller (`--div-max X` with every shard's server and replica, so
each shard's gate bounds its part by X / sqrt(S)) on one more, each an
event loop in a thread of this process that lives in its host's network
namespace; the workers are processes on hosts of their own (worker-driven
replication per shard, pull / push / wait for the acknowledgement); every
link is shaped to --mbit. A sampler per shard freezes that shard's event
loop, snapshots its replica from inside it (so both states are of one
instant) and measures ||w_s - w_r||_2 with the l2_norm_diff kernel,
continuously. X is a multiple (--factors) of sqrt(S) times the largest
single step a shard can make (||a|| / (1 - gamma) over the parts): below
one step no bound can be kept. Factors alternate within every round.

With --aggregate, two aggregators (on hosts of their own) sum groups of up
to --max-fan-in updates per shard (the controller holds a group up to 0.3 s
for company), every worker still feeding its shard's replica: each
aggregate reaches the replica as its members, which it applies as the
server's one step, and the gate counts it as one step. A shard's largest
step is then an aggregate's: --max-fan-in times the single update's. Only
the servers' links are shaped to --mbit then (the bottleneck, where a group
pays); the others run at --fast-mbit, and the controller is told both.

    sudo python benchmarks/bench_shard_divergence.py [--rounds 2] [--shards 4]
        [--workers 8] [--steps 20] [--model-mib 1] [--mbit 200] [--factors 1,2,inf]
        [--correlation 0.9] [--aggregate] [--max-fan-in 4] [--fast-mbit 1000]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_divergence import GAMMA, LoopThread, make_update

JOB = "bench-divergence"
AGGREGATORS = 2  # with --aggregate


def worker(argv: list[str]) -> int:
    import mlfabric

    p = argparse.ArgumentParser()
    for flag in ("--servers", "--replicas", "--controller", "--token-file", "--out"):
        p.add_argument(flag, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--correlation", type=float, required=True)
    args = p.parse_args(argv)
    records = []
    with mlfabric.connect(args.servers, job=JOB, token_file=args.token_file, timeout=30,
                          controller=args.controller, controller_fallback="wait",
                          replica=args.replicas) as ps:
        for i in range(args.steps):
            version, params = ps.pull(timeout=60)
            t0 = time.perf_counter()
            u = make_update(params["w"].size, 1000 * args.index + i, args.correlation)
            outcome = ps.push(u, base_version=version).result(120)
            records.append({"applied": outcome.applied, "push": time.perf_counter() - t0,
                            "t": time.perf_counter()})
    Path(args.out).write_text(json.dumps(records))
    return 0


def one_run(tb: Any, tmp: str, args: argparse.Namespace, div_max: float) -> dict[str, Any]:
    from mlfabric.agent.aggregator import Aggregator
    from mlfabric.controller.controller import Controller
    from mlfabric.kernels import _core
    from mlfabric.replication.divergence import DivergenceGate
    from mlfabric.replication.replica import ReplicaServer
    from mlfabric.runtime.metrics import AggregatorMetrics, ServerMetrics
    from mlfabric.scheduling.aggregation import AggregationConfig
    from mlfabric.scheduling.plan import Network, fifo_policy
    from mlfabric.server.server import ParameterServer
    from mlfabric.server.store import ParameterStore

    S = args.shards
    hosts = tb.hosts
    token = Path(f"{tmp}/job.token").read_bytes().strip()
    parts = args.parts  # shard i's pieces of the initial model, and its ShardInfo

    def store(i: int) -> ParameterStore:
        tensors, info = parts[i]
        st = ParameterStore({n: a.copy() for n, a in tensors.items()}, momentum=GAMMA)
        st.shard = info
        return st

    servers = [LoopThread(ParameterServer(store(i), job=JOB, token=token,
                                          metrics=ServerMetrics()), hosts[i])
               for i in range(S)]
    replicas = [LoopThread(ReplicaServer(store(i), job=JOB, token=token,
                                         metrics=ServerMetrics()), hosts[S + i])
                for i in range(S)]
    listed = [t.address for t in (*servers, *replicas)]  # where aggregates may go
    aggs = [LoopThread(Aggregator(job=JOB, token=token, servers=listed,
                                  metrics=AggregatorMetrics()), h)
            for h in (hosts[2 * S + 1:2 * S + 1 + AGGREGATORS] if args.aggregate else ())]
    ctl = Controller(fifo_policy, job=JOB, token=token, tau_max=None,
                     gate=DivergenceGate(GAMMA, div_max if math.isfinite(div_max) else 1e300),
                     aggregators={a.host.ip: a.address for a in aggs} or None,
                     network=Network(default=args.fast_mbit * 1e6 / 8,
                                     up={s.host.ip: args.mbit * 1e6 / 8 for s in servers},
                                     down={s.host.ip: args.mbit * 1e6 / 8 for s in servers})
                     if aggs else None,
                     aggregation=AggregationConfig(max_fan_in=args.max_fan_in, hold=True,
                                                   wait=0.3) if aggs else None)
    controller = LoopThread(ctl, hosts[2 * S])
    controller.call(lambda: ctl.watch_servers([s.address for s in servers],
                                              [r.address for r in replicas]))
    samples: list[list[float]] = [[] for _ in range(S)]
    stop = threading.Event()

    def sample_both(i: int) -> float:
        # In shard i's loop: nothing is applied there until its replica's
        # snapshot (taken in the replica's loop) is back.
        s_store, r_store = servers[i].endpoint.store, replicas[i].endpoint.store
        ws = {n: a.copy() for n, a in s_store.weights.items()}
        wr = replicas[i].call(lambda: {n: a.copy() for n, a in r_store.weights.items()})
        return math.sqrt(sum(_core.l2_norm_diff(ws[n], wr[n]) ** 2 for n in ws))

    def sampler(i: int) -> None:
        while not stop.is_set():
            samples[i].append(servers[i].call(lambda: sample_both(i)))

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = []
    try:
        sampling = [threading.Thread(target=sampler, args=(i,), daemon=True) for i in range(S)]
        for t in sampling:
            t.start()
        for w, h in enumerate(hosts[2 * S + 1 + len(aggs):]):
            procs.append(tb.popen(h, [
                sys.executable, os.path.abspath(__file__), "--worker",
                "--servers", ",".join(s.address for s in servers),
                "--replicas", ",".join(r.address for r in replicas),
                "--controller", controller.address, "--token-file", f"{tmp}/job.token",
                "--steps", str(args.steps), "--index", str(w),
                "--correlation", str(args.correlation), "--out", f"{tmp}/w{w}.json"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp,
                env=env))
        records = []
        for w, p in enumerate(procs):
            if p.wait(timeout=900) != 0:
                raise RuntimeError(f"worker {w} failed: {p.stderr.read()[-3000:]}")
            records += json.loads(Path(f"{tmp}/w{w}.json").read_text())
        stop.set()
        for t in sampling:
            t.join(30)
        final = [servers[i].call(lambda i=i: sample_both(i)) for i in range(S)]
        gates = controller.call(lambda: [(g.div_max, g.held, g.overrides)
                                         for _, g in sorted(ctl.gates.items())])
        aggregates = [s.call(lambda s=s: s.endpoint.metrics.aggregates_applied._value.get())
                      for s in servers]
        replayed = [r.call(lambda r=r: r.endpoint.metrics.aggregates_applied._value.get())
                    for r in replicas]
    finally:
        stop.set()
        for p in procs:
            if p.poll() is None:
                p.kill()
        for lt in (controller, *aggs, *servers, *replicas):
            lt.close()
    span = max(r["t"] for r in records) - min(r["t"] - r["push"] for r in records)
    return {"samples": [len(x) for x in samples],
            "max_over_bound": max(max(x) / g[0] for x, g in zip(samples, gates, strict=True)),
            "max_measured": max(max(x) for x in samples),
            "final": max(final), "held": sum(g[1] for g in gates),
            "overrides": sum(g[2] for g in gates), "gates": len(gates),
            "aggregates": int(sum(aggregates)), "replayed": int(sum(replayed)),
            "applied": sum(r["applied"] for r in records),
            "push_s": statistics.median(r["push"] for r in records),
            "updates_per_s": len(records) / span}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20, help="pushes per worker per run")
    ap.add_argument("--model-mib", type=float, default=1.0)
    ap.add_argument("--mbit", type=float, default=200.0)
    ap.add_argument("--correlation", type=float, default=0.9,
                    help="share of a common direction in every update (0: independent)")
    ap.add_argument("--aggregate", action="store_true",
                    help=f"route groups through {AGGREGATORS} aggregators")
    ap.add_argument("--max-fan-in", type=int, default=4)
    ap.add_argument("--fast-mbit", type=float, default=1000.0,
                    help="with --aggregate: every link but the servers'")
    ap.add_argument("--factors", default="1,2,inf",
                    help="Div_max as multiples of sqrt(S) times a shard's largest single step")
    args = ap.parse_args()
    from mlfabric.client.shards import shard_info
    from mlfabric.kernels import _core
    from mlfabric.sharding.partition import partition
    from mlfabric.tools.testbed import Testbed, require_root
    from mlfabric.wire import auth

    require_root()
    if args.shards < 2:
        ap.error("--shards must be at least 2")
    n = int(args.model_mib * (1 << 20)) // 4
    init = {"w": np.random.default_rng(0).standard_normal(n).astype(np.float32)}
    part = partition([("w", init["w"].dtype, init["w"].shape)], args.shards)
    args.parts = [(p, shard_info(part, i)) for i, p in enumerate(part.split(init))]
    a_max = max(math.sqrt(sum(_core.l2_norm(a) ** 2 for a in p.values()))
                for w in range(args.workers) for i in range(args.steps)
                for p in part.split(make_update(n, 1000 * w + i, args.correlation)))
    # A shard's ||a|| + gamma B with B <= ||a|| / (1 - gamma); an aggregate's
    # step is the sum of up to max_fan_in updates.
    step = a_max * (args.max_fan_in if args.aggregate else 1) / (1 - GAMMA)
    factors = [float(f) for f in args.factors.split(",")]
    runs: dict[float, list[dict[str, Any]]] = {f: [] for f in factors}
    with tempfile.TemporaryDirectory(prefix="mlfabric-bench-shard-div-") as tmp, \
            Testbed(hosts=2 * args.shards + 1 + args.workers
                    + (AGGREGATORS if args.aggregate else 0),
                    rate_mbit=args.fast_mbit if args.aggregate else args.mbit,
                    rates={f"h{i}": (args.mbit, args.mbit) for i in range(args.shards)}
                    if args.aggregate else None) as tb:
        token = Path(tmp) / "job.token"
        token.write_text(auth.generate_token())
        token.chmod(0o600)
        for r in range(args.rounds):
            order = factors[r % len(factors):] + factors[:r % len(factors)]
            for f in order:
                res = one_run(tb, tmp, args, f * math.sqrt(args.shards) * step * 1.001)
                runs[f].append(res)
                print(f"round {r + 1} div_max {f:g} x sqrt({args.shards}) x {step:.3f}: "
                      + "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                  for k, v in res.items()), flush=True)
    print()
    print(f"{args.shards} shards with a replica each, {args.workers} workers x {args.steps} "
          f"steps, {args.model_mib} MiB model, links {args.mbit:g} Mbit/s, momentum {GAMMA}, "
          f"correlation {args.correlation}; a shard's largest single step {step:.3f}"
          + (f" (aggregates of up to {args.max_fan_in} through {AGGREGATORS} aggregators; "
             f"aggregates applied / replayed by the replicas per run: "
             + ", ".join(f"{r['aggregates']}/{r['replayed']}" for f in factors
                         for r in runs[f]) + ")" if args.aggregate else ""))
    print(f"  {'div_max':>10s} {'per shard':>10s} {'samples':>8s} {'max meas.':>10s} "
          f"{'max/bound':>10s} "
          f"{'held':>6s} {'overrides':>9s} {'push s':>8s} {'upd/s':>8s}")
    for f in factors:
        rs = runs[f]
        x = f * math.sqrt(args.shards) * step * 1.001
        print(f"  {x:10.3f} {x / math.sqrt(args.shards):10.3f} "
              f"{sum(sum(r['samples']) for r in rs):8d} "
              f"{max(r['max_measured'] for r in rs):10.4f} "
              f"{max(r['max_over_bound'] for r in rs):10.4f} "
              f"{statistics.median(r['held'] for r in rs):6.0f} "
              f"{statistics.median(r['overrides'] for r in rs):9.0f} "
              f"{statistics.median(r['push_s'] for r in rs):8.4f} "
              f"{statistics.median(r['updates_per_s'] for r in rs):8.2f}")
    print("  max/bound: the largest measured ||w_s - w_r|| of any shard over its bound "
          "(div_max / sqrt(S)); at most 1 is the goal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
