"""Sharded servers on the emulated cluster: does throughput grow with S?

Issue 30's goal: 8 workers push and pull a 64 MiB model; with S = 1, 2, 4
and 8 server shards (one per server host, each host's link shaped), the
job's aggregate throughput is at least 0.85 * S times the S = 1 figure, and
every shard receives within 5% of the mean bytes.

Each worker (its own host, a fast link) connects, pulls the model, waits at
the start line, then does `--rounds` rounds of push (an update of the whole
model) and pull; the time of a configuration is from the start to the last
worker's end, and its throughput the bytes moved (2 x model x rounds x
workers) over that time. The configurations alternate within every repeat
(the order rotates from repeat to repeat), and the ratios are per repeat,
then their median. Besides the ratio to S = 1 the table gives the ratio to
the physical limit: S server links, each carrying pushes in and pulls out
at the shaped rate at once.

    sudo python benchmarks/bench_shards.py [--workers 8] [--model-mib 64]
        [--server-mbit 100] [--worker-mbit 1000] [--shards 1,2,4,8] [--repeats 3]
        [--rounds 1] [--queue-ms 50]

Needs root (network namespaces). The model: one embedding of half the size,
fifteen of 1/40 of it, 100 of 1 KiB and the rest in one head (as a language
model).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

JOB = "bench-shards"
METRICS_PORT = 9461
TOKEN = b"LZOCIY7dpJlBseQd7WFHxOuZfBP-lw-b1w2dFVvkE7I"  # random


def make_model(total_bytes: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    floats = total_bytes // 4
    sizes = {"embedding": floats // 2}
    for i in range(15):
        sizes[f"layer{i:02d}"] = floats // 40
    for i in range(100):
        sizes[f"norm{i:03d}"] = 256
    sizes["head"] = floats - sum(sizes.values())
    return {n: rng.standard_normal(k, dtype=np.float32) * 0.01 for n, k in sizes.items()}


# -- the worker (a process on its own host) ---------------------------------------------


def worker(args: argparse.Namespace) -> int:
    import mlfabric

    controller = {"controller": args.controller, "controller_fallback": "wait"} \
        if args.controller else {}
    with mlfabric.connect(args.servers, job=JOB, token_file=args.token_file,
                          timeout=60, push_timeout=600, **controller) as ps:
        version, model = ps.pull(timeout=600)
        update = {n: np.zeros_like(a) for n, a in model.items()}
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            return 1
        t0 = time.perf_counter()
        for _ in range(args.rounds):
            outcome = ps.push(update, base_version=version).result(600)
            if not outcome.applied:
                print(f"refused: {outcome.reason}", flush=True)
                return 1
            version, model = ps.pull(timeout=600)
        print(f"done {time.perf_counter() - t0:.6f}", flush=True)
    return 0


# -- the driver -------------------------------------------------------------------------


def popen(tb, host, argv: list[str], tmp: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OPENBLAS_NUM_THREADS": "1",
           "OMP_NUM_THREADS": "1"}
    return tb.popen(host, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True, cwd=tmp, env=env)


def race(workers: list[subprocess.Popen[str]]) -> float:
    """Start the workers waiting at the start line; seconds until the last is done."""
    from mlfabric.tools.workload import wait_for_line

    t0 = time.perf_counter()
    for p in workers:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    for w, p in enumerate(workers):
        wait_for_line(p, "done", f"worker {w}", timeout=1800)
    return time.perf_counter() - t0


def stop(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def job_files(tmp: Path, model: dict[str, np.ndarray]) -> tuple[Path, Path]:
    """The job's token file (private) and its --init model, written in `tmp`."""
    token = tmp / "job.token"
    token.write_bytes(TOKEN)
    token.chmod(0o600)
    init = tmp / "init.npz"
    np.savez(init, **model)
    return token, init


def start_workers(tb, hosts: list, addresses: str, token: Path, tmp: Path, rounds: int,
                  workers: list[subprocess.Popen[str]], controller: str | None = None) -> None:
    """A worker on each of `hosts`, appended to `workers` as it starts (the
    caller stops them, whatever fails), then waited for at the start line."""
    from mlfabric.tools.workload import wait_for_line

    via = ["--controller", controller] if controller else []
    for host in hosts:
        workers.append(popen(tb, host, [
            sys.executable, str(Path(__file__).resolve()), "worker", "--servers", addresses,
            "--token-file", str(token), "--rounds", str(rounds), *via], tmp))
    for w, p in enumerate(workers):
        wait_for_line(p, "ready", f"worker {w}", timeout=900)


def run_one(tb, s: int, args: argparse.Namespace, tmp: Path, init: Path, token: Path
            ) -> dict[str, float | list[float]]:
    from mlfabric.tools.workload import scrape_metrics, serving_address

    py = [sys.executable, "-m", "mlfabric", "--log-level", "WARNING"]
    servers, workers = [], []
    try:
        for i in range(s):
            host = tb.host(f"h{i}")
            shard = ["--shard", f"{i}/{s}"] if s > 1 else []
            servers.append(popen(tb, host, [
                *py, "server", "--listen", f"{host.ip}:0", "--job", JOB, "--token-file",
                str(token), "--init", str(init), "--tau-max", "-1", "--metrics-port",
                str(METRICS_PORT), "--metrics-host", host.ip, *shard], tmp))
        addresses = ",".join(serving_address(p, f"shard {i}", timeout=120)
                             for i, p in enumerate(servers))
        start_workers(tb, [tb.host(f"h{args.max_shards + w}") for w in range(args.workers)],
                      addresses, token, tmp, args.rounds, workers)

        def received() -> list[float]:
            return [scrape_metrics(tb.host(f"h{i}"), METRICS_PORT)
                    ["mlfabric_server_received_bytes_total"] for i in range(s)]

        before = received()
        seconds = race(workers)
        per_shard = [b - a for a, b in zip(before, received(), strict=True)]
    finally:
        stop(workers + servers)
    moved = 2 * args.model_bytes * args.rounds * args.workers
    return {"seconds": seconds, "throughput": moved / seconds, "per_shard": per_shard}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    w = sub.add_parser("worker")
    w.add_argument("--servers", required=True)
    w.add_argument("--token-file", required=True)
    w.add_argument("--rounds", type=int, default=1)
    w.add_argument("--controller", default=None)  # bench_chunks.py: through a controller
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--model-mib", type=int, default=64)
    ap.add_argument("--server-mbit", type=float, default=100.0)
    ap.add_argument("--worker-mbit", type=float, default=1000.0)
    ap.add_argument("--queue-ms", type=float, default=50.0)
    ap.add_argument("--shards", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    if args.cmd == "worker":
        return worker(args)

    from mlfabric.tools.testbed import Testbed, require_root

    require_root()
    shards = [int(x) for x in args.shards.split(",")]
    if 1 not in shards:
        ap.error("--shards must include 1 (the ratios are to S = 1)")
    args.max_shards = max(shards)
    model = make_model(args.model_mib << 20)
    args.model_bytes = sum(a.nbytes for a in model.values())
    rates = {f"h{i}": (args.server_mbit, args.server_mbit) for i in range(args.max_shards)}
    print(f"{args.workers} workers, model {args.model_bytes / 2**20:.1f} MiB "
          f"({len(model)} tensors), server links {args.server_mbit:g} Mbit/s each way, "
          f"worker links {args.worker_mbit:g} Mbit/s, {args.rounds} round(s) of push + pull, "
          f"{args.repeats} repeats, S = {shards}", flush=True)
    results: dict[int, list[dict]] = {s: [] for s in shards}
    with tempfile.TemporaryDirectory(prefix="bench-shards-") as d:
        tmp = Path(d)
        token, init = job_files(tmp, model)
        with Testbed(hosts=args.max_shards + args.workers, rate_mbit=args.worker_mbit,
                     rates=rates, mtu=9000, queue_ms=args.queue_ms) as tb:
            for r in range(args.repeats):
                order = shards[r % len(shards):] + shards[:r % len(shards)]
                for s in order:
                    res = run_one(tb, s, args, tmp, init, token)
                    results[s].append(res)
                    print(f"  repeat {r + 1}/{args.repeats}  S={s}  {res['seconds']:7.1f} s  "
                          f"{res['throughput'] / 1e6:7.2f} MB/s", flush=True)
    link = args.server_mbit * 1e6 / 8
    print()
    print(f"{'S':>3} {'MB/s':>8} {'x S=1':>7} {'goal':>6} {'/ limit':>8} {'shard bytes':>12}")
    for s in shards:
        runs = results[s]
        ratio = statistics.median(x["throughput"] / y["throughput"]
                                  for x, y in zip(runs, results[1], strict=True))
        limit = statistics.median(x["throughput"] / (2 * s * link) for x in runs)
        spread = max(max(abs(b / statistics.mean(x["per_shard"]) - 1) for b in x["per_shard"])
                     for x in runs)
        print(f"{s:3d} {statistics.median(x['throughput'] for x in runs) / 1e6:8.2f} "
              f"{ratio:7.2f} {0.85 * s:6.2f} {limit:8.2f} {'+-':>6}{spread * 100:4.1f}%")
    print("x S=1: median over repeats of the throughput over that repeat's S = 1; goal "
          "0.85 x S. / limit: over S server links moving pushes in and pulls out at the "
          "shaped rate. shard bytes: the largest deviation of a shard's received bytes from "
          "the mean (goal within 5%).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
