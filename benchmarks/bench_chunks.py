"""What letting a sharded job's parts go a chunk at a time costs.

With a controller, a part larger than the partition's chunk goes a chunk at
a time: the client sends a chunk, waits until its bytes have left, reports
it, and the controller lets the next one go (or a shorter transfer first).
This benchmark measures the price of those round trips on the emulated
cluster: the job of `bench_shards.py` (8 workers push and pull a 64 MiB
model over S = 2 shards on shaped server links) through a controller with
`--chunks` and with `--no-chunks`, alternated within every repeat; the
ratio is per repeat, then the median. A ratio of 1.00 means the grants cost
nothing measurable; every transfer of one job is the same size here, so
there is nothing for a chunk boundary to let pass (the benefit is in
tests/test_control.py's plans).

    sudo python benchmarks/bench_chunks.py [--workers 8] [--model-mib 64]
        [--shards 2] [--server-mbit 100] [--chunk-mib 4] [--repeats 3]

Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from bench_shards import (
    JOB,
    METRICS_PORT,
    job_files,
    make_model,
    popen,
    race,
    start_workers,
    stop,
)

CONFIGS = ("chunks", "whole")


def run_one(tb, config: str, args: argparse.Namespace, tmp: Path, init: Path, token: Path
            ) -> dict[str, float]:
    from mlfabric.tools.workload import scrape_metrics, serving_address

    py = [sys.executable, "-m", "mlfabric", "--log-level", "WARNING"]
    procs, workers = [], []
    try:
        ctl_host = tb.host(f"h{args.shards + args.workers}")
        links = [f"--link=h{i}={args.server_mbit:g}/{args.server_mbit:g}"
                 for i in range(args.shards)]
        procs.append(popen(tb, ctl_host, [
            *py, "controller", "--listen", f"{ctl_host.ip}:0", "--job", JOB, "--token-file",
            str(token), "--tau-max", "-1", "--metrics-port", str(METRICS_PORT),
            "--metrics-host", ctl_host.ip, "--chunks" if config == "chunks" else "--no-chunks",
            "--default-link-mbit", str(args.worker_mbit), *links], tmp))
        controller = serving_address(procs[0], "controller", timeout=120)
        for i in range(args.shards):
            host = tb.host(f"h{i}")
            procs.append(popen(tb, host, [
                *py, "server", "--listen", f"{host.ip}:0", "--job", JOB, "--token-file",
                str(token), "--init", str(init), "--tau-max", "-1", "--shard",
                f"{i}/{args.shards}", "--chunk-bytes", str(args.chunk_mib << 20)], tmp))
        addresses = ",".join(serving_address(p, f"shard {i}", timeout=120)
                             for i, p in enumerate(procs[1:]))
        start_workers(tb, [tb.host(f"h{args.shards + w}") for w in range(args.workers)],
                      addresses, token, tmp, args.rounds, workers, controller)
        seconds = race(workers)
        grants = scrape_metrics(ctl_host, METRICS_PORT)["mlfabric_controller_chunk_grants_total"]
    finally:
        stop(workers + procs)
    moved = 2 * args.model_bytes * args.rounds * args.workers
    return {"seconds": seconds, "throughput": moved / seconds, "grants": grants}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--model-mib", type=int, default=64)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--server-mbit", type=float, default=100.0)
    ap.add_argument("--worker-mbit", type=float, default=1000.0)
    ap.add_argument("--chunk-mib", type=int, default=4)
    ap.add_argument("--queue-ms", type=float, default=50.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    if args.shards < 2:
        ap.error(f"--shards must be at least 2 (chunks are for sharded jobs), got {args.shards}")

    from mlfabric.tools.testbed import Testbed, require_root

    require_root()
    model = make_model(args.model_mib << 20)
    args.model_bytes = sum(a.nbytes for a in model.values())
    rates = {f"h{i}": (args.server_mbit, args.server_mbit) for i in range(args.shards)}
    print(f"{args.workers} workers, model {args.model_bytes / 2**20:.1f} MiB over "
          f"{args.shards} shards, chunk {args.chunk_mib} MiB, server links "
          f"{args.server_mbit:g} Mbit/s, worker links {args.worker_mbit:g} Mbit/s, "
          f"{args.repeats} repeats", flush=True)
    results: dict[str, list[dict[str, float]]] = {c: [] for c in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="bench-chunks-") as d:
        tmp = Path(d)
        token, init = job_files(tmp, model)
        with Testbed(hosts=args.shards + args.workers + 1, rate_mbit=args.worker_mbit,
                     rates=rates, mtu=9000, queue_ms=args.queue_ms) as tb:
            for r in range(args.repeats):
                for config in CONFIGS[r % 2:] + CONFIGS[:r % 2]:
                    res = run_one(tb, config, args, tmp, init, token)
                    results[config].append(res)
                    print(f"  repeat {r + 1}/{args.repeats}  {config:6s} {res['seconds']:7.1f} s"
                          f"  {res['throughput'] / 1e6:7.2f} MB/s  {res['grants']:.0f} chunk "
                          f"grants", flush=True)
    ratio = statistics.median(x["throughput"] / y["throughput"]
                              for x, y in zip(results["chunks"], results["whole"], strict=True))
    limit = 2 * args.shards * args.server_mbit * 1e6 / 8
    print()
    for config in CONFIGS:
        runs = results[config]
        print(f"{config:6s} {statistics.median(x['throughput'] for x in runs) / 1e6:8.2f} MB/s "
              f"({statistics.median(x['throughput'] for x in runs) / limit:.2f} of the "
              f"{args.shards} server links' limit)")
    print(f"chunks / whole throughput: {ratio:.3f} (median of per-repeat ratios)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
