"""Failover per shard on an emulated cluster: a random shard's server process
is SIGKILLed at random points of each run (needs root).

Issue 31's measure: S shards (4) on hosts of their own, each with a replica
on another host, the controller on one more (heartbeats to every shard,
promotes the lost shard's replica), and one worker per host (8); every link
is shaped to --mbit. Workers pull, push and wait for the acknowledgement
(every part on its shard and that shard's replica), with worker-driven
replication and failover on. --kills times per run (5) a shard chosen at
random loses its server, once the shards have applied a random number of
updates between them (uniform over 10-80 % of the run's, distinct,
increasing); after each loss but the last, a new replica joins that shard
(`mlfabric server --role replica --join-from PROMOTED --controller ...`) on
the host the lost server ran on, and a later kill of that shard waits until
the workers feed it.

The workers train the demo's MLP (mlfabric.tools.demo_model) on
scikit-learn's bundled digits, one data shard each, spending --compute-ms
more per step (100) as if computing a larger model's gradient; every run
with kills is followed by a run without (same seeds, steps and processes),
so the held-out accuracy of the two can be compared (goal: within 0.01).

Per run it reports, for every kill, the time to the acknowledgement of a
step begun after it (training resumed; goal: within 2 s); whether each
shard's acknowledged versions are exactly 1..N (none lost, none applied
twice); whether the final model (pulled from every shard's current server)
equals the numpy replay of every acknowledged part, each shard's in that
shard's version order, bit for bit; and the final model's held-out
accuracy.

With --aggregate, the controller (`--policy mlfabric`) routes groups of
up to --max-fan-in parts per shard through two aggregators (`mlfabric agent
--aggregate` on hosts of their own, --group-wait 0.1 s), the workers still
feeding every shard's replica: each aggregate reaches a replica as its
members, so a promoted replica holds it as the server's one step. Only the
servers' and replicas' links are shaped to --mbit then (where a group
pays); the others run at --fast-mbit, and the controller is told both. The
replay then applies each aggregate as one step with its members' sum.

    sudo python benchmarks/bench_shard_failover.py [--runs 5] [--shards 4]
        [--workers 8] [--steps 60] [--compute-ms 100] [--kills 5] [--mbit 200]
        [--heartbeat-timeout 0.5] [--seed 0] [--aggregate] [--max-fan-in 4]
        [--fast-mbit 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_failover import Recorder, collect, pong, replay, steps, wait_for

from mlfabric.tools.token_cli import agent_secrets
from mlfabric.tools.workload import serving_address, wait_for_line

JOB = "bench-failover"  # bench_failover's helpers speak to this job
AGGREGATORS = 2  # with --aggregate
AGGREGATE_PORT = 7401
AGENT_PORT = 7400


def worker(argv: list[str]) -> int:
    import mlfabric
    from mlfabric.tools import demo_model as dm

    p = argparse.ArgumentParser()
    for flag in ("--servers", "--replicas", "--controller", "--token-file", "--out"):
        p.add_argument(flag, required=True)
    for flag in ("--steps", "--index", "--workers"):
        p.add_argument(flag, type=int, required=True)
    p.add_argument("--eta", type=float, required=True)
    p.add_argument("--compute-ms", type=float, required=True)
    args = p.parse_args(argv)
    with mlfabric.connect(args.servers, job=JOB, token_file=args.token_file, timeout=30,
                          controller=args.controller, controller_fallback="wait",
                          replica=args.replicas, failover_timeout=30) as ps:
        rec = Recorder(ps, args.compute_ms / 1000)
        X, y, _, _ = dm.load_digits_split()
        Xs, ys = dm.shard(X, y, args.workers, args.index)
        dm.train_worker(rec, Xs, ys, steps=args.steps, batch_size=dm.DEFAULTS["batch_size"],
                        eta=args.eta, seed=args.index, timeout=120)
    np.savez(f"{args.out}.npz", **rec.updates)
    Path(f"{args.out}.json").write_text(json.dumps(rec.records))
    return 0


class Shard:
    """Where one shard's server and replica run now."""

    def __init__(self, server: tuple[Any, str, Any], replica: tuple[Any, str, Any]) -> None:
        self.proc, self.addr, self.host = server
        self.rep_proc, self.rep_addr, self.rep_host = replica
        self.fed_from: int | None = None  # a joined replica's version when it served


def one_run(tb: Any, tmp: str, args: argparse.Namespace, rng: random.Random,
            kills: int, tag: str) -> dict[str, Any]:
    import mlfabric
    from mlfabric.sharding.partition import partition

    S = args.shards
    hosts = tb.hosts
    server_hosts, replica_hosts = hosts[:S], hosts[S:2 * S]
    ctl_host, workers = hosts[2 * S], hosts[2 * S + 1:2 * S + 1 + args.workers]
    aggs = hosts[2 * S + 1 + args.workers:] if args.aggregate else []
    token = f"{tmp}/job.token"
    secret = Path(token).read_bytes().strip()
    py = [sys.executable, "-m", "mlfabric", "--log-level", "WARNING"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    kw: dict[str, Any] = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=tmp, env=env)
    common = ["--job", JOB, "--token-file", token, "--momentum", str(args.gamma),
              "--tau-max", "-1"]
    init = ["--init", f"{tmp}/init.npz"]
    total = args.workers * args.steps  # pushes; each a part at every shard
    targets = sorted(rng.sample(range(total // 10, total * 8 // 10), kills))
    procs: list[subprocess.Popen[str]] = []
    kill_times: list[float] = []
    killed_shards: list[int] = []
    try:
        shards = []
        for i in range(S):
            flag = ["--shard", f"{i}/{S}"]
            rep = tb.popen(replica_hosts[i], [*py, "server", "--role", "replica", "--listen",
                                              f"{replica_hosts[i].ip}:0", *common, *init,
                                              *flag], **kw)
            srv = tb.popen(server_hosts[i], [*py, "server", "--listen",
                                             f"{server_hosts[i].ip}:0", *common, *init, *flag],
                           **kw)
            procs += [rep, srv]
            shards.append(Shard((srv, serving_address(srv, f"shard {i}"), server_hosts[i]),
                                (rep, serving_address(rep, f"replica {i}"),
                                 replica_hosts[i])))
        routing = ["--policy", "fifo"]
        if aggs:
            routing = ["--policy", "mlfabric", "--max-fan-in", str(args.max_fan_in),
                       "--group-wait", "0.1", "--default-link-mbit", str(args.fast_mbit),
                       *(f"--link={h.ip}={args.mbit:g}/{args.mbit:g}"
                         for h in hosts[:2 * S]),
                       *(f"--aggregator={a.ip}={a.ip}:{AGGREGATE_PORT}" for a in aggs)]
            for a in aggs:
                agent = tb.popen(a, [
                    *py, "agent", "--name", a.ip, "--listen", f"{a.ip}:{AGENT_PORT}",
                    "--aggregate", f"{a.ip}:{AGGREGATE_PORT}", "--job", JOB, "--token-file",
                    token, "--cluster-token-file", str(agent_secrets(Path(tmp), JOB)[0]),
                    # the shards and, after a failover, their replicas
                    "--servers", ",".join(x for sh in shards for x in (sh.addr, sh.rep_addr))],
                    **kw)
                procs.append(agent)
                wait_for_line(agent, "aggregating", f"aggregator on {a.name}", timeout=120)
        ctl = tb.popen(ctl_host, [
            *py, "controller", "--listen", f"{ctl_host.ip}:0", "--job", JOB, "--token-file",
            token, *routing, "--tau-max", "-1",
            "--server", ",".join(s.addr for s in shards),
            "--replica", ",".join(s.rep_addr for s in shards),
            "--heartbeat-interval", str(args.heartbeat_timeout / 5),
            "--heartbeat-timeout", str(args.heartbeat_timeout)], **kw)
        procs.append(ctl)
        ctl_addr = serving_address(ctl, "controller")
        workers_p = []
        for i, h in enumerate(workers):
            workers_p.append(tb.popen(h, [
                sys.executable, os.path.abspath(__file__), "--worker",
                "--servers", ",".join(s.addr for s in shards),
                "--replicas", ",".join(s.rep_addr for s in shards),
                "--controller", ctl_addr, "--token-file", token, "--eta", str(args.eta),
                "--compute-ms", str(args.compute_ms), "--workers", str(args.workers),
                "--steps", str(args.steps), "--index", str(i), "--out", f"{tmp}/{tag}-w{i}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp,
                env=env))
        for k, target in enumerate(targets):
            i = rng.randrange(S)
            s = shards[i]
            # A random point of the run (every shard applies every push, so
            # the chosen shard's version counts pushes), and, if this shard
            # lost its server before, not before the workers feed the
            # replica that joined it.
            wait_for(f"kill {k + 1} (shard {i}) at version {target}", s.host, s.addr, secret,
                     lambda p, target=target: p.version >= target, workers_p)
            if s.fed_from is not None:
                wait_for(f"the workers feeding shard {i}'s joined replica", s.rep_host,
                         s.rep_addr, secret,
                         lambda p, v=s.fed_from + 2 * args.workers: p.version >= v, workers_p)
            s.proc.send_signal(signal.SIGKILL)
            kill_times.append(time.perf_counter())
            killed_shards.append(i)
            wait_for(f"shard {i}'s promotion", s.rep_host, s.rep_addr, secret,
                     lambda p: p.role == "server", workers_p, timeout=30)
            lost_host = s.host
            s.proc, s.addr, s.host = s.rep_proc, s.rep_addr, s.rep_host
            if k == kills - 1:
                break
            # A new replica joins the shard from the promoted server's state,
            # on the host the lost server ran on.
            new = tb.popen(lost_host, [
                *py, "server", "--role", "replica", "--listen", f"{lost_host.ip}:0", *common,
                "--join-from", s.addr, "--controller", ctl_addr, "--shard", f"{i}/{S}"], **kw)
            procs.append(new)
            s.rep_proc, s.rep_addr, s.rep_host = new, serving_address(
                new, f"replica joining shard {i}"), lost_host
            s.fed_from = pong(s.rep_host, s.rep_addr, secret).version
        records, updates = collect(workers_p, tmp, tag, timeout=900)
        with ctl_host.enter(), mlfabric.connect(",".join(s.addr for s in shards), job=JOB,
                                                token_file=token, timeout=30) as ps:
            final_versions, final = ps.pull(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    acked = [r for r in records if r.get("applied")]
    start = dict(np.load(f"{tmp}/init.npz"))
    part = partition([(n, a.dtype, a.shape) for n, a in start.items()], S,
                     args.chunk_bytes)
    expected = {n: np.empty_like(a) for n, a in start.items()}
    exact = True
    aggregated = 0  # parts applied as members of an aggregate
    for i in range(S):
        # Shard i applied the parts in its own order: each alone or as a
        # member of an aggregate (one step with the members' sum).
        placed = [(r["place"][i][0], r["place"][i][1], updates[r["u"]]) for r in acked]
        aggregated += sum(k > 1 for _, k, _ in placed)
        shard_steps, shard_exact = steps(placed)
        exact &= shard_exact and final_versions[i] == len(placed)
        ref = replay(start, shard_steps, args.gamma)
        part.put(expected, i, part.split(ref)[i])
    resumed = []
    for killed_at in kill_times:
        after = [r["t"] - killed_at for r in records if r["t_pull"] > killed_at and "t" in r]
        resumed.append(min(after) if after else float("nan"))
    from mlfabric.tools import demo_model as dm

    _, _, X_test, y_test = dm.load_digits_split()
    return {
        "kills": len(kill_times), "shards_killed": killed_shards, "pushed": len(records),
        "acked": len(acked), "aggregated": aggregated, "versions_exact": exact,
        "replay_equal": all(np.array_equal(expected[n].view(np.uint32),
                                           final[n].view(np.uint32)) for n in expected),
        "resumed_s": resumed, "accuracy": dm.accuracy(final, X_test, y_test)}


def _fmt(res: dict[str, Any]) -> str:
    return "  ".join(f"{k} {[round(x, 3) for x in v]}" if isinstance(v, list)
                     else f"{k} {round(v, 4) if isinstance(v, float) else v}"
                     for k, v in res.items())


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=60, help="pushes per worker per run")
    ap.add_argument("--compute-ms", type=float, default=100.0)
    ap.add_argument("--mbit", type=float, default=200.0)
    ap.add_argument("--heartbeat-timeout", type=float, default=0.5)
    ap.add_argument("--kills", type=int, default=5, help="shard servers lost per run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--aggregate", action="store_true",
                    help=f"route groups through {AGGREGATORS} aggregators")
    ap.add_argument("--max-fan-in", type=int, default=4)
    ap.add_argument("--fast-mbit", type=float, default=1000.0,
                    help="with --aggregate: every link but the servers' and replicas'")
    args = ap.parse_args()
    from mlfabric.sharding.partition import DEFAULT_CHUNK_BYTES
    from mlfabric.tools import demo_model as dm
    from mlfabric.tools.testbed import Testbed, require_root
    from mlfabric.wire import auth

    require_root()
    args.gamma, args.eta = dm.DEFAULTS["gamma"], dm.DEFAULTS["eta"]
    args.chunk_bytes = DEFAULT_CHUNK_BYTES  # the servers' default --chunk-bytes
    total = args.workers * args.steps
    if args.shards < 2 or not 0 <= args.kills <= total * 7 // 10:
        ap.error(f"--shards must be at least 2, and --kills {args.kills} needs at least "
                 f"{args.kills / 0.7:.0f} pushes per run (--workers x --steps is {total})")
    rng = random.Random(args.seed)
    killed: list[dict[str, Any]] = []
    clean: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mlfabric-bench-shard-failover-") as tmp, \
            Testbed(hosts=2 * args.shards + 1 + args.workers
                    + (AGGREGATORS if args.aggregate else 0),
                    rate_mbit=args.fast_mbit if args.aggregate else args.mbit,
                    rates={f"h{i}": (args.mbit, args.mbit) for i in range(2 * args.shards)}
                    if args.aggregate else None) as tb:
        token = Path(tmp) / "job.token"
        token.write_text(auth.generate_token())
        token.chmod(0o600)
        np.savez(f"{tmp}/init.npz", **dm.init_params(seed=args.seed))
        for r in range(args.runs):
            for kills, runs, label in ((args.kills, killed, "kills"), (0, clean, "no kill")):
                t0 = time.monotonic()
                res = one_run(tb, tmp, args, rng, kills, f"{label[0]}{r}")
                res["seconds"] = time.monotonic() - t0
                runs.append(res)
                print(f"run {r + 1}, {label}: {_fmt(res)}", flush=True)
    resumed = [x for r in killed for x in r["resumed_s"]]
    print()
    print(f"{args.runs} runs, {args.shards} shards with a replica each, {args.workers} workers "
          f"x {args.steps} steps, digits MLP, {args.compute_ms:g} ms of computation per "
          f"step, links {args.mbit:g} Mbit/s, heartbeat timeout {args.heartbeat_timeout} s")
    if resumed:
        print(f"  resumed after each of {len(resumed)} kills: median "
              f"{statistics.median(resumed):.3f} s, max {max(resumed):.3f} s (goal 2 s)")
    for label, rs in (("with kills", killed), ("without", clean)):
        accs = [r["accuracy"] for r in rs]
        print(f"  {label}: every shard's versions exact {all(r['versions_exact'] for r in rs)},"
              f" final model == per-shard numpy replay {all(r['replay_equal'] for r in rs)}, "
              f"held-out accuracy median {statistics.median(accs):.4f} (min {min(accs):.4f}, "
              f"max {max(accs):.4f}), median run "
              f"{statistics.median(r['seconds'] for r in rs):.1f} s")
    if killed and clean:
        gap = statistics.median(r["accuracy"] for r in killed) - statistics.median(
            r["accuracy"] for r in clean)
        print(f"  accuracy with kills - without: {gap:+.4f} (goal within 0.01)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
