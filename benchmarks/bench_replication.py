"""Worker-driven vs chain replication, on an emulated cluster (needs root).

h0 runs the server, h1 the replica, h2.. one worker each; every link is
shaped to --mbit. Each worker loops: pull the model, push an update of the
model's size, wait until it is acknowledged. "Acknowledged" is the same in
both modes: on the server and on the replica.

  none    no replica (the reference: what replication costs)
  chain   mlfabric server --replicate-to: the server forwards every update
          to the replica and answers once the replica applied it
  worker  connect(..., replica=): the worker sends the update to the server,
          then straight to the replica with the server's version

Modes alternate within every round. Per mode, medians over rounds of: the
median push-to-acknowledged time, the median pull time, the updates per
second over the span of the steps (worker start-up excluded), and
the server's egress bytes per update (its NIC's tx_bytes counter, so pulls,
answers and chain forwarding are all in it).

    sudo python benchmarks/bench_replication.py [--rounds 3] [--workers 4]
        [--steps 8] [--model-mib 2] [--mbit 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from mlfabric.tools.workload import serving_address

JOB = "bench-replication"
MODES = ("none", "chain", "worker")


def worker(argv: list[str]) -> int:
    import mlfabric

    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--replica", default=None)
    p.add_argument("--token-file", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    records = []
    with mlfabric.connect(args.server, job=JOB, token_file=args.token_file, timeout=30,
                          replica=args.replica) as ps:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            version, params = ps.pull(timeout=120)
            t1 = time.perf_counter()
            update = {n: (1e-4 * rng.standard_normal(a.shape)).astype(np.float32)
                      for n, a in params.items()}
            t2 = time.perf_counter()
            outcome = ps.push(update, base_version=version).result(300)
            t3 = time.perf_counter()
            if not outcome.applied:
                raise RuntimeError(f"update not applied: {outcome}")
            records.append({"pull": t1 - t0, "push": t3 - t2, "t0": t0, "t3": t3})
    Path(args.out).write_text(json.dumps(records))
    return 0


def tx_bytes(tb: Any, host: Any) -> int:
    out = subprocess.run(host.exec_argv(["cat", f"/sys/class/net/{host.ifname}/statistics/"
                                                "tx_bytes"]),
                         capture_output=True, text=True, check=True).stdout
    return int(out)


def run_mode(tb: Any, mode: str, tmp: str, args: argparse.Namespace, seed: int
             ) -> dict[str, float]:
    server, replica_host, *workers = tb.hosts
    token = f"{tmp}/job.token"
    py = [sys.executable, "-m", "mlfabric", "--log-level", "WARNING"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    kw: dict[str, Any] = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=tmp, env=env)
    common = ["--job", JOB, "--token-file", token, "--init", f"{tmp}/init.npz",
              "--momentum", "0.9", "--tau-max", "-1"]
    procs = []
    try:
        rep_addr = None
        if mode != "none":
            rep = tb.popen(replica_host, [*py, "server", "--role", "replica", "--listen",
                                          f"{replica_host.ip}:0", *common], **kw)
            procs.append(rep)
            rep_addr = serving_address(rep, "replica")
        chain = ["--replicate-to", rep_addr] if mode == "chain" and rep_addr else []
        srv = tb.popen(server, [*py, "server", "--listen", f"{server.ip}:0", *common, *chain],
                       **kw)
        procs.append(srv)
        srv_addr = serving_address(srv, "server")
        sent_before = tx_bytes(tb, server)
        workers_p = []
        for i, h in enumerate(workers):
            argv = [sys.executable, os.path.abspath(__file__), "--worker", "--server", srv_addr,
                    "--token-file", token, "--steps", str(args.steps),
                    "--seed", str(seed * 100 + i), "--out", f"{tmp}/w{i}.json"]
            if mode == "worker" and rep_addr:
                argv += ["--replica", rep_addr]
            workers_p.append(tb.popen(h, argv, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True, cwd=tmp, env=env))
        records: list[dict[str, float]] = []
        for i, p in enumerate(workers_p):
            if p.wait(timeout=600) != 0:
                raise RuntimeError(f"worker {i} failed: {p.stderr.read()[-2000:]}")
            records += json.loads(Path(f"{tmp}/w{i}.json").read_text())
        egress = tx_bytes(tb, server) - sent_before
    finally:
        for p in procs:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    updates = len(records)
    # perf_counter is CLOCK_MONOTONIC, one clock for every process here: the
    # span of the training steps, without the workers' start-up.
    wall = max(r["t3"] for r in records) - min(r["t0"] for r in records)
    return {"push_s": statistics.median(r["push"] for r in records),
            "push_mean_s": statistics.fmean(r["push"] for r in records),
            "pull_s": statistics.median(r["pull"] for r in records),
            "steps_per_s": updates / wall,
            "egress_mib_per_update": egress / updates / (1 << 20),
            "wall_s": wall}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8, help="pushes per worker per run")
    ap.add_argument("--model-mib", type=float, default=2.0)
    ap.add_argument("--mbit", type=float, default=200.0, help="every link, up and down")
    args = ap.parse_args()
    from mlfabric.tools.testbed import Testbed, require_root
    from mlfabric.wire import auth

    require_root()
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="mlfabric-bench-repl-") as tmp, \
            Testbed(hosts=args.workers + 2, rate_mbit=args.mbit) as tb:
        token = Path(tmp) / "job.token"
        token.write_text(auth.generate_token())
        token.chmod(0o600)
        n = int(args.model_mib * (1 << 20)) // 4
        np.savez(f"{tmp}/init.npz", w=np.zeros(n, np.float32))
        for r in range(args.rounds):
            order = MODES[r % 3:] + MODES[:r % 3]
            for mode in order:
                result = run_mode(tb, mode, tmp, args, seed=r)
                runs[mode].append(result)
                print(f"round {r + 1} {mode:6s} " + "  ".join(
                    f"{k} {v:.4f}" for k, v in result.items()), flush=True)

    def med(mode: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[mode])

    print()
    print(f"medians of {args.rounds} rounds ({args.workers} workers, {args.model_mib} MiB "
          f"updates, every link {args.mbit:g} Mbit/s, {args.steps} steps per worker)")
    keys = ["push_s", "push_mean_s", "pull_s", "steps_per_s", "egress_mib_per_update", "wall_s"]
    print(f"  {'':24s}" + "".join(f"{h:>10s}" for h in MODES) + f"{'worker/chain':>14s}")
    for k in keys:
        vals = [med(m, k) for m in MODES]
        ratio = vals[2] / vals[1] if vals[1] else float("nan")
        print(f"  {k:24s}" + "".join(f"{v:10.4f}" for v in vals) + f"{ratio:14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
